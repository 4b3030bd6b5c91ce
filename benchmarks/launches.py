"""A launch budget counted on the CPU: operations reaching a kernel, host syncs and bytes per SMC
step, one thread, `AsyncTransformer` against `workload.run_reference` (critic: the lockstep one).
"""

import argparse
from typing import Any

import torch

from benchmarks import workload
from benchmarks.core import Figure, record
from benchmarks.scoring import critic_setup
from benchmarks.workload import stamped_backend

OPTIONS = {"n": (32, "particles"), "steps": 32, "workloads": "lockstep,critic,resample"}
TARGETS = {"lockstep": "≤ 1× floor, no host sync", "critic": "≤ 2.15× floor"}


def count(run: Any, *args: Any, **kwargs: Any) -> tuple[tuple, workload.OpCounter]:
    """Medians over steps 4..T-2 of `run`'s operations, syncs and bytes; the counter."""
    with workload.OpCounter() as counter:
        costs = run(*args, clock=counter.read, **kwargs)
    return tuple(workload.median_of(costs[3:], i) for i in range(3)), counter


def run(args: argparse.Namespace) -> None:
    """Count every workload and its floor."""
    from genlm.backend import assets, row_pool

    row_pool._MEMMOVE_DTYPES = frozenset()  # the output cache's copies through torch: counted
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
        if kind not in floors:
            floors[kind] = count(workload.run_reference, model, traces[kind], n, steps)[0]
        trace, floor, critic = traces[kind], floors[kind], {}
        if name == "critic":
            critic["critic"], trace, *_ = critic_setup(lm, trace)
        (ops, syncs, written), counter = count(stamped_backend, lm, trace, n, steps, **critic)
        notes = {"host syncs, floor / ours": (floor[1], syncs)}
        notes["MB written, floor / ours"] = (floor[2] / 1e6, written / 1e6)
        notes["MB ratio"] = written / floor[2]
        if counter.sync_names:
            notes["syncing operators (whole run)"] = dict(counter.sync_names)
        label, target = f"{name}, N={n}, T={steps}", TARGETS.get(name, "")
        record(Figure(f"launches/{name}", label, "ops", ops, floor[0], target=target, notes=notes))
