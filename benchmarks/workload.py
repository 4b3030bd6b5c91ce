"""The SMC workload (N particles from a 64-token prompt await `next_token_logprobs` together, append
a seeded token, T steps; seeded resampling every 5), its floor `run_reference`, per-step timing and
counting. Needs no `genlm.backend` of this checkout: 0.3.1 runs it."""

import asyncio
import gc
import itertools
import operator
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from statistics import median
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from benchmarks.core import Figure, compare, record, set_threads, timed

PROMPT_LENGTH, RESAMPLE_EVERY, CHECKED = 64, 5, 12
Stamp = tuple[float, ...]
aten = torch.ops.aten
NO_KERNEL = frozenset(  # operators that reach no kernel (views are told by `is_view`)
    operator.attrgetter(name)(aten)
    for name in """_unsafe_view.default empty.memory_format empty_strided.default new_empty.default
    new_empty_strided.default empty_like.default resize_.default set_.source_Tensor
    set_.source_Storage_storage_offset _has_compatible_shallow_copy_type.default""".split()
)
SYNC_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
MASK_INDEXING = frozenset({aten.index.Tensor, aten.index_put_.default, aten.index_put.default})


@dataclass
class Trace:
    """The seeded choices of one workload."""

    prompt: list[int]
    tokens: torch.Tensor  # [T, N]: the token particle n appends at step t
    ancestors: dict[int, list[int]]  # step -> resampled ancestor of every particle
    checks: set[tuple[int, int]]  # (step, particle) whose result is checked


def parse_configs(text: str) -> list[tuple[int, int]]:
    """`"10x32,32x128"` -> `[(10, 32), (32, 128)]`: (particles, steps) pairs (`""`: none)."""
    pairs = (pair.split("x") for pair in text.split(",") if pair)
    return [(int(n), int(steps)) for n, steps in pairs]


def make_trace(
    n: int,
    steps: int,
    vocab: int,
    seed: int = 0,
    resample: int = RESAMPLE_EVERY,
    prompt_length: int = PROMPT_LENGTH,
) -> Trace:
    """The seeded trace of N particles over T steps from a `prompt_length`-token prompt, resampled
    every `resample` (0: never)."""
    draw = partial(torch.randint, generator=torch.Generator().manual_seed(seed))
    prompt, tokens = draw(0, vocab, (prompt_length,)).tolist(), draw(0, vocab, (steps, n))
    every = range(resample - 1, steps, resample) if resample else ()
    ancestors = {step: draw(0, n, (n,)).tolist() for step in every}
    picks = draw(0, steps * n, (CHECKED,)).tolist()
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


@torch.no_grad()
def run_reference(model: Any, trace: Trace, n: int, steps: int, clock=wall_clock) -> list:
    """The floor: a prefill, then a batched decode step per step over a `DynamicCache` reordered
    at resampling; its `step_costs` by `clock`. Keeps `smc`'s rows as long (for the allocator)."""
    kept, device, cache, stamps = {}, model.device, DynamicCache(config=model.config), [clock()]
    out = model(torch.tensor([trace.prompt], device=device), past_key_values=cache, use_cache=True)
    keep_checked(kept, trace, 0, out.logits[:, -1].float().log_softmax(-1).expand(n, -1))
    cache.batch_repeat_interleave(n)
    for step in range(steps - 1):
        new = trace.tokens[step][:, None].to(device)
        if step in trace.ancestors:  # resampled after appending: reorder cache and tokens
            index = torch.tensor(trace.ancestors[step], device=device)
            cache.reorder_cache(index)
            new = new[index]
        positions = torch.full((n, 1), len(trace.prompt) + step, device=device)
        stamps.append(clock())
        out = model(new, position_ids=positions, past_key_values=cache, use_cache=True)
        keep_checked(kept, trace, step + 1, out.logits[:, -1].float().log_softmax(-1))
    return step_costs(stamps)


def keep_checked(kept: dict, trace: Trace, step: int, rows: Any) -> None:
    """Put the rows of `step` that the trace checks into `kept`, by (step, particle)."""
    kept.update({(at, particle): rows[particle] for at, particle in trace.checks if at == step})


async def smc(lm, trace, n, steps, cache_kv=False, clock=wall_clock, critic=None, scores=None):
    """The sampler's loop: checked rows by context, `step_costs`. `critic`: a `PromptedLLM` each
    particle then awaits the `score` of (the last step's (tokens, score) pairs go to `scores`)."""
    if cache_kv:
        lm.cache_kv(trace.prompt)
    particles, stamps, sampled = [list(trace.prompt) for _ in range(n)], [], {}
    tokens = trace.tokens.tolist()  # the sampler's bookkeeping: no torch ops
    vocab = {token.token_id: token for token in critic.vocab} if critic else {}

    async def extend(particle: int, step: int) -> None:
        context = particles[particle]
        row = await lm.next_token_logprobs(context)
        if (step, particle) in trace.checks:
            sampled[tuple(context)] = row
        context.append(tokens[step][particle])
        if critic is not None:
            score = await critic.score([vocab[token] for token in context[len(trace.prompt) :]])
            if step == steps - 1 and scores is not None:
                scores.append((context[len(trace.prompt) :], float(score)))

    for step in range(steps):
        stamps.append(clock())
        await asyncio.gather(*(extend(particle, step) for particle in range(n)))
        if step in trace.ancestors:
            particles = [list(particles[a]) for a in trace.ancestors[step]]
    return sampled, step_costs(stamps)


