"""A launch budget counted on the CPU: what a GPU would feel of an SMC step.

Per steady step (median of steps 4..T-2), SmolLM2-135M, one torch thread: operations
reaching a kernel (not views, allocations, metadata changes), host syncs (operators
tagged `data_dependent_output` or `dynamic_output_shape`, masked `index`) and bytes
written, `AsyncTransformer` against `workload.run_reference`, N=32: `lockstep`,
`critic` (`scoring`'s critic; floor: the lockstep one) and `resample` (every step).
"""

import argparse
import asyncio
from collections import Counter
from operator import attrgetter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from benchmarks import workload
from benchmarks.core import Figure, median, record
from benchmarks.scoring import CriticRun, critic_setup

OPTIONS = {"n": (32, "particles"), "steps": 32, "workloads": "lockstep,critic,resample"}

aten = torch.ops.aten
FIRST_STEADY_STEP = 4
TARGETS = {"lockstep": "≤ 1× floor, no host sync", "critic": "≤ 2.15× floor"}
NO_KERNEL = frozenset(  # operators that reach no kernel (views are told by `is_view`)
    attrgetter(name)(aten)
    for name in """_unsafe_view.default empty.memory_format empty_strided.default
    new_empty.default new_empty_strided.default empty_like.default resize_.default
    set_.source_Tensor set_.source_Storage_storage_offset
    _has_compatible_shallow_copy_type.default""".split()
)
SYNC_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
MASK_INDEXING = frozenset({aten.index.Tensor, aten.index_put_.default, aten.index_put.default})


class LaunchCounter(TorchDispatchMode):
    """Counts operations, host synchronisations and bytes written while active."""

    def __init__(self) -> None:
        super().__init__()
        self.operations = self.syncs = self.bytes = 0
        self.sync_names: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs=None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.is_view or func in NO_KERNEL:
            return out
        self.operations += 1
        self.bytes += sum(t.nbytes for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        if func in MASK_INDEXING:  # tagged for their mask form only
            syncs = any(getattr(i, "dtype", None) in (torch.bool, torch.uint8) for i in args[1])
        else:
            syncs = any(tag in func.tags for tag in SYNC_TAGS)
        if syncs:
            self.syncs += 1
            self.sync_names[func.name()] += 1
        return out

    def read(self) -> tuple[int, int, int]:
        """Operations, host synchronisations and bytes so far."""
        return self.operations, self.syncs, self.bytes


def critic_costs(lm: Any, trace: workload.Trace, n: int, steps: int, clock: Any) -> list:
    """Per-step counts of the SMC with a `PromptedLLM` critic, cold (steps 1..T-2)."""
    critic, trace, tokens, _ = critic_setup(lm, trace)
    lm.clear_cache()
    return asyncio.run(CriticRun(lm, critic, trace, tokens, clock).steps(n, steps))[1:-1]


def count(run: Any, *args: Any) -> tuple[tuple, LaunchCounter]:
    """Medians over the steady steps of `run(*args, clock)`'s counts, and the counter."""
    counter = LaunchCounter()
    with counter:
        costs = run(*args, counter.read)[FIRST_STEADY_STEP - 1 :]
    return tuple(median(cost[i] for cost in costs) for i in range(len(costs[0]))), counter


def run(args: argparse.Namespace) -> None:
    """Count every workload and its floor."""
    from genlm.backend import assets, cache

    cache._MEMMOVE_DTYPES = frozenset()  # the output cache's copies through torch: counted
    model, lm = workload.transformer(assets.smollm2(fetch=False), threads=1)
    n, steps = args.n, args.steps
    base = workload.make_trace(n, steps, len(lm.tokenizer))
    generator = torch.Generator().manual_seed(2)
    every = {step: torch.randint(0, n, (n,), generator=generator).tolist() for step in range(steps)}
    traces = {"lockstep": workload.Trace(base.prompt, base.tokens, {}, base.checks)}
    traces["resample"] = workload.Trace(base.prompt, base.tokens, every, base.checks)
    floors = {}
    for name in args.workloads.split(","):
        kind = "resample" if name == "resample" else "lockstep"  # the critic's: lockstep
        trace = traces[kind]
        backend = critic_costs if name == "critic" else workload.stamped_backend
        if kind not in floors:
            floors[kind] = count(workload.run_reference, model, trace, n, steps)[0]
        floor = floors[kind]
        (ops, syncs, written), counter = count(backend, lm, trace, n, steps)
        notes = {"host syncs, floor / ours": (floor[1], syncs)}
        notes["MB written, floor / ours"] = (floor[2] / 1e6, written / 1e6)
        notes["MB ratio"] = written / floor[2]
        if counter.sync_names:
            notes["syncing operators (whole run)"] = dict(counter.sync_names)
        label = f"{name}, N={n}, T={steps}"
        target = TARGETS.get(name, "")
        record(Figure(f"launches/{name}", label, "ops", ops, floor[0], target=target, notes=notes))
