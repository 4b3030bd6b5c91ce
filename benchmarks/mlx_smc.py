"""SMC on SmolLM2-135M through `AsyncMlxLM` (`AsyncTransformer` in the notes) against a prefill and
a batched decode step per step over mlx-lm's `KVCache` reordered at resampling, on MLX's device. On
Linux MLX links a reference BLAS (10-20× slower than torch): read the ratio."""

from functools import partial
from typing import Any

from benchmarks import workload

OPTIONS = {"configs": "10x32,32x128", "repeats": 3, "skip_hf": False}


def floor(model: Any, trace: workload.Trace, n: int, steps: int) -> None:
    """The hand-written batched decode over mlx-lm's cache."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([trace.prompt]), cache=cache)
    mx.eval(logits, [(c.keys, c.values) for c in cache])
    for c in cache:
        c.keys, c.values = mx.repeat(c.keys, n, axis=0), mx.repeat(c.values, n, axis=0)
    for step in range(steps - 1):
        new = trace.tokens[step].tolist()
        if step in trace.ancestors:  # resampled after appending: reorder cache and tokens
            rows = mx.array(trace.ancestors[step])
            for c in cache:
                c.keys, c.values = c.keys[rows], c.values[rows]
            new = [new[a] for a in trace.ancestors[step]]
        logits = model(mx.array(new)[:, None], cache=cache)[:, -1].astype(mx.float32)
        mx.eval(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def run(args: Any) -> None:
    """Time the floor, `AsyncMlxLM` and `AsyncTransformer` on every configuration."""
    from genlm.backend import assets
    from genlm.backend.llm.mlx import AsyncMlxLM

    path = str(assets.smollm2())
    lm = AsyncMlxLM.from_name(path)
    others = {} if args.skip_hf else {"AsyncTransformer": workload.transformer(path)[1]}
    decode, target = partial(floor, lm.model), "≤ 1.2× floor"
    workload.smc_figures("mlx_smc", lm, decode, args.configs, args.repeats, target, others)
