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
- `clients`: the released clients' own documented programs, end to end, on
  SmolLM2-135M, each program in children of its own, loaded the way their docs
  load a model (`PromptedLLM.from_name(folder, backend="hf")`,
  `CachedCausalLM.from_pretrained(folder, backend="hf")`, i.e. each version's
  `AsyncTransformer.from_name` with its defaults):
  - `control-regex`: genlm-control's quick start: a `PromptedLLM`, a `BoolFSA`
    from a regular expression (a list of five words) coerced to its tokens,
    `AWRS(llm, fsa)` and `smc(...)` (8 particles, at most 24 tokens).
  - `control-critic`: the same sampler with `critic=` a second `PromptedLLM`
    (`llm.spawn()` with another prompt): every step the critic scores each
    particle's whole context (`batch_next_token_logprobs` over its prefixes).
  - `llamppl`: llamppl's README model (`Model` with `LMContext`, `observe` of
    `mask_dist` to avoid a letter, `sample(next_token())`) run with
    `smc_standard` (8 particles, at most 24 tokens).
  Timed: `load` (the loader call: weights, tokenizer, vocabulary) and `run`
  (building the program and the SMC call; the first call in the process, as a
  user's script makes it; each run's figure is printed too). Seeds are fixed
  (Python, numpy, torch, AWRS), so both versions do the same work: printed
  beside the times are the tokens of all particles (with their end of sequence
  in genlm-control), the log marginal likelihood estimate and the number of
  calls the client made on the backend (outermost calls of
  `next_token_logprobs`, `batch_next_token_logprobs` and their `_sync` forms;
  per method after the table, with the decoded results: one line when every
  run gave the same).

Torch runs its default number of threads in the children; `--threads N` sets
it. On a machine whose cores other processes share, `--threads 1` gives far
steadier figures: two threads wait on each other whenever one is descheduled.

Printed per figure: the median over repeats for each version and
this project / released (below 1: this project is faster).

