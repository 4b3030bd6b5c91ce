"""The SMC workload, its hand-written floor, and per-step timing and counting.

N particles start from a 64-token prompt; at each of T steps every particle awaits
`next_token_logprobs(prompt + its tokens)` concurrently, then appends the token a seeded
trace gives it; every 5 steps the particles are resampled (copies of seeded ancestors).
Nothing here needs this checkout's `genlm.backend`: the released 0.3.1 runs the same workload.
"""

import asyncio
import itertools
import operator
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from statistics import median
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

from benchmarks.core import Figure, compare, record, set_threads, timed

PROMPT_LENGTH, RESAMPLE_EVERY, CHECKED = 64, 5, 12
Stamp = tuple[float, ...]


@dataclass
class Trace:
    """The seeded choices of one workload."""

    prompt: list[int]
    tokens: torch.Tensor  # [T, N]: the token particle n appends at step t
    ancestors: dict[int, list[int]]  # step -> resampled ancestor of every particle
    checks: set[tuple[int, int]]  # (step, particle) whose result is checked


def parse_configs(text: str) -> list[tuple[int, int]]:
    """`"10x32,32x128"` -> `[(10, 32), (32, 128)]`: (particles, steps) pairs."""
    return [(int(n), int(steps)) for n, steps in (pair.split("x") for pair in text.split(","))]


def make_trace(n: int, steps: int, vocab: int, seed: int = 0) -> Trace:
    """The seeded trace of N particles over T steps."""
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (PROMPT_LENGTH,), generator=generator).tolist()
    tokens = torch.randint(0, vocab, (steps, n), generator=generator)
    ancestors = {
        step: torch.randint(0, n, (n,), generator=generator).tolist()
        for step in range(RESAMPLE_EVERY - 1, steps, RESAMPLE_EVERY)
    }
    picks = torch.randint(0, steps * n, (CHECKED,), generator=generator).tolist()
    return Trace(prompt, tokens, ancestors, {divmod(p, n) for p in picks})


def step_costs(stamps: list[Stamp]) -> list[Stamp]:
    """Differences of successive step stamps, without step 0 (the prefill) and the last."""
    return [tuple(map(operator.sub, b, a)) for a, b in itertools.pairwise(stamps[1:])]


def median_of(costs: list[Stamp], column: int = 0) -> float:
    """Median of one column of per-step costs."""
    return median(cost[column] for cost in costs)


def wall_clock() -> Stamp:
    """A stamp of the wall clock alone."""
    return (time.perf_counter(),)


def run_reference(model: Any, trace: Trace, n: int, steps: int, clock=wall_clock) -> list:
    """The floor: one prefill, then one batched decode step of N tokens per step over a
    `DynamicCache` reordered at resampling; its `step_costs` by `clock`.

    It keeps the rows the sampler of `smc` keeps, for as long (each step's until the next
    step's are in, the checked ones to the end): rows kept across a forward pass decide
    where the allocator puts the next step's logits.
    """
    kept, device = {}, model.device
    with torch.no_grad():
        cache, stamps = DynamicCache(config=model.config), [clock()]
        out = model(
            torch.tensor([trace.prompt], device=device), past_key_values=cache, use_cache=True
        )
        keep_checked(kept, trace, 0, out.logits[:, -1].float().log_softmax(-1).expand(n, -1))
        cache.batch_repeat_interleave(n)
        for step in range(steps - 1):
            new = trace.tokens[step][:, None].to(device)
            if step in trace.ancestors:  # resampled after appending: reorder cache and tokens
                index = torch.tensor(trace.ancestors[step], device=device)
                cache.reorder_cache(index)
                new = new[index]
            positions = torch.full((n, 1), PROMPT_LENGTH + step, device=device)
            stamps.append(clock())
            out = model(new, position_ids=positions, past_key_values=cache, use_cache=True)
            keep_checked(kept, trace, step + 1, out.logits[:, -1].float().log_softmax(-1))
    return step_costs(stamps)


def keep_checked(kept: dict, trace: Trace, step: int, rows: Any) -> None:
    """Put the rows of `step` that the trace checks into `kept`, by (step, particle)."""
    for particle in range(len(rows)):
        if (step, particle) in trace.checks:
            kept[step, particle] = rows[particle]


async def smc(lm: Any, trace: Trace, n: int, steps: int, use_cache_kv=False, clock=wall_clock):
    """The sampler's loop: the results of the checked queries by context, and its
    `step_costs` by `clock`, stamped as each step's queries start."""
    if use_cache_kv:
        lm.cache_kv(trace.prompt)
    particles, stamps = [list(trace.prompt) for _ in range(n)], []
    tokens, sampled = trace.tokens.tolist(), {}  # the sampler's bookkeeping: no torch ops
    for step in range(steps):
        stamps.append(clock())
        rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in particles))
        for particle in range(n):
            if (step, particle) in trace.checks:
                sampled[tuple(particles[particle])] = rows[particle]
            particles[particle].append(tokens[step][particle])
        if step in trace.ancestors:
            particles = [list(particles[a]) for a in trace.ancestors[step]]
    return sampled, step_costs(stamps)


