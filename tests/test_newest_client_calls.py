"""A probabilistic program written against the names the clients' newest code calls.

The newest llamppl keeps, per particle, a context whose next-token row is
tempered (`temper`), draws tokens from it and scores observed ones through
`genlm.backend.draw` (`draw_from`, `logp_at`), conditions it on token masks
built on `lm.device` (`logsumexp_from` of the masked row), and reads
`take_batch_stats`; the newer genlm-control draws importance samples between a
proposal row and a potential's numpy weights. This module's program (our own,
in that style) runs N particles on the tiny Llama through `AsyncTransformer`,
and every number it gets is checked against the model's uncached forward pass
(`tiny_llama_reference`), tempered and summed here in float64.
"""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch

from genlm.backend.batching import take_batch_stats
from genlm.backend.draw import draw_from, logp_at, logsumexp_from
from genlm.backend.llm import AsyncTransformer, temper

N = 8
TEMPERATURE = 0.7
# Draws and reads come back as Python floats from float32 rows; the backend's rows are
# within 1e-5 of the reference (tests/llm/hf), tempering divides by 0.7 and renormalises.
ATOL = 1e-4


class Context:
    """A particle's context: its tokens and its current (tempered, masked) next-token row."""

    def __init__(self, lm, prompt):
        self.lm, self.tokens, self.row = lm, list(prompt), None

    async def advance(self, token=None):
        if token is not None:
            self.tokens.append(token)
        self.row = temper(await self.lm.next_token_logprobs(self.tokens), TEMPERATURE)

    async def sample(self):
        token, _, logp = await draw_from(self.row)
        tokens = list(self.tokens)
        await self.advance(token)
        return tokens, token, logp

    async def condition(self, mask):
        masked = self.row.masked_fill(~mask, -math.inf)
        log_mass = await logsumexp_from(masked)
        self.row = masked.sub_(log_mass)
        return log_mass


def tempered_reference(reference, tokens):
    row = reference(tokens).double()
    return torch.log_softmax(row / TEMPERATURE, -1)


@pytest.fixture(scope="module")
def lm(tiny_llama_path):
    return AsyncTransformer.from_name(str(tiny_llama_path))


def test_a_particle_program_on_the_newest_names(lm, tiny_llama_reference):
    torch.manual_seed(0)
    prompt = [1, 400, 2000, 31]
    # A mask over the vocabulary, on the rows' device, as llamppl builds its masks.
    mask = torch.zeros(len(lm.str_vocab), dtype=torch.bool, device=lm.device)
    mask[torch.arange(0, len(lm.str_vocab), 3)] = True
    contexts = [Context(lm, prompt) for _ in range(N)]

    async def program():
        await asyncio.gather(*(c.advance() for c in contexts))
        take_batch_stats()
        log_masses = await asyncio.gather(*(c.condition(mask) for c in contexts))
        samples = await asyncio.gather(*(c.sample() for c in contexts))
        observed = await asyncio.gather(*(logp_at(c.row, 7) for c in contexts))
        return log_masses, samples, observed, take_batch_stats()

    log_masses, samples, observed, stats = asyncio.run(program())
    assert stats == {("logsumexp", N): 1, ("draw", N): 1, ("at", N): 1}

    reference = tempered_reference(tiny_llama_reference, prompt)
    expected_mass = float(torch.logsumexp(reference[mask.cpu()], 0))
    for log_mass in log_masses:
        assert log_mass == pytest.approx(expected_mass, abs=ATOL)
    for tokens, token, logp in samples:
        assert tokens == prompt and mask[token]  # drawn from the conditioned row
        assert logp == pytest.approx(float(reference[token]) - expected_mass, abs=ATOL)
    for context, value in zip(contexts, observed, strict=True):
        after = tempered_reference(tiny_llama_reference, context.tokens)
        assert value == pytest.approx(float(after[7]), abs=ATOL)
        assert context.row.device == lm.device


def test_importance_draws_between_a_row_and_numpy_weights(lm, tiny_llama_reference):
    torch.manual_seed(1)
    prompt = [5, 17, 9]
    width = len(lm.str_vocab)
    # A potential's weights over the vocabulary, as numpy: log 1 on even ids, log 1/2 on odd.
    potential = np.where(np.arange(width) % 2 == 0, 0.0, math.log(0.5))

    async def program():
        row = await lm.next_token_logprobs(prompt)
        target = potential + row.double().numpy()
        return await asyncio.gather(*(draw_from(row, target=target) for _ in range(N)))

    reference = tiny_llama_reference(prompt).double()
    for token, logw, logp in asyncio.run(program()):
        assert logp == pytest.approx(float(reference[token]), abs=ATOL)
        assert logw == pytest.approx(potential[token], abs=ATOL)  # target[token] - logp