Run: `HF_HUB_OFFLINE=1 python benchmarks/bench_released.py --released DIR
[--repeats 3] [--parts hf,trie,clients] [--configs 10x32,32x16]
[--programs control-regex,control-critic,llamppl] [--threads N]`. The clients part needs
genlm-control and llamppl installed over this project without their
dependencies (`scripts/setup.sh` does this).
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import inspect
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
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
# The clients part: its programs, their sizes and seed.
PROGRAMS = ("control-regex", "control-critic", "llamppl")
PARTICLES = 8
MAX_TOKENS = 24
SEED = 0
CONTROL_PROMPT = "Five fruits: apples, pears, plums, figs and limes. Five colours:"
CONTROL_REGEX = r" [a-z]+, [a-z]+, [a-z]+, [a-z]+ and [a-z]+\."
CRITIC_PROMPT = "Five warm colours:"
LLAMPPL_PROMPT = "The weather today is expected to be"
BACKEND_METHODS = (
    "next_token_logprobs",
    "batch_next_token_logprobs",
    "next_token_logprobs_sync",
    "batch_next_token_logprobs_sync",
)
# Figures that say what work was done (printed as they are, no ratio), by name ending.
WORK_FIGURES = ("tokens", "log ML", "backend calls")


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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def count_backend_calls(lm: Any) -> Counter[str]:
    """Count the client's calls of `lm`'s query methods (outermost only, not the
    backend's own nested calls), by wrapping them on the instance."""
    calls: Counter[str] = Counter()
    inside: contextvars.ContextVar[bool] = contextvars.ContextVar("inside", default=False)

    def wrap(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(method):

            async def counted_async(*args: Any, **kwargs: Any) -> Any:
                if inside.get():
                    return await method(*args, **kwargs)
                calls[name] += 1
                token = inside.set(True)
                try:
                    return await method(*args, **kwargs)
                finally:
                    inside.reset(token)

            return counted_async

        def counted(*args: Any, **kwargs: Any) -> Any:
            if inside.get():
                return method(*args, **kwargs)
            calls[name] += 1
            token = inside.set(True)
            try:
                return method(*args, **kwargs)
            finally:
                inside.reset(token)

        return counted

    for name in BACKEND_METHODS:
        if hasattr(lm, name):
            setattr(lm, name, wrap(name, getattr(lm, name)))
    return calls


Program = tuple[dict[str, float], Counter[str], str]  # figures, backend calls, results


def control_program(model_path: str, with_critic: bool) -> Program:
    """genlm-control: AWRS over a PromptedLLM and a regular expression, optionally with
    a second PromptedLLM (another prompt) as the critic."""
    from genlm.control import AWRS, BoolFSA, PromptedLLM

    start = time.perf_counter()
    llm = PromptedLLM.from_name(model_path, backend="hf")
    loaded = time.perf_counter()
    calls = count_backend_calls(llm.model)
    llm.set_prompt_from_str(CONTROL_PROMPT)
    fsa = BoolFSA.from_regex(CONTROL_REGEX)
    sampler = AWRS(llm, fsa.coerce(llm, f=b"".join), seed=SEED)
    critic = None
    if with_critic:
        critic = llm.spawn()
        critic.set_prompt_from_str(CRITIC_PROMPT)
    seed_everything(SEED)
    sequences = asyncio.run(
        sampler.smc(n_particles=PARTICLES, ess_threshold=0.5, max_tokens=MAX_TOKENS, critic=critic)
    )
    done = time.perf_counter()
    posterior = sorted(
        (round(float(p), 3), text) for text, p in sequences.decoded_posterior.items()
    )[::-1]
    figures = {
        "load (s)": loaded - start,
        "run (s)": done - loaded,
        "tokens": sum(len(context) for context in sequences.contexts),
        "log ML": sequences.log_ml,
        "backend calls": sum(calls.values()),
    }
    return figures, calls, "decoded posterior " + repr(posterior)


def llamppl_program(model_path: str) -> Program:
    """llamppl: its README's model (continue a prompt, avoiding a letter) with smc_standard."""
    from llamppl import CachedCausalLM, LMContext, Model, smc_standard

    start = time.perf_counter()
    lm = CachedCausalLM.from_pretrained(model_path, backend="hf")
    loaded = time.perf_counter()
    calls = count_backend_calls(lm.model)

    class AvoidLetter(Model):
        def __init__(self, lm: Any, prompt: str, letter: str) -> None:
            super().__init__()
            self.context = LMContext(lm, prompt)
            self.eos = lm.tokenizer.eos_token_id
            self.forbidden = {i for i, text in enumerate(lm.str_vocab) if letter in text}
            self.generated = 0

        async def step(self) -> None:
            await self.observe(self.context.mask_dist(self.forbidden), False)
            token = await self.sample(self.context.next_token())
            self.generated += 1
            if (
                token.token_id == self.eos
                or str(token) in (".", "!", "?")
                or self.generated == MAX_TOKENS
            ):
                self.finish()

        def immutable_properties(self) -> set[str]:
            return {"forbidden"}

    seed_everything(SEED)
    particles = asyncio.run(smc_standard(AvoidLetter(lm, LLAMPPL_PROMPT, "e"), PARTICLES))
    done = time.perf_counter()
    weights = np.array([p.weight for p in particles], dtype=np.float64)
    figures = {
        "load (s)": loaded - start,
        "run (s)": done - loaded,
        "tokens": sum(p.generated for p in particles),
        "log ML": float(np.logaddexp.reduce(weights) - math.log(len(particles))),
        "backend calls": sum(calls.values()),
    }
    return figures, calls, "particles " + repr(sorted(str(p.context) for p in particles))


def child_clients(model_path: str, program: str) -> tuple[dict[str, float], dict[str, str]]:
    """Seconds of one client program (load and run), what it did, and its results."""
    if program == "llamppl":
        figures, calls, result = llamppl_program(model_path)
    else:
        figures, calls, result = control_program(model_path, program == "control-critic")
    label = f"clients {program}"
    outputs = {f"{label} backend calls": repr(dict(sorted(calls.items()))), label: result}
    return {f"{label}: {name}": value for name, value in figures.items()}, outputs


Result = tuple[dict[str, float], dict[str, str]]  # a child's figures and its outputs


def run_child(part: str, released: Path | None, args: argparse.Namespace, program: str) -> Result:
    """Run one part (one program of the clients part) in a fresh process on the release
    (`released`) or on this project."""
    env = dict(os.environ)
    if released is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(released), *filter(None, [env.get("PYTHONPATH")])])
    command = [sys.executable, str(Path(__file__).resolve()), "--child", part]
    command += ["--configs", args.configs, "--model", args.model, "--tokenizer", args.tokenizer]
    command += ["--programs", program, "--threads", str(args.threads)]
    done = subprocess.run(command, env=env, cwd=HERE, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode != 0 or not lines:
        name = f"{part} {program}" if part == "clients" else part
        raise RuntimeError(f"child {name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(lines[-1][len(RESULT) :])
    module = Path(result.pop("module"))
    outputs = result.pop("outputs", {})
    expected = released if released is not None else HERE.parent
    if expected.resolve() not in module.resolve().parents:
        raise RuntimeError(f"child imported genlm.backend from {module}, not from {expected}")
    return result, outputs


def child_main(args: argparse.Namespace) -> None:
    import genlm.backend

    if args.threads:
        torch.set_num_threads(args.threads)
    outputs: dict[str, str] = {}
    if args.child == "hf":
        figures = child_hf(args.model, parse_configs(args.configs))
    elif args.child == "trie":
        figures = child_trie(args.tokenizer)
    else:
        figures, outputs = child_clients(args.model, args.programs)
    result = {"module": genlm.backend.__file__, "outputs": outputs, **figures}
    print(RESULT + json.dumps(result), flush=True)


def print_figure(figure: str, old: float, new: float) -> None:
    if figure.endswith("max error"):
        print(f"{figure:<62}{old:>12.1e}{new:>12.1e}")
    elif figure.endswith(WORK_FIGURES):
        print(f"{figure:<62}{old:>12.6g}{new:>12.6g}")
    else:
        unit = "" if figure.endswith(" (s)") else " (ms)"  # the clients part's are seconds
        print(f"{figure + unit:<62}{old:>12.2f}{new:>12.2f}{new / old:>8.2f}")


def print_outputs(outputs: dict[str, list[tuple[str, str]]]) -> None:
    """What each run of a unit gave: one line when every run gave the same."""
    for label, runs in outputs.items():
        if len({text for _, text in runs}) == 1:
            print(f"{label}, every run: {runs[0][1]}")
        else:
            for name, text in runs:
                print(f"{label}, {name}: {text}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--released", type=Path, help="folder holding genlm-backend 0.3.1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parts", default="hf,trie", help="hf, trie and/or clients")
    parser.add_argument("--configs", default="10x32,32x16", help="NxT,NxT,... (hf part)")
    parser.add_argument(
        "--programs", default=",".join(PROGRAMS), help="clients part: " + ", ".join(PROGRAMS)
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads in the children (0: torch's)"
    )
    parser.add_argument("--child", choices=["hf", "trie", "clients"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args)
        return
    if args.released is None or not (args.released / "genlm" / "backend").is_dir():
        parser.error("--released DIR must hold genlm/backend (pip install --target DIR)")
    programs = args.programs.split(",")
    if unknown := set(programs) - set(PROGRAMS):
        parser.error(f"unknown programs {sorted(unknown)}; known: {', '.join(PROGRAMS)}")

    from genlm.backend import assets

    args.model, args.tokenizer = str(assets.smollm2()), str(assets.tokenizer("qwen2"))
    versions: dict[str, Path | None] = {"released 0.3.1": args.released, "this project": None}
    threads = args.threads or torch.get_num_threads()
    print(
        f"repeats: {args.repeats} (one child process per version, part and repeat; medians);"
        f" torch threads: {threads}"
    )
    print(f"{'figure':<62}{'released':>12}{'project':>12}{'ratio':>8}")
    # A unit is one part, or one program of the clients part: a child process each.
    units = [
        (part, program)
        for part in args.parts.split(",")
        for program in (programs if part == "clients" else [""])
    ]
    for part, program in units:
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in versions}
        outputs: dict[str, list[tuple[str, str]]] = {}
        names = list(versions)
        for repeat in range(args.repeats):
            shift = repeat % len(names)
            for name in names[shift:] + names[:shift]:
                figures, texts = run_child(part, versions[name], args, program)
                runs[name].append(figures)
                for label, text in texts.items():
                    outputs.setdefault(label, []).append((name, text))
        for figure in runs[names[0]][0]:
            old, new = (statistics.median(run[figure] for run in runs[name]) for name in names)
            print_figure(figure, old, new)
        for figure in runs[names[0]][0]:
            if figure.endswith("run (s)"):
                each = "; ".join(
                    f"{name} " + " ".join(f"{run[figure]:.2f}" for run in runs[name])
                    for name in names
                )
                print(f"{figure}, each run: {each}")
        print_outputs(outputs)


if __name__ == "__main__":
    main()
