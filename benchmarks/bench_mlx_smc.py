"""Sequential Monte Carlo workload: `AsyncMlxLM` against a hand-written batched MLX decode.

The workload of `bench_hf_smc.py` (SmolLM2-135M, float32, on MLX's device: the
CPU on Linux): N particles start from a 64-token prompt; at each of T steps
every particle awaits `next_token_logprobs(prompt + its tokens)` concurrently,
then appends the token a fixed seeded trace gives it; every 5 steps the
particles are resampled. Every run does the same work.

Floor, in the same process: one prefill of the prompt, then one batched decode
step of exactly N new tokens per step over mlx-lm's `KVCache` (one key and one
value array per layer for the N particles, reordered by indexing at
resampling), with the same float32 log-softmax and one evaluation per step.
The transformers backend (`AsyncTransformer`, torch on the CPU) runs the same
trace for comparison.

Target (issue 16): AsyncMlxLM <= 1.2x the floor for (N=10, T=32) and
(N=32, T=128); sampled results within 1e-4 (max abs) of a plain uncached MLX
forward pass. Both backends run with their default `batch_size` and `timeout`.

MLX's Linux CPU wheels (`mlx[cpu]`) link the reference BLAS: there a SmolLM2
forward pass costs about 15x what torch's takes, so the ratio to the floor is
the figure to read on Linux; `--model` runs a smaller model (e.g. the tiny
random Llama of the test assets), where the backend's own overhead weighs more.

Run: `HF_HUB_OFFLINE=1 python benchmarks/bench_mlx_smc.py [--repeats 3] [--skip-hf]
[--configs 10x32,32x128] [--model FOLDER]`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import torch
from mlx_lm.models.cache import make_prompt_cache
from smc_workload import PROMPT_LENGTH, Trace, make_trace, parse_configs, run_backend
from transformers import AutoModelForCausalLM, AutoTokenizer

from genlm.backend import assets
from genlm.backend.llm.hf import AsyncTransformer
from genlm.backend.llm.mlx import AsyncMlxLM

RATIO_TARGET = 1.2


def run_floor(model, trace: Trace, n: int, steps: int) -> tuple[float, float]:
    """Hand-written batched decode over mlx-lm's KV cache; returns wall and CPU seconds."""
    start, start_cpu = time.perf_counter(), time.process_time()
    cache = make_prompt_cache(model)
    logits = model(mx.array([trace.prompt]), cache=cache)
    mx.eval(logits, [(c.keys, c.values) for c in cache])
    for c in cache:
        c.keys, c.values = mx.repeat(c.keys, n, axis=0), mx.repeat(c.values, n, axis=0)
    length = PROMPT_LENGTH
    for step in range(steps - 1):
        new = trace.tokens[step].tolist()
        if step in trace.ancestors:
            # Particles were resampled after appending: reorder the cache and the new tokens.
            index = trace.ancestors[step]
            rows = mx.array(index)
            for c in cache:
                c.keys, c.values = c.keys[rows], c.values[rows]
            new = [new[a] for a in index]
        logits = model(mx.array(new)[:, None], cache=cache)[:, -1].astype(mx.float32)
        mx.eval(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        length += 1
    return time.perf_counter() - start, time.process_time() - start_cpu


def max_error(lm: AsyncMlxLM, sampled: dict) -> float:
    return max(
        (row - lm.next_token_logprobs_uncached(list(ids))).abs().max().item()
        for ids, row in sampled.items()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-hf", action="store_true", help="leave out the transformers backend")
    parser.add_argument("--configs", default="10x32,32x128", help="NxT pairs, comma-separated")
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    args = parser.parse_args()
    configs = parse_configs(args.configs)

    path = args.model or str(assets.smollm2())
    lm = AsyncMlxLM.from_name(path)
    hf = None
    if not args.skip_hf:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hf = AsyncTransformer(model, tokenizer)
    print(f"model: {path}")
    print(f"MLX device: {mx.default_device()}; torch threads: {torch.get_num_threads()}")
    print(f"repeats: {args.repeats} (medians); both backends run with default batch settings")
    header = ("config", "floor s", "mlx s", "ratio", "target", "max err", "hf s", "hf/floor")
    print(f"{header[0]:<20}" + "".join(f"{h:>10}" for h in header[1:]))

    for n, steps in configs:
        trace = make_trace(n, steps, lm.vocab_size)
        floor, ours, theirs = [], [], []
        for _ in range(args.repeats):
            floor.append(run_floor(lm.model, trace, n, steps))
            wall, cpu, sampled = run_backend(lm, trace, n, steps, use_cache_kv=False)
            ours.append((wall, cpu))
            if hf is not None:
                wall, cpu, _ = run_backend(hf, trace, n, steps, use_cache_kv=False)
                theirs.append((wall, cpu))
        error = max_error(lm, sampled)
        for kind, column in (("wall", 0), ("cpu", 1)):
            ref = statistics.median(f[column] for f in floor)
            mine = statistics.median(o[column] for o in ours)
            row = f"{f'N={n} T={steps} {kind}':<20}{ref:>10.2f}{mine:>10.2f}{mine / ref:>10.2f}"
            row += f"{'<=' + str(RATIO_TARGET):>10}{error:>10.1e}"
            if theirs:
                other = statistics.median(t[column] for t in theirs)
                row += f"{other:>10.2f}{other / ref:>10.2f}"
            print(row)


if __name__ == "__main__":
    main()
