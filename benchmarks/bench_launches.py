"""A launch budget, counted on the CPU: what a GPU would feel of an SMC step.

On a GPU every tensor operation that reaches a kernel is one launch (a few
microseconds of host time each, however small the tensor), every host
synchronisation stalls the host until the device has caught up, and every
byte written costs memory bandwidth. This script counts the three, per
steady-state SMC step, on SmolLM2-135M (float32, CPU, one torch thread), for
`AsyncTransformer` (each step: `await asyncio.gather(*(lm.next_token_logprobs(ctx)
for ctx in particles))`) and for the hand-written floor of `smc_workload.py`
(`run_reference`: one batched decode step over a `DynamicCache`), on three
workloads with N=32 particles from a 64-token prompt, T=32 steps:

- `lockstep`: every particle appends its token, no resampling;
- `critic`: the lockstep SMC with an LLM critic: after every step each
  particle's tokens are scored by genlm-control's `PromptedLLM` under its own
  32-token prompt (`bench_scoring.CriticRun`: every prefix of the critic's
  context asked in one `batch_next_token_logprobs` call, all but the newest
  found in the output cache). Its floor is the floor's lockstep step: a critic
  step needs two passes of one new token per particle, 2x that floor;
- `resample`: every particle is replaced by a copy of a seeded random
  ancestor after every step (the floor reorders its cache, `reorder_cache`).

A step is counted from its first `next_token_logprobs` call to the next
step's (the backend), or from one decode call of the model to the next (the
floor); the critic step from the start of its `gather` to its end. Printed per
workload: medians over steps 4..T-2 (the first steps fill the caches) of the
operations, host synchronisations and megabytes written, for backend and floor,
and their ratios; the critic row's floor column is the floor's lockstep step.

What is counted, with a `torch.utils._python_dispatch.TorchDispatchMode` (every
operator call that reaches the dispatcher below autograd, in this thread):

- operations: every operator call except those that launch no kernel on a GPU:
  views and other aliasing ops (`OpOverload.is_view`: `view`, `as_strided`,
  `t`, `transpose`, `expand`, `slice`, `select`, `unsqueeze`, `squeeze`,
  `permute`, `alias`, `detach`, `lift_fresh`, `_reshape_alias`, ...), which
  only compute sizes and strides; `_unsafe_view` (a view whose schema does not
  say so); allocations (`empty`, `empty_strided`, `new_empty`,
  `new_empty_strided`, `empty_like`: the caching allocator hands memory out
  without a kernel); and metadata changes (`resize_`, `set_`,
  `_has_compatible_shallow_copy_type`). Composite operators are counted as
  they reach the dispatcher (`zeros` is one operation, as it is one fill
  kernel); operations on empty tensors are counted too;
- host synchronisations: operators whose result the host needs before it can
  go on, those tagged `data_dependent_output` (`_local_scalar_dense`, which
  `.item()`, `int(t)`, `float(t)` and `bool(t)` reach; `equal`, ...) or
  `dynamic_output_shape` (`nonzero`, `unique`, `_unique2`,
  `unique_consecutive`, `masked_select`, `repeat_interleave` without
  `output_size`, ...), and `index` / `index_put_` with a boolean mask (which
  run `nonzero` inside). They are counted among the operations as well, and
  the kinds seen are printed;
- bytes written: the sum of the `nbytes` of the outputs of every counted
  operation (in-place and `out=` operations: of the tensor written).

Limits of the proxy: on the CPU the backend's small host-side tensors (token
ids, positions, masks, read columns; moved to the device once on a GPU) are
counted like device tensors, their operations as launches and a `unique` on
them as a synchronisation, where on a GPU they cost host time but no launch
or stall; reading a CPU tensor's memory without an operator (`.tolist()`,
`.numpy()`) is invisible, where on a GPU it is a device-to-host copy. The
output cache copies CPU rows through numpy when torch runs one thread; this
script turns that off (`cache._MEMMOVE_DTYPES`) so that its copies are the
torch copies a GPU would make, and counted. MLX is not counted: its
operations never reach torch's dispatcher, and MLX has no equivalent hook.

Targets (issue 32): the lockstep step at most the floor's operations and bytes,
no host synchronisation; the critic step at most 2.15x the floor's lockstep
step in operations. Figures only, nothing asserted.

Run: `HF_HUB_OFFLINE=1 python benchmarks/bench_launches.py [--n 32] [--steps 32]
[--workloads lockstep,critic,resample] [--names]`; `--names` adds, per
workload, the operators per step by name where backend and floor differ most.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from collections import Counter
from typing import Any

import torch
from bench_scoring import CRITIC_PROMPT_LENGTH, CriticRun, in_vocabulary
from smc_workload import Stamped, Trace, make_trace, run_backend, run_reference, step_costs
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM, AutoTokenizer

from genlm.backend import assets, cache
from genlm.backend.llm.hf import AsyncTransformer

aten = torch.ops.aten
FIRST_STEADY_STEP = 4
TARGETS = {  # issue 32
    "lockstep": "<=1x, 0 syncs",  # backend / floor, operations and bytes
    "critic": "<=2.15x ops",  # critic step / the floor's lockstep step
}
NO_KERNEL = frozenset(
    {
        aten._unsafe_view.default,
        aten.empty.memory_format,
        aten.empty_strided.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
        aten.empty_like.default,
        aten.resize_.default,
        aten.set_.source_Storage_storage_offset,
        aten.set_.source_Tensor,
        aten._has_compatible_shallow_copy_type.default,
    }
)
SYNC_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
MASK_INDEXING = frozenset({aten.index.Tensor, aten.index_put_.default, aten.index_put.default})
Count = tuple[int, int, int]  # operations, host synchronisations, bytes written


class LaunchCounter(TorchDispatchMode):
    """Counts operations, host synchronisations and bytes written while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.operations = self.syncs = self.bytes = 0
        self.by_name: Counter[str] = Counter()
        self.sync_names: Counter[str] = Counter()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.is_view or func in NO_KERNEL:
            return out
        self.operations += 1
        self.by_name[func.name()] += 1
        self.bytes += sum(t.nbytes for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        if (
            _has_mask(args)
            if func in MASK_INDEXING  # tagged for their mask form only
            else any(tag in func.tags for tag in SYNC_TAGS)
        ):
            self.syncs += 1
            self.sync_names[func.name()] += 1
        return out

    def read(self) -> Count:
        """The counts so far."""
        return self.operations, self.syncs, self.bytes


def _has_mask(args: tuple) -> bool:
    """Whether an `index` / `index_put` call's indices (its second argument) hold a mask."""
    return any(
        isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)
        for index in args[1]
    )