def cold(lm: Any) -> None:
    """Clear the backend's output cache (and vLLM's prefix cache)."""
    lm.clear_cache()
    if hasattr(lm, "llm_engine") and not lm.llm_engine.reset_prefix_cache():
        raise RuntimeError("vLLM did not reset its prefix cache")


def run_backend(
    lm: Any, trace: Trace, n: int, steps: int, cache_kv=False, sampled=None, clock=wall_clock
):
    """The SMC through `lm` after `cold(lm)`: wall and CPU seconds, and its per-step costs;
    the checked rows go into the dict `sampled`."""
    cold(lm)
    wall, cpu, (rows, costs) = timed(asyncio.run, smc(lm, trace, n, steps, cache_kv, clock))
    (sampled if sampled is not None else {}).update(rows)
    return wall, cpu, costs


def stamped_backend(lm: Any, trace: Trace, n: int, steps: int, clock=wall_clock, **run) -> list:
    """The per-step costs of `run_backend` (`run`: its `cache_kv` and `sampled`)."""
    return run_backend(lm, trace, n, steps, clock=clock, **run)[2]


def smc_figures(
    group: str,
    lm: Any,
    floor: Callable,
    configs: str,
    repeats: int,
    target: str,
    others: dict | None = None,
    cache_kv: bool = False,
    warm_up: bool = False,
) -> None:
    """Record rows `group/NxT` (`/cache_kv`: each backend run after `cache_kv(prompt)`): the
    SMC through `lm` against the call `floor(trace, n, steps)` (wall and CPU seconds) on
    every configuration, alternated `repeats` times (after an untimed round: `warm_up`);
    `others` (name -> backend) are timed alongside, in the notes."""
    others = others or {}
    for n, steps in parse_configs(configs):
        trace, sampled = make_trace(n, steps, lm.vocab_size), {}
        runs = {"floor": partial(timed, floor, trace, n, steps)}
        runs["ours"] = partial(run_backend, lm, trace, n, steps, cache_kv, sampled)
        for name, other in others.items():
            runs[name] = partial(run_backend, other, trace, n, steps, cache_kv)
        seconds = compare(runs, repeats, warm_up)
        notes = {f"{name} s": seconds[name][0] for name in others}
        notes |= {f"ours / {name}": seconds["ours"][0] / seconds[name][0] for name in others}
        notes["CPU s, " + " / ".join(runs)] = tuple(seconds[name][1] for name in runs)
        if hasattr(lm, "next_token_logprobs_uncached"):
            notes["max error"] = max_error(sampled, lm.next_token_logprobs_uncached)
        row_id = f"{group}/{n}x{steps}" + "/cache_kv" * cache_kv
        label = f"N={n}, T={steps}" + ", `cache_kv(prompt)` first" * cache_kv
        ours, theirs = seconds["ours"][0], seconds["floor"][0]
        record(Figure(row_id, label, "s", ours, theirs, target=target, notes=notes))


def max_error(sampled: dict, reference: Callable[[list[int]], torch.Tensor]) -> float:
    """Largest |difference| of sampled rows from `reference(context)`."""
    return max((row - reference(list(ids))).abs().max().item() for ids, row in sampled.items())


def forward_rows(model: Any, ids: list[int]) -> tuple[float, torch.Tensor]:
    """Seconds and log-probability rows of one plain forward pass of `model` over `ids`."""
    start = time.perf_counter()
    with torch.no_grad():
        rows = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return time.perf_counter() - start, rows


def load_hf(path: Any) -> tuple[Any, Any]:
    """A transformers model in float32 (eval mode) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(path))


def transformer(path: Any = None, threads: int | None = 0, **options: Any) -> tuple[Any, Any]:
    """`load_hf(path)` (default SmolLM2-135M) with `threads` torch threads, and an
    `AsyncTransformer` with `options` over it."""
    from genlm.backend.llm.hf import AsyncTransformer

    if path is None:
        from genlm.backend import assets

        path = assets.smollm2()
    set_threads(threads)
    model, tokenizer = load_hf(path)
    return model, AsyncTransformer(model, tokenizer, **options)


class ForwardTimer:
    """Adds up the seconds and the calls of `module`'s forward passes (None: nothing)."""

    def __init__(self, module: torch.nn.Module | None):
        self.seconds, self.calls, self._started = 0.0, 0, 0.0
        if module is not None:
            module.register_forward_pre_hook(self._enter)
            module.register_forward_hook(self._exit)

    def _enter(self, *_: Any) -> None:
        self._started = time.perf_counter()

    def _exit(self, *_: Any) -> None:
        self.seconds += time.perf_counter() - self._started
        self.calls += 1

    def read(self) -> Stamp:
        """Wall seconds now, forward seconds and calls so far."""
        return time.perf_counter(), self.seconds, self.calls


class OpCounter(TorchDispatchMode):
    """Counts by name the torch operators dispatched while active (in the entering thread)."""

    def __init__(self, counts: Counter | None = None):
        super().__init__()
        self.counts = Counter() if counts is None else counts

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs=None) -> Any:
        self.counts[func.name()] += 1
        return func(*args, **(kwargs or {}))

    def read(self) -> Stamp:
        """The operators counted so far, as a stamp."""
        return (self.counts.total(),)
