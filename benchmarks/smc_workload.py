"""The SMC workload of the SMC benchmarks, and per-step timing.

N particles start from a 64-token prompt; at each of T steps every particle
awaits `next_token_logprobs(prompt + its tokens)` concurrently
(`asyncio.gather`), then appends the token a fixed seeded trace gives it; every
5 steps the particles are resampled (replaced by copies of seeded random
ancestors). `run_reference` is the hand-written floor: one prefill of the
prompt, then one batched decode step of N new tokens per step over one
`DynamicCache`, reordered at resampling.

Nothing here imports `genlm.backend`: the backend is passed in, so the released
genlm-backend runs the same workload (`bench_released.py`).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

PROMPT_LENGTH = 64
RESAMPLE_EVERY = 5
SAMPLED_QUERIES = 12  # (step, particle) results a run returns, to be checked
Stamp = tuple[float, ...]


@dataclass
class Trace:
    """The seeded choices of one workload."""

    prompt: list[int]
    tokens: torch.Tensor  # [T, N]: the token particle n appends at step t
    ancestors: dict[int, list[int]]  # step -> resampled ancestor of every particle
    checks: set[tuple[int, int]]  # (step, particle) whose result is compared to the reference


def parse_configs(text: str) -> list[tuple[int, int]]:
    """`"10x32,32x128"` -> `[(10, 32), (32, 128)]`: (particles, steps) pairs."""
    return [(int(n), int(steps)) for n, steps in (pair.split("x") for pair in text.split(","))]


def make_trace(n: int, steps: int, vocab: int, seed: int = 0) -> Trace:
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (PROMPT_LENGTH,), generator=generator).tolist()
    tokens = torch.randint(0, vocab, (steps, n), generator=generator)
    ancestors = {
        step: torch.randint(0, n, (n,), generator=generator).tolist()
        for step in range(RESAMPLE_EVERY - 1, steps, RESAMPLE_EVERY)
    }
    picks = torch.randint(0, steps * n, (SAMPLED_QUERIES,), generator=generator).tolist()
    return Trace(prompt, tokens, ancestors, {divmod(p, n) for p in picks})


def run_reference(model, trace: Trace, n: int, steps: int) -> tuple[float, float]:
    """Hand-written batched decode; returns wall and CPU seconds.

    It keeps the results the sampler of `smc` keeps, for as long: each step's
    rows until the next step's are in, and the checked rows to the end. Memory
    kept across a forward pass decides where the allocator puts the next
    step's logits (reused or freshly mapped pages), so a floor that dropped
    its results would be measured on a different memory pattern.
    """
    start, start_cpu = time.perf_counter(), time.process_time()
    kept = {}
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        out = model(torch.tensor([trace.prompt]), past_key_values=cache, use_cache=True)
        rows = torch.log_softmax(out.logits[:, -1].float(), dim=-1).expand(n, -1)
        keep_checked(kept, trace, 0, rows)
        cache.batch_repeat_interleave(n)
        length = PROMPT_LENGTH
        for step in range(steps - 1):
            new = trace.tokens[step][:, None]
            if step in trace.ancestors:
                # Particles were resampled after appending: reorder the cache and the new tokens.
                index = torch.tensor(trace.ancestors[step])
                cache.reorder_cache(index)
                new = new[index]
            positions = torch.full((n, 1), length)
            out = model(new, position_ids=positions, past_key_values=cache, use_cache=True)
            rows = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
            keep_checked(kept, trace, step + 1, rows)
            length += 1
    return time.perf_counter() - start, time.process_time() - start_cpu


def keep_checked(kept: dict, trace: Trace, step: int, rows) -> None:
    """Put the rows of `step` that the trace checks into `kept`, by (step, particle)."""
    for particle in range(len(rows)):
        if (step, particle) in trace.checks:
            kept[step, particle] = rows[particle]


async def smc(lm: Any, trace: Trace, n: int, steps: int, use_cache_kv: bool):
    """The sampler's loop; returns the results of the sampled queries."""
    if use_cache_kv:
        lm.cache_kv(trace.prompt)
    particles = [list(trace.prompt) for _ in range(n)]
    tokens = trace.tokens.tolist()  # the sampler's own bookkeeping dispatches no torch ops
    sampled = {}
    for step in range(steps):
        rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in particles))
        for particle in range(n):
            if (step, particle) in trace.checks:
                sampled[tuple(particles[particle])] = rows[particle]
        for particle in range(n):
            particles[particle].append(tokens[step][particle])
        if step in trace.ancestors:
            particles = [list(particles[a]) for a in trace.ancestors[step]]
    return sampled


def run_backend(lm: Any, trace: Trace, n: int, steps: int, use_cache_kv: bool):
    """Returns wall seconds, CPU seconds and the sampled results."""
    lm.clear_cache()
    start, start_cpu = time.perf_counter(), time.process_time()
    sampled = asyncio.run(smc(lm, trace, n, steps, use_cache_kv))
    return time.perf_counter() - start, time.process_time() - start_cpu, sampled


class Stamped:
    """Delegates to `target`; reads `clock` at every `every`-th call of its method `method`.

    Args:
        target: The object to wrap.
        method: The name of the method to stamp (`"__call__"` for calling the object).
        every: Stamp calls 0, every, 2 * every, ...
        clock: What a stamp records (time, or an operator count).
    """

    def __init__(self, target: Any, method: str, every: int, clock: Callable[[], Stamp]):
        self._target, self._method, self._every, self._clock = target, method, every, clock
        self._calls = 0
        self.stamps: list[Stamp] = []

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if name != self._method:
            return value

        def stamped(*args: Any, **kwargs: Any) -> Any:
            if self._calls % self._every == 0:
                self.stamps.append(self._clock())
            self._calls += 1
            return value(*args, **kwargs)

        return stamped

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__getattr__("__call__")(*args, **kwargs)


def step_costs(stamps: list[Stamp]) -> list[Stamp]:
    """Differences of successive step stamps, without step 0 (the prefill)."""
    return [
        tuple(y - x for x, y in zip(a, b, strict=True))
        for a, b in zip(stamps[1:-1], stamps[2:], strict=True)
    ]


def median_of(costs: list[Stamp], column: int = 0) -> float:
    """Median of one column of per-step costs."""
    return statistics.median(cost[column] for cost in costs)