class Named:
    """Reads a counter as operations per name, for the per-step differences by name."""

    def __init__(self, counter: LaunchCounter, names: list[str]):
        self.counter, self.names = counter, names

    def read(self) -> tuple[int, ...]:
        return tuple(self.counter.by_name[name] for name in self.names)


def steady(costs: list[tuple[int, ...]]) -> tuple[float, ...]:
    """Per-column medians over the costs of steps FIRST_STEADY_STEP on (index = step - 1)."""
    kept = costs[FIRST_STEADY_STEP - 1 :]
    return tuple(statistics.median(cost[i] for cost in kept) for i in range(len(kept[0])))


def floor_costs(model: Any, trace: Trace, n: int, steps: int, counts: Any) -> list[tuple]:
    """Per-step counts of the hand-written floor (from its second decode call)."""
    stamped = Stamped(model, "__call__", 1, counts.read)
    run_reference(stamped, trace, n, steps)
    return step_costs(stamped.stamps)


def backend_costs(lm: AsyncTransformer, trace: Trace, n: int, steps: int, counts: Any) -> list:
    """Per-step counts of the SMC through the backend, cold (from its second step)."""
    stamped = Stamped(lm, "next_token_logprobs", n, counts.read)
    run_backend(stamped, trace, n, steps, use_cache_kv=False)
    return step_costs(stamped.stamps)


def critic_costs(lm: AsyncTransformer, trace: Trace, n: int, steps: int, counts: Any) -> list:
    """Per-step counts of the SMC with a `PromptedLLM` critic, cold (from its second step)."""
    from genlm.control import PromptedLLM

    vocab = len(lm.tokenizer)
    generator = torch.Generator().manual_seed(1)
    critic_prompt = torch.randint(0, vocab, (CRITIC_PROMPT_LENGTH,), generator=generator)
    critic = PromptedLLM(lm, prompt_ids=critic_prompt.tolist())
    tokens = {token.token_id: token for token in critic.vocab}
    trace = in_vocabulary(trace, set(tokens), vocab)
    lm.clear_cache()
    run = CriticRun(lm, critic, trace, tokens, counts)  # it reads `counts.read()` per step
    # Its step loop itself (`per_step` would take medians over steps 1..T-1), steps 1..T-2.
    return asyncio.run(run._smc(n, steps))[1:-1]


