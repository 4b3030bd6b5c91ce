"""Peak resident memory of `AsyncTransformer` on the SMC workload, against the hand-written floor.

SmolLM2-135M (float32, CPU), the workload of `smc_workload.py` with many
particles: N particles (256, 1024, 2048) from a 64-token prompt, T=8 steps of
N concurrent `next_token_logprobs` awaits gathered per step, resampling every
5 steps. Every measurement runs in a fresh child process (this script with
`--child`), one at a time, and reports the peak resident set size of its
process (`ru_maxrss`) and the wall time of the run on a `RESULT` line:

- `model`: loads the model and the tokenizer and does nothing else: the
  baseline every other child starts from;
- `floor`: `smc_workload.run_reference`, the hand-written batched decode (one
  prefill of the prompt, one batched decode step of N tokens per step over one
  `DynamicCache`), which keeps the results the sampler keeps, for as long;
  it imports nothing from `genlm.backend`;
- `backend`: `smc_workload.run_backend` on `AsyncTransformer(model, tokenizer,
  **backend_opts)` (its defaults unless `--backend-opts` gives constructor
  keyword arguments as JSON), then, after the peak is read, the largest
  difference of the sampled results from `next_token_logprobs_uncached`.

The parent imports nothing heavy (the model's path comes from a child), so
the children's `ru_maxrss` is their own. Floor and backend children alternate,
the other one first every other repeat; figures are medians over repeats.
Printed per N: peak GB (10^9 bytes) of floor and backend, backend - floor,
each one's increment over the model-only child, wall seconds of each run
(model loading not included), backend / floor, and the backend's max error.

Torch runs one thread in the children by default (`--threads`; 0 keeps
torch's default): on the shared 2-core machine, with other processes on the
cores, two threads made the floor at N=256 take 19 to 78 s from run to run,
one thread 8.5 to 8.7 s (2026-11-25).

Targets (issue 27): N=1024 peak <= floor + 2.5 GB and time <= 1.1x the
floor; N=2048 peak <= floor + 2.5 GB; results within 1e-4 (also with a
forced small batch bound, e.g. `--backend-opts '{"max_batch_bytes": 268435456}'`
where the backend has that option). Figures only, nothing asserted.

Mind the machine's memory: at N=2048 the floor peaks near 12 GB. Children
never run at the same time.

Run: `HF_HUB_OFFLINE=1 python benchmarks/bench_memory.py [--sizes 256,1024,2048]
[--steps 8] [--repeats 1] [--backend-opts JSON] [--threads 1]`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULT = "RESULT "  # prefix of the line on which a child prints its figures
GB = 1e9
TOLERANCE = 1e-4
# N -> (largest backend - floor peak in GB, largest time ratio or None).
TARGETS = {1024: (2.5, 1.1), 2048: (2.5, None)}


def peak_bytes() -> int:
    """Peak resident set size of this process so far (`ru_maxrss` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child_main(args: argparse.Namespace) -> None:
    """Run one measurement and print its `RESULT` line."""
    if args.child == "path":
        from genlm.backend import assets

        print(RESULT + json.dumps({"path": str(assets.smollm2())}), flush=True)
        return
    import torch
    from smc_workload import make_trace, run_backend, run_reference
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    result: dict[str, float] = {"threads": torch.get_num_threads()}
    if args.child == "model":
        result["peak"] = peak_bytes()
    else:
        n, steps = args.n, args.steps
        trace = make_trace(n, steps, len(tokenizer))
        if args.child == "floor":
            result["seconds"], result["cpu"] = run_reference(model, trace, n, steps)
            result["peak"] = peak_bytes()
        else:
            from genlm.backend.llm.hf import AsyncTransformer

            lm = AsyncTransformer(model, tokenizer, **json.loads(args.backend_opts))
            result["seconds"], result["cpu"], sampled = run_backend(
                lm, trace, n, steps, use_cache_kv=False
            )
            result["peak"] = peak_bytes()
            result["error"] = max(
                (row - lm.next_token_logprobs_uncached(list(ids))).abs().max().item()
                for ids, row in sampled.items()
            )
    print(RESULT + json.dumps(result), flush=True)


def run_child(kind: str, args: argparse.Namespace, n: int = 0) -> dict[str, float] | None:
    """Run one child to its end; its figures, or None (printed why) when it failed."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", kind]
    command += ["--model", args.model or "", "--n", str(n), "--steps", str(args.steps)]
    command += ["--backend-opts", args.backend_opts, "--threads", str(args.threads or 0)]
    env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    start = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=HERE, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode != 0 or not lines:
        killed = " (killed: out of memory?)" if done.returncode == -9 else ""
        print(
            f"child {kind} N={n} failed ({done.returncode}){killed}:\n{done.stderr[-2000:]}",
            flush=True,
        )
        return None
    result = json.loads(lines[-1][len(RESULT) :])
    result["process"] = time.perf_counter() - start
    return result


def median(runs: list[dict[str, float] | None], key: str) -> float:
    """Median of one figure over the runs that finished (nan if none did)."""
    values = [run[key] for run in runs if run is not None]
    return statistics.median(values) if values else float("nan")


def verdict(n: int, difference: float, ratio: float, error: float) -> str:
    if n not in TARGETS:
        return ""
    gb, time_ratio = TARGETS[n]
    met = difference <= gb and error <= TOLERANCE
    if time_ratio is not None:
        met = met and ratio <= time_ratio
    return f"  [{'ok' if met else 'MISSED'}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256,1024,2048", help="numbers of particles N")
    parser.add_argument("--steps", type=int, default=8, help="SMC steps T")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--backend-opts",
        default="{}",
        help="AsyncTransformer keyword arguments as JSON, e.g. '{\"kv_cache_bytes\": 1073741824}'",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads in the children (0: torch's)"
    )
    parser.add_argument(
        "--child", choices=["path", "model", "floor", "backend"], help=argparse.SUPPRESS
    )
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args)
        return
    opts = json.loads(args.backend_opts)
    if not isinstance(opts, dict):
        parser.error("--backend-opts must be a JSON object")

    found = run_child("path", args)
    if found is None:
        sys.exit("could not find SmolLM2 (genlm.backend.assets.smollm2)")
    args.model = found["path"]
    baseline = run_child("model", args)
    if baseline is None:
        sys.exit("the model-only child failed")
    base = baseline["peak"] / GB
    print(
        f"SmolLM2-135M float32, T={args.steps}, 64-token prompt; torch threads in the children:"
        f" {baseline['threads']}; AsyncTransformer options: {opts or 'defaults'}"
    )
    print(
        f"model-only child: peak {base:.2f} GB; repeats: {args.repeats} (one child per"
        " measurement, medians); GB = 1e9 bytes; s: wall time of the run"
    )
    header = ("N", "floor GB", "backend GB", "diff GB", "floor +GB", "backend +GB")
    header += ("floor s", "backend s", "ratio", "max err")
    print(f"{header[0]:>6}" + "".join(f"{h:>12}" for h in header[1:]), flush=True)
    for n in (int(size) for size in args.sizes.split(",")):
        runs: dict[str, list[dict[str, float] | None]] = {"floor": [], "backend": []}
        for repeat in range(args.repeats):
            kinds = ["floor", "backend"] if repeat % 2 == 0 else ["backend", "floor"]
            for kind in kinds:
                runs[kind].append(run_child(kind, args, n))
        floor, ours = (median(runs[kind], "peak") / GB for kind in ("floor", "backend"))
        floor_s, ours_s = (median(runs[kind], "seconds") for kind in ("floor", "backend"))
        error = max((run["error"] for run in runs["backend"] if run), default=float("nan"))
        print(
            f"{n:>6}{floor:>12.2f}{ours:>12.2f}{ours - floor:>+12.2f}{floor - base:>+12.2f}"
            f"{ours - base:>+12.2f}{floor_s:>12.2f}{ours_s:>12.2f}{ours_s / floor_s:>12.2f}"
            f"{error:>12.1e}{verdict(n, ours - floor, ours_s / floor_s, error)}",
            flush=True,
        )


if __name__ == "__main__":
    main()