def cold(lm: Any) -> None:
    """Clear the backend's output cache, its live engine requests (0.3.1's vLLM backend keeps
    them: `release_all`) and vLLM's prefix cache."""
    lm.clear_cache()
    if hasattr(lm, "release_all"):
        asyncio.run(lm.release_all())
    if hasattr(lm, "llm_engine") and not lm.llm_engine.reset_prefix_cache():
        raise RuntimeError("vLLM did not reset its prefix cache")


def run_backend(lm: Any, trace: Trace, n: int, steps: int, cache_kv=False, sampled=None, **run):
    """`smc` through `lm` after `cold(lm)` (`run`: its `clock`, `critic`, `scores`): wall
    and CPU seconds, and its per-step costs; the checked rows go into the dict `sampled`."""
    cold(lm)
    outcome = []

    async def main() -> None:
        # Returns nothing: Python 3.11's `asyncio.run` formats its main task, result included,
        # as it exits (`signal.getsignal`), and the repr of the rows would be timed too.
        outcome.append(await smc(lm, trace, n, steps, cache_kv, **run))

    wall, cpu, _ = timed(asyncio.run, main())
    rows, costs = outcome[0]
    (sampled if sampled is not None else {}).update(rows)
    return wall, cpu, costs


def stamped_backend(lm: Any, trace: Trace, n: int, steps: int, **run: Any) -> list:
    """`run_backend`'s per-step costs alone."""
    return run_backend(lm, trace, n, steps, **run)[2]


def decode_step(decode: Callable, trace: Trace, n: int, steps: int, clock=wall_clock) -> list:
    """An engine's decode step of N sequences, as one step cost: `decode(trace, n, T)` (N
    sequences of the trace's prompt decoding T tokens together) less `decode(trace, n, 1)` (the
    prefill and a first token), over T - 1, in every column of `clock`."""
    costs = []
    for tokens in (1, steps):
        start = clock()
        decode(trace, n, tokens)
        costs.append(tuple(map(operator.sub, clock(), start)))
    return [tuple((long - short) / (steps - 1) for short, long in zip(*costs, strict=True))]


def step_ms(step_costs_of: Callable, *args: Any) -> tuple[float, float]:
    """The mean and the median of `step_costs_of(*args)`'s wall seconds, in ms."""
    costs = step_costs_of(*args)
    return 1e3 * sum(cost[0] for cost in costs) / len(costs), 1e3 * median_of(costs)


def step_figures(
    group: str,
    lm: Any,
    decode: Callable,
    configs: str,
    repeats: int,
    warm_up: bool = False,
    targets: tuple[str, str] = ("", ""),
) -> None:
    """Record `group/step/NxT` (resampled every 5 steps) and `.../no-resampling`: the SMC's
    mean ms per step through `lm` against the engine's decode step (`decode_step` of `decode`),
    alternated (medians of the runs; after an untimed one of each: `warm_up`); `targets`: the
    two rows' targets."""
    for n, steps in parse_configs(configs):
        rows = ((RESAMPLE_EVERY, "", targets[0]), (0, "/no-resampling", targets[1]))
        for resample, suffix, target in rows:
            trace = make_trace(n, steps, lm.vocab_size, resample=resample)
            runs = {
                "floor": partial(step_ms, decode_step, decode, trace, n, steps),
                "ours": partial(step_ms, stamped_backend, lm, trace, n, steps),
            }
            ms = compare(runs, repeats, warm_up)
            (ours, ours_median), (floor, _) = ms["ours"], ms["floor"]
            label = f"N={n}, T={steps}, a step" + (", no resampling" if resample == 0 else "")
            label += " (mean; floor: the engine's decode step, prefill excluded)"
            row_id = f"{group}/step/{n}x{steps}{suffix}"
            notes = {"ours, median step ms": ours_median}
            record(Figure(row_id, label, "ms", ours, floor, target=target, notes=notes))


