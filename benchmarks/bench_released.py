"""This project against the released genlm-backend 0.3.1 on the CPU, each in processes of its own.

Install the release without its dependencies into a folder of its own first:
`pip install --no-deps --target DIR genlm-backend==0.3.1`. Every measurement runs
in a fresh child process that imports `genlm.backend` from DIR (the release) or
from this checkout (the child checks which one it got); the children of the two
alternate, starting with another one each repeat.

Parts:

- `hf`: the SMC workload of `smc_workload.py` on SmolLM2-135M (float32):
  per-step wall time (median over steps 1..T-2, as in `bench_overhead.py`) of
  `AsyncTransformer` with its default batch settings and with `batch_size=N`,
  and of the hand-written floor (`smc_workload.run_reference`) in the same
  child, so each backend also gets a ratio to a floor measured beside it. The
  largest difference of the sampled results from `next_token_logprobs_uncached`
  is printed too.
- `trie`: the qwen2 vocabulary (151,936 tokens, each version's own
  `decode_vocab`): build time, `weight_sum` / `weight_max` of one distribution
  (median of 15 calls) and `batch_weight_sum` / `batch_weight_max` of 32
  (median of 5), for `TokenCharacterTrie` and `ParallelTokenCharacterTrie` on
  the CPU.

Printed per figure: the median over repeats for each version and
this project / released (below 1: this project is faster).

Run: `HF_HUB_OFFLINE=1 python benchmarks/bench_released.py --released DIR
[--repeats 3] [--parts hf,trie] [--configs 10x32,32x16]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from smc_workload import (
    Stamped,
    Trace,
    make_trace,
    median_of,
    parse_configs,
    run_backend,
    run_reference,
    step_costs,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = Path(__file__).resolve().parent
BATCH = 32
RESULT = "RESULT "  # prefix of the line on which a child prints its figures


def clock() -> tuple[float]:
    return (time.perf_counter(),)


def floor_ms(model: Any, trace: Trace, n: int, steps: int) -> float:
    """Median milliseconds per step of the hand-written floor."""
    stamped = Stamped(model, "__call__", 1, clock)
    run_reference(stamped, trace, n, steps)
    return 1e3 * median_of(step_costs(stamped.stamps))


def backend_ms(
    lm: Any, batch_size: int, cache_kv: bool, trace: Trace, n: int, steps: int
) -> tuple[float, dict]:
    """Median milliseconds per step of `lm`, and its sampled results."""
    lm.batch_size = batch_size
    stamped = Stamped(lm, "next_token_logprobs", n, clock)
    _, _, sampled = run_backend(stamped, trace, n, steps, use_cache_kv=cache_kv)
    return 1e3 * median_of(step_costs(stamped.stamps)), sampled


def child_hf(model_path: str, configs: list[tuple[int, int]]) -> dict[str, float]:
    """Milliseconds per step of the floor and of `AsyncTransformer`, and the largest error."""
    from genlm.backend.llm import AsyncTransformer

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    lm = AsyncTransformer(model, tokenizer)
    default_batch_size = lm.batch_size
    figures: dict[str, float] = {}
    for n, steps in configs:
        trace = make_trace(n, steps, len(tokenizer))
        # Name -> (batch_size, cache_kv(prompt) first).
        settings = {
            "defaults": (default_batch_size, False),
            "defaults, cache_kv": (default_batch_size, True),
            "batch_size=N": (n, False),
        }
        floor_ms(model, trace, n, steps)  # warm-up
        backend_ms(lm, default_batch_size, False, trace, n, steps)
        label = f"hf N={n} T={steps}"
        figures[f"{label}: floor"] = floor_ms(model, trace, n, steps)
        for name, (batch_size, cache_kv) in settings.items():
            figures[f"{label}: {name}"], sampled = backend_ms(
                lm, batch_size, cache_kv, trace, n, steps
            )
        figures[f"{label}: max error"] = max(
            (row - lm.next_token_logprobs_uncached(list(ids))).abs().max().item()
            for ids, row in sampled.items()
        )
    return figures


def median_call_ms(function: Callable[[], Any], calls: int) -> float:
    function()  # warm-up
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def time_queries(
    label: str, trie: Any, probs: torch.Tensor, logprobs: torch.Tensor
) -> dict[str, float]:
    """Milliseconds of one and of a batch of sums and maxima."""
    return {
        f"{label}: weight_sum": median_call_ms(lambda: trie.weight_sum(probs[0]), 15),
        f"{label}: weight_max": median_call_ms(lambda: trie.weight_max(logprobs[0]), 15),
        f"{label}: batch_weight_sum ({BATCH})": median_call_ms(
            lambda: trie.batch_weight_sum(probs), 5
        ),
        f"{label}: batch_weight_max ({BATCH})": median_call_ms(
            lambda: trie.batch_weight_max(logprobs), 5
        ),
    }


def child_trie(tokenizer_path: str) -> dict[str, float]:
    """Build and query milliseconds of both trie classes on the CPU."""
    from genlm.backend.tokenization import decode_vocab
    from genlm.backend.trie import ParallelTokenCharacterTrie, TokenCharacterTrie

    vocab, _ = decode_vocab(AutoTokenizer.from_pretrained(tokenizer_path))
    rng = np.random.default_rng(0)
    logits = torch.from_numpy(rng.normal(size=(BATCH, len(vocab))).astype(np.float32))
    logprobs = torch.log_softmax(logits, dim=-1)
    probs = logprobs.exp()
    classes = {
        "TokenCharacterTrie": lambda: TokenCharacterTrie(decode=vocab),
        "ParallelTokenCharacterTrie": lambda: ParallelTokenCharacterTrie(
            decode=vocab, device="cpu"
        ),
    }
    figures: dict[str, float] = {}
    for name, make in classes.items():
        start = time.perf_counter()
        trie = make()
        figures[f"trie {name}: build"] = 1e3 * (time.perf_counter() - start)
        figures.update(time_queries(f"trie {name}", trie, probs, logprobs))
        del trie
    return figures


def run_child(part: str, released: Path | None, args: argparse.Namespace) -> dict[str, float]:
    """Run one part in a fresh process on the release (`released`) or on this project."""
    env = dict(os.environ)
    if released is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(released), *filter(None, [env.get("PYTHONPATH")])])
    command = [sys.executable, str(Path(__file__).resolve()), "--child", part]
    command += ["--configs", args.configs, "--model", args.model, "--tokenizer", args.tokenizer]
    done = subprocess.run(command, env=env, cwd=HERE, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"child {part} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(lines[-1][len(RESULT) :])
    module = Path(result.pop("module"))
    expected = released if released is not None else HERE.parent
    if expected.resolve() not in module.resolve().parents:
        raise RuntimeError(f"child imported genlm.backend from {module}, not from {expected}")
    return result


def child_main(args: argparse.Namespace) -> None:
    import genlm.backend

    if args.child == "hf":
        figures = child_hf(args.model, parse_configs(args.configs))
    else:
        figures = child_trie(args.tokenizer)
    print(RESULT + json.dumps({"module": genlm.backend.__file__, **figures}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--released", type=Path, help="folder holding genlm-backend 0.3.1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parts", default="hf,trie", help="hf and/or trie")
    parser.add_argument("--configs", default="10x32,32x16", help="NxT,NxT,... (hf part)")
    parser.add_argument("--child", choices=["hf", "trie"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args)
        return
    if args.released is None or not (args.released / "genlm" / "backend").is_dir():
        parser.error("--released DIR must hold genlm/backend (pip install --target DIR)")

    from genlm.backend import assets

    args.model, args.tokenizer = str(assets.smollm2()), str(assets.tokenizer("qwen2"))
    versions: dict[str, Path | None] = {"released 0.3.1": args.released, "this project": None}
    print(f"repeats: {args.repeats} (one child process per version, part and repeat; medians)")
    print(f"{'figure':<62}{'released':>12}{'project':>12}{'ratio':>8}")
    for part in args.parts.split(","):
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in versions}
        names = list(versions)
        for repeat in range(args.repeats):
            shift = repeat % len(names)
            for name in names[shift:] + names[:shift]:
                runs[name].append(run_child(part, versions[name], args))
        for figure in runs[names[0]][0]:
            old, new = (statistics.median(run[figure] for run in runs[name]) for name in names)
            if figure.endswith("max error"):
                print(f"{figure:<62}{old:>12.1e}{new:>12.1e}")
            else:
                print(f"{figure + ' (ms)':<62}{old:>12.2f}{new:>12.2f}{new / old:>8.2f}")


if __name__ == "__main__":
    main()
