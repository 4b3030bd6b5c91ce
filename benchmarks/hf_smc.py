"""SMC on SmolLM2-135M through `AsyncTransformer` (defaults; `batch_size=N` in the notes), with and
without `cache_kv(prompt)`, whole runs, against `workload.run_reference`. Memory: N=32, T=512 under
`kv_cache_bytes` of 256 MiB stays within the budget."""

from functools import partial
from typing import Any

from benchmarks import workload
from benchmarks.core import Figure, record

OPTIONS = {"configs": "10x32,32x128", "repeats": 3, "threads": 0}
OPTIONS |= {"skip_speed": False, "skip_memory": False}
BUDGET = 256 * 2**20


def run(args: Any) -> None:
    """Time the configurations, then the run under a key/value budget."""
    from genlm.backend.llm.hf import AsyncTransformer

    model, lm = workload.transformer(threads=args.threads)
    floor, target = partial(workload.run_reference, model), "≤ 1.3× floor"
    for n, steps in [] if args.skip_speed else workload.parse_configs(args.configs):
        tuned = {"batch_size=N": AsyncTransformer(model, lm.tokenizer, batch_size=n)}
        for cache_kv in (False, True):
            config = f"{n}x{steps}"
            workload.smc_figures("hf_smc", lm, floor, config, args.repeats, target, tuned, cache_kv)
    if not args.skip_memory:
        n, steps = 32, 512
        lm = AsyncTransformer(model, lm.tokenizer, batch_size=n, kv_cache_bytes=BUDGET)
        trace, sampled = workload.make_trace(n, steps, lm.vocab_size, seed=1), {}
        notes = {"s": workload.run_backend(lm, trace, n, steps, True, sampled)[0]}
        notes["max error"] = workload.max_error(sampled, lm.next_token_logprobs_uncached)
        label = f"key/value memory, N={n}, T={steps}, `kv_cache_bytes` 256 MiB (peak)"
        peak = lm.kv_cache.peak_nbytes / 2**20
        record(Figure("hf_smc/memory", label, "MiB", peak, target="≤ 256 MiB", notes=notes))
