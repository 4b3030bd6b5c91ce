"""Peak memory (`ru_maxrss`) and time of `AsyncTransformer` at many particles against the floor,
T=8, one thread, each in a fresh process (the model alone too); this process imports no torch.
"""

import resource
from functools import partial
from typing import Any

from benchmarks.core import Figure, compare, in_child, record, set_threads, timed

OPTIONS = {"sizes": "256,1024,2048"}
OPTIONS["backend_opts"] = ({}, "AsyncTransformer's options, a JSON object")
STEPS = 8
TARGETS = {1024: "≤ floor + 2.5 GB, ≤ 1.1× its time", 2048: "≤ floor + 2.5 GB"}


def child(kind: str, n: int, backend_opts: dict) -> dict:
    """One measurement (`model`, `floor` or `backend`): peak bytes, seconds, error."""
    from benchmarks import workload
    from genlm.backend import AsyncTransformer, assets  # the package loads both: no extra memory

    set_threads(1)
    model, tokenizer = workload.load_hf(assets.smollm2())
    result, sampled = {}, {}
    trace = workload.make_trace(n, STEPS, len(tokenizer)) if n else None
    if kind == "floor":
        result["seconds"] = timed(workload.run_reference, model, trace, n, STEPS)[0]
    elif kind == "backend":
        lm = AsyncTransformer(model, tokenizer, **backend_opts)
        result["seconds"] = workload.run_backend(lm, trace, n, STEPS, False, sampled)[0]
    result["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    if kind == "backend":
        result["error"] = workload.max_error(sampled, lm.next_token_logprobs_uncached)
    return result


def run(args: Any) -> None:
    """Measure the model alone, then floor and backend at every size."""
    measure = partial(in_child, "benchmarks.memory:child", backend_opts=args.backend_opts)
    base = measure(kind="model", n=0)["peak"] / 1e9
    sizes, times = [int(size) for size in args.sizes.split(",")], {}
    for n in sizes:
        runs = {kind: partial(measure, kind=kind, n=n) for kind in ("floor", "backend")}
        floor, ours = compare(runs, 1).values()
        times[n] = floor["seconds"], ours["seconds"]
        label = f"peak memory, N={n}, T={STEPS}"
        label += f" (model alone: {base:.2f} GB)" * (n == sizes[0])
        notes = {"s, floor / backend": times[n], "error": ours["error"]}
        notes["options"] = args.backend_opts or "defaults"
        peaks, target = (ours["peak"] / 1e9, floor["peak"] / 1e9), TARGETS.get(n, "")
        record(Figure(f"memory/{n}", label, "GB", *peaks, target=target, notes=notes))
    label = f"time, N={' / '.join(map(str, sizes))}"
    floors, backend = zip(*(times[n] for n in sizes), strict=True)  # by size -> by kind
    record(Figure(f"memory/time/{args.sizes}", label, "s", backend, floors))