def traces(n: int, steps: int, vocab: int) -> dict[str, Trace]:
    """The seeded traces: no resampling, and resampling after every step."""
    base = make_trace(n, steps, vocab)
    generator = torch.Generator().manual_seed(2)
    every = {step: torch.randint(0, n, (n,), generator=generator).tolist() for step in range(steps)}
    return {
        "lockstep": Trace(base.prompt, base.tokens, {}, base.checks),
        "resample": Trace(base.prompt, base.tokens, every, base.checks),
    }


def measure(
    counter: LaunchCounter, run: Any, *args: Any, names: list[str] | None = None
) -> tuple[float, ...]:
    """Steady-state counts per step of `run(*args, counts)`, or per name in `names`."""
    counts = counter if names is None else Named(counter, names)
    with counter:
        return steady(run(*args, counts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=32, help="particles")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--workloads", default="lockstep,critic,resample")
    parser.add_argument("--names", action="store_true", help="operators by name, per workload")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cache._MEMMOVE_DTYPES = frozenset()  # the output cache's copies through torch: counted
    path = str(assets.smollm2(fetch=False))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    lm = AsyncTransformer(model, tokenizer)
    n, steps = args.n, args.steps
    by_trace = traces(n, steps, len(tokenizer))
    runs = {
        "lockstep": (backend_costs, lm, by_trace["lockstep"]),
        "critic": (critic_costs, lm, by_trace["lockstep"]),
        "resample": (backend_costs, lm, by_trace["resample"]),
    }
    floors = {"lockstep": "lockstep", "critic": "lockstep", "resample": "resample"}
    print(
        f"SmolLM2-135M float32, CPU, 1 torch thread; N={n}, T={steps}; per step, median over "
        f"steps {FIRST_STEADY_STEP}..{steps - 2}: operations reaching a kernel (ops), host "
        "synchronisations (syncs), MB written"
    )
    header = ("workload", "ops", "floor ops", "ratio", "syncs", "floor syncs", "MB")
    header += ("floor MB", "ratio", "target")
    print(f"{header[0]:<10}" + "".join(f"{h:>12}" for h in header[1:]))
    floor_counts: dict[str, tuple[float, ...]] = {}
    for workload in args.workloads.split(","):
        floor_trace = by_trace[floors[workload]]
        counter = LaunchCounter()
        if floors[workload] not in floor_counts:
            floor_counts[floors[workload]] = measure(
                counter, floor_costs, model, floor_trace, n, steps
            )
        floor_ops, floor_syncs, floor_bytes = floor_counts[floors[workload]]
        run, target_lm, trace = runs[workload]
        ops, syncs, written = measure(counter, run, target_lm, trace, n, steps)
        print(
            f"{workload:<10}{ops:>12,.0f}{floor_ops:>12,.0f}{ops / floor_ops:>12.2f}"
            f"{syncs:>12.0f}{floor_syncs:>12.0f}{written / 1e6:>12.1f}{floor_bytes / 1e6:>12.1f}"
            f"{written / floor_bytes:>12.2f}{TARGETS.get(workload, ''):>18}",
            flush=True,
        )
        if counter.sync_names:
            print(f"{'':<10}synchronising operators of the whole runs: {dict(counter.sync_names)}")
        if args.names:
            print_names(counter, model, runs[workload], floor_trace, n, steps)
    print("MLX: not counted (its operations do not reach torch's dispatcher).")


def print_names(
    counter: LaunchCounter,
    model: Any,
    run: tuple,
    floor_trace: Trace,
    n: int,
    steps: int,
) -> None:
    """Operators per step by name, backend and floor, where they differ most (new runs)."""
    names = sorted(counter.by_name)
    print(f"{'':<10}{'operator, per step':<40}{'backend':>10}{'floor':>10}")
    backend = measure(LaunchCounter(), run[0], *run[1:], n, steps, names=names)
    floor = measure(LaunchCounter(), floor_costs, model, floor_trace, n, steps, names=names)
    rows = sorted(zip(names, backend, floor, strict=True), key=lambda r: -abs(r[1] - r[2]))
    for name, ours, theirs in rows[:12]:
        print(f"{'':<10}{name:<40}{ours:>10.0f}{theirs:>10.0f}")


if __name__ == "__main__":
    main()