def smc_figures(
    group,
    lm,
    floor,
    configs,
    repeats,
    target,
    others=None,
    cache_kv=False,
    warm_up=False,
    references=None,
):
    """Record rows `group/NxT[/cache_kv]`: `smc` through `lm` (and `others`, name -> backend,
    and `references`, name -> a second floor, in the notes) against `floor(trace, n, steps)`,
    alternated (`core.compare`)."""
    others, references = others or {}, references or {}
    for n, steps in parse_configs(configs):
        trace, sampled = make_trace(n, steps, lm.vocab_size), {}
        runs = {"floor": partial(timed, floor, trace, n, steps)}
        runs["ours"] = partial(run_backend, lm, trace, n, steps, cache_kv, sampled)
        for name, other in others.items():
            runs[name] = partial(run_backend, other, trace, n, steps, cache_kv)
        for name, reference in references.items():
            runs[name] = partial(timed, reference, trace, n, steps)
        seconds = compare(runs, repeats, warm_up)
        named = [*others, *references]
        notes = {f"{name} s": seconds[name][0] for name in named}
        notes |= {f"ours / {name}": seconds["ours"][0] / seconds[name][0] for name in named}
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
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(path))


def transformer(path: Any = None, threads: int | None = 0, **options: Any) -> tuple[Any, Any]:
    """`load_hf(path)` (None: SmolLM2-135M), `threads` threads, an `AsyncTransformer(**options)`."""
    from genlm.backend.llm.hf import AsyncTransformer

    if path is None:  # (0.3.1 has no `assets`: its children pass a path)
        from genlm.backend import assets

        path = assets.smollm2()
    set_threads(threads)
    model, tokenizer = load_hf(path)
    return model, AsyncTransformer(model, tokenizer, **options)


class ForwardTimer:
    """Adds up the seconds and the calls of `module`'s forward passes (None: nothing)."""

    def __init__(self, module: torch.nn.Module | None):
        self.seconds, self.calls, self.start = 0.0, 0, 0.0
        if module is not None:
            module.register_forward_pre_hook(lambda *_: setattr(self, "start", time.perf_counter()))
            module.register_forward_hook(lambda *_: self.add(time.perf_counter() - self.start))

    def add(self, seconds: float) -> None:
        """Count one forward pass of `seconds`."""
        self.seconds, self.calls = self.seconds + seconds, self.calls + 1

    def read(self) -> Stamp:
        """Wall seconds now, forward seconds and calls so far."""
        return time.perf_counter(), self.seconds, self.calls


class CollectorTimer:
    """Adds up the seconds Python's garbage collector runs, in any thread, while entered."""

    def __init__(self) -> None:
        self.seconds, self._start = 0.0, 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start

    def __enter__(self) -> "CollectorTimer":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        gc.callbacks.remove(self._callback)


class BytecodeCounter:
    """Counts the Python bytecode instructions that this package's code and vLLM's run, in
    every thread, while entered: host work measured without the machine's speed, which on
    these shared cores moves more from hour to hour than a cut of 0.1 ms a step (`read`'s
    columns: this package, vLLM). A vLLM backend's engine thread, running already, is
    traced through its loop (`lm`)."""

    def __init__(self, lm: Any = None) -> None:
        self.counts = [0, 0]
        self._engine = getattr(lm, "_engine", None)
        self._kinds: dict[Any, int | None] = {}
        self._local = [self._counter(kind) for kind in range(2)]

    def _counter(self, kind: int) -> Callable:
        counts = self.counts

        def count(frame: Any, event: str, arg: Any) -> Callable:
            if event == "opcode":
                counts[kind] += 1
            return count

        return count

    def _trace(self, frame: Any, event: str, arg: Any) -> Callable | None:
        code = frame.f_code
        if (kind := self._kinds.get(code, -1)) == -1:
            path = code.co_filename.replace("\\", "/")
            kind = self._kinds[code] = (
                0 if "/genlm/backend/" in path else (1 if "/vllm/" in path else None)
            )
        if kind is None:
            return None
        frame.f_trace_lines, frame.f_trace_opcodes = False, True
        return self._local[kind]

    def __enter__(self) -> "BytecodeCounter":
        threading.settrace(self._trace)
        sys.settrace(self._trace)
        if self._engine is not None:
            self._engine.call(sys.settrace, self._trace).result()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._engine is not None:
            self._engine.call(sys.settrace, None).result()
        sys.settrace(None)
        threading.settrace(None)

    def read(self) -> Stamp:
        """Bytecodes run so far: this package's, vLLM's."""
        return tuple(self.counts)


class OpCounter(TorchDispatchMode):
    """Counts torch operators dispatched in the entering thread; of them operations reaching
    a kernel (not views, allocations, metadata), host syncs (by tag; masked `index`), bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.dispatched = self.operations = self.bytes = 0
        self.sync_names: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs=None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.dispatched += 1
        if func.is_view or func in NO_KERNEL:
            return out
        self.operations += 1
        self.bytes += sum(t.nbytes for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        if func in MASK_INDEXING:  # tagged for their mask form only
            syncs = any(getattr(i, "dtype", None) in (torch.bool, torch.uint8) for i in args[1])
        else:
            syncs = any(tag in func.tags for tag in SYNC_TAGS)
        if syncs:
            self.sync_names[func.name()] += 1
        return out

    def read(self) -> Stamp:
        """Operations, host syncs, bytes written and operators dispatched so far."""
        return self.operations, sum(self.sync_names.values()), self.bytes, self.dispatched
