"""The SMC workload, its hand-written floor, and per-step timing and counting.

N particles start from a 64-token prompt; at each of T steps every particle awaits
`next_token_logprobs(prompt + its tokens)` concurrently, then appends the token a seeded
trace gives it; every 5 steps the particles are resampled (copies of seeded ancestors).
Nothing here imports `genlm.backend`: the released 0.3.1 runs the same workload.
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

from benchmarks.core import Figure, compare, record, timed

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


def run_reference(model: Any, trace: Trace, n: int, steps: int) -> tuple[float, float]:
    """The floor: one prefill, then one batched decode step of N tokens per step over a
    `DynamicCache` reordered at resampling; wall and CPU seconds.

    It keeps the rows the sampler of `smc` keeps, for as long (each step's until the next
    step's are in, the checked ones to the end): rows kept across a forward pass decide
    where the allocator puts the next step's logits.
    """
    start, start_cpu, kept, device = time.perf_counter(), time.process_time(), {}, model.device
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
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
            out = model(new, position_ids=positions, past_key_values=cache, use_cache=True)
            keep_checked(kept, trace, step + 1, out.logits[:, -1].float().log_softmax(-1))
    return time.perf_counter() - start, time.process_time() - start_cpu


def keep_checked(kept: dict, trace: Trace, step: int, rows: Any) -> None:
    """Put the rows of `step` that the trace checks into `kept`, by (step, particle)."""
    for particle in range(len(rows)):
        if (step, particle) in trace.checks:
            kept[step, particle] = rows[particle]


async def smc(lm: Any, trace: Trace, n: int, steps: int, use_cache_kv: bool = False) -> dict:
    """The sampler's loop; the results of the checked queries, by context."""
    if use_cache_kv:
        lm.cache_kv(trace.prompt)
    particles = [list(trace.prompt) for _ in range(n)]
    tokens, sampled = trace.tokens.tolist(), {}  # the sampler's bookkeeping: no torch ops
    for step in range(steps):
        rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in particles))
        for particle in range(n):
            if (step, particle) in trace.checks:
                sampled[tuple(particles[particle])] = rows[particle]
            particles[particle].append(tokens[step][particle])
        if step in trace.ancestors:
            particles = [list(particles[a]) for a in trace.ancestors[step]]
    return sampled


def run_backend(lm: Any, trace: Trace, n: int, steps: int, cache_kv=False, sampled=None):
    """Wall and CPU seconds of the SMC through `lm`, its caches cleared first (vLLM's prefix
    cache too); the checked rows go into the dict `sampled`."""
    lm.clear_cache()
    if hasattr(lm, "llm_engine"):
        lm.llm_engine.reset_prefix_cache()
    wall, cpu, rows = timed(lambda: asyncio.run(smc(lm, trace, n, steps, cache_kv)))
    (sampled if sampled is not None else {}).update(rows)
    return wall, cpu


def smc_figures(
    figure_id: str,
    label: str,
    lm: Any,
    floor: Callable,
    configs: str,
    repeats: int,
    *,
    target: str,
    others: dict | None = None,
    cache_kv: bool = False,
    warm_up: bool = False,
) -> None:
    """Record the SMC through `lm` against `floor(trace, n, steps)` (wall and CPU seconds)
    on every configuration, alternated; other backends' seconds in the notes.

    Args:
        figure_id: The row id, formatted with `n` and `steps`.
        label: The row's workload, formatted likewise.
        lm: The backend.
        floor: The floor of a configuration.
        configs: `NxT,NxT,...`.
        repeats: Runs of each.
        target: The row's target.
        others: Name -> another backend, timed alongside.
        cache_kv: Whether each backend run starts with `cache_kv(prompt)`.
        warm_up: Whether an untimed round runs first.
    """
    others = others or {}
    for n, steps in parse_configs(configs):
        trace, sampled = make_trace(n, steps, lm.vocab_size), {}
        runs = {"floor": partial(floor, trace, n, steps)}
        runs["ours"] = partial(run_backend, lm, trace, n, steps, cache_kv, sampled)
        for name, other in others.items():
            runs[name] = partial(run_backend, other, trace, n, steps, cache_kv)
        seconds = compare(runs, repeats, warm_up)
        notes = {f"{name} s": seconds[name][0] for name in others}
        notes |= {f"ours / {name}": seconds["ours"][0] / seconds[name][0] for name in others}
        notes["CPU s, " + " / ".join(runs)] = tuple(seconds[name][1] for name in runs)
        if hasattr(lm, "next_token_logprobs_uncached"):
            notes["max error"] = max_error(sampled, lm.next_token_logprobs_uncached)
        ours, theirs = seconds["ours"][0], seconds["floor"][0]
        row_id, text = (template.format(n=n, steps=steps) for template in (figure_id, label))
        record(Figure(row_id, text, "s", ours, theirs, target=target, notes=notes))


def max_error(sampled: dict, reference: Callable[[list[int]], torch.Tensor]) -> float:
    """Largest |difference| of sampled rows from `reference(context)`."""
    return max((row - reference(list(ids))).abs().max().item() for ids, row in sampled.items())


def forward_row(model: Any) -> Callable[[list[int]], torch.Tensor]:
    """The last log-probability row of one plain forward pass of `model` over a context."""

    def row(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)

    return row


def load_hf(path: Any) -> tuple[Any, Any]:
    """A transformers model in float32 (eval mode) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(path))


class Stamped:
    """Delegates to `target`; stamps `clock()` at calls 0, every, 2 * every, ... of `method`."""

    def __init__(self, target: Any, method: str, every: int, clock: Callable[[], Stamp]):
        self._target, self._method, self._every, self._clock = target, method, every, clock
        self._calls, self.stamps = 0, []

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
    """Differences of successive step stamps, without step 0 (the prefill) and the last."""
    return [tuple(map(operator.sub, b, a)) for a, b in itertools.pairwise(stamps[1:])]


def median_of(costs: list[Stamp], column: int = 0) -> float:
    """Median of one column of per-step costs."""
    return median(cost[column] for cost in costs)


def wall_clock() -> Stamp:
    """A stamp of the wall clock alone."""
    return (time.perf_counter(),)


def stamped_floor(model: Any, trace: Trace, n: int, steps: int, clock=wall_clock) -> list:
    """Per-step costs of the floor (a stamp per model call)."""
    stamped = Stamped(model, "__call__", 1, clock)
    run_reference(stamped, trace, n, steps)
    return step_costs(stamped.stamps)


def stamped_backend(lm: Any, trace: Trace, n: int, steps: int, clock=wall_clock) -> list:
    """Per-step costs of the SMC through `lm` (a stamp per step's first query)."""
    stamped = Stamped(lm, "next_token_logprobs", n, clock)
    run_backend(stamped, trace, n, steps)
    return step_costs(stamped.stamps)


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
