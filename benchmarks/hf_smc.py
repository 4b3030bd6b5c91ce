"""SMC on SmolLM2-135M through `AsyncTransformer` against a hand-written batched decode.

The workload with and without `cache_kv(prompt)`, the backend with its defaults (and
`batch_size=N` in the notes) against `workload.run_reference`; whole runs. Targets
(issues 4, 14): ≤ 1.3×, defaults within 5% of `batch_size=N`, rows within 1e-4. Memory:
N=32, T=512 under `kv_cache_bytes` of 256 MiB stays within the budget.
"""

import argparse

from benchmarks import workload
from benchmarks.core import Figure, median, record, set_threads

BUDGET = 256 * 2**20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This benchmark's options."""
    parser.add_argument("--configs", default="10x32,32x128", help="NxT,NxT,... (speed part)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")


def run(args: argparse.Namespace) -> None:
    """Time the configurations, then the run under a key/value budget."""
    from genlm.backend import assets
    from genlm.backend.llm.hf import AsyncTransformer

    threads = set_threads(args.threads)
    model, tokenizer = workload.load_hf(assets.smollm2())
    default = AsyncTransformer(model, tokenizer).batch_size
    for n, steps in [] if args.skip_speed else workload.parse_configs(args.configs):
        trace = workload.make_trace(n, steps, len(tokenizer))
        for cache_kv in (False, True):
            runs = {"floor": [], "defaults": [], "tuned": []}
            for _ in range(args.repeats):
                runs["floor"].append(workload.run_reference(model, trace, n, steps))
                for name, batch_size in (("defaults", default), ("tuned", n)):
                    lm = AsyncTransformer(model, tokenizer, batch_size=batch_size)
                    *seconds, sampled = workload.run_backend(lm, trace, n, steps, cache_kv)
                    runs[name].append(seconds)
            wall, cpu = ({k: median(r[i] for r in v) for k, v in runs.items()} for i in (0, 1))
            notes = {"tuned s": wall["tuned"], "defaults / tuned": wall["defaults"] / wall["tuned"]}
            notes |= {"CPU s, floor / defaults / tuned": tuple(cpu.values()), "threads": threads}
            notes["max error"] = workload.max_error(sampled, lm.next_token_logprobs_uncached)
            label = f"N={n}, T={steps}" + (", `cache_kv(prompt)` first" if cache_kv else "")
            figure_id = f"hf_smc/{n}x{steps}" + ("/cache_kv" if cache_kv else "")
            ours, floor, target = wall["defaults"], wall["floor"], "≤ 1.3× floor"
            record(Figure(figure_id, label, "s", ours, floor, target=target, notes=notes))
    if not args.skip_memory:
        n, steps = 32, 512
        lm = AsyncTransformer(model, tokenizer, batch_size=n, kv_cache_bytes=BUDGET)
        trace = workload.make_trace(n, steps, len(tokenizer), seed=1)
        seconds, _, sampled = workload.run_backend(lm, trace, n, steps, use_cache_kv=True)
        notes = {
            "s": seconds,
            "max error": workload.max_error(sampled, lm.next_token_logprobs_uncached),
        }
        label = f"key/value memory, N={n}, T={steps}, `kv_cache_bytes` 256 MiB (peak)"
        peak = lm.kv_cache.peak_nbytes / 2**20
        record(Figure("hf_smc/memory", label, "MiB", peak, target="≤ 256 MiB", notes=notes))
