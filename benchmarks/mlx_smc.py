"""SMC on SmolLM2-135M through `AsyncMlxLM` against a hand-written batched MLX decode.

The workload on MLX's device (default batch settings) against one prefill and one
batched decode step per step over mlx-lm's `KVCache`, reordered at resampling;
`AsyncTransformer` in the notes. Target (issue 16): ≤ 1.2×, rows within 1e-4. On Linux
MLX links a reference BLAS (10-20× slower than torch): read the ratio.
"""

import argparse
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks import workload
from benchmarks.core import Figure, median, record, timed


def floor(model: Any, trace: workload.Trace, n: int, steps: int) -> None:
    """The hand-written batched decode over mlx-lm's key/value cache."""
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This benchmark's options."""
    parser.add_argument("--configs", default="10x32,32x128", help="NxT,NxT,...")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-hf", action="store_true", help="leave out AsyncTransformer")
    parser.add_argument("--model", help="a model folder (default: SmolLM2-135M)")


def run(args: argparse.Namespace) -> None:
    """Time the floor, `AsyncMlxLM` and `AsyncTransformer` on every configuration."""
    from genlm.backend import assets
    from genlm.backend.llm.hf import AsyncTransformer
    from genlm.backend.llm.mlx import AsyncMlxLM

    path = args.model or str(assets.smollm2())
    lm = AsyncMlxLM.from_name(path)
    hf = None if args.skip_hf else AsyncTransformer(*workload.load_hf(path))
    for n, steps in workload.parse_configs(args.configs):
        trace = workload.make_trace(n, steps, lm.vocab_size)
        runs = {"floor": [], "ours": [], "hf": []}
        for _ in range(args.repeats):
            runs["floor"].append(timed(partial(floor, lm.model, trace, n, steps))[0])
            seconds, _, sampled = workload.run_backend(lm, trace, n, steps)
            runs["ours"].append(seconds)
            if hf is not None:
                runs["hf"].append(workload.run_backend(hf, trace, n, steps)[0])
        notes = {"error": workload.max_error(sampled, lm.next_token_logprobs_uncached)}
        if hf is not None:
            notes["AsyncTransformer s"] = median(runs["hf"])
        ours, theirs = median(runs["ours"]), median(runs["floor"])
        model = f"/{Path(path).name}" * bool(args.model)  # another model: another row
        label, figure_id = f"N={n}, T={steps}{model}", f"mlx_smc/{n}x{steps}{model}"
        record(Figure(figure_id, label, "s", ours, theirs, target="≤ 1.2× floor", notes=notes))
