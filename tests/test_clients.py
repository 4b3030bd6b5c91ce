"""The released clients of the 0.3.x API on this project, against a plain forward pass.

`scripts/setup.sh` installs genlm-control 0.4.1, llamppl 0.2.3 and genlm-bytes
0.2.0 over this project without their dependencies (see
`docs/compatibility.md`). Each test drives one client's public API over an
`AsyncTransformer` on the tiny Llama (SmolLM2's tokenizer) and compares what
the client computes with the same quantity built from the log-softmax of one
uncached transformers forward pass over the whole context.

Tolerances: one log-probability of the backend is within 1e-5 of the plain
pass on CPU and 1e-4 on CUDA (`tests/llm/hf/test_hf.py`, `TINY_ATOL`); a client's
sum over k tokens is allowed k times that. One wrong token or position moves
these log-probabilities by 2e-2 or more.
"""

import asyncio

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from genlm.backend import load_model_by_name

ATOL = 1e-4 if torch.cuda.is_available() else 1e-5
PROMPT = "The capital of France is"
CONTINUATION = " Paris. It is big"


@pytest.fixture(scope="module")
def lm(tiny_llama_path):
    return load_model_by_name(str(tiny_llama_path), backend="hf")


@pytest.fixture(scope="module")
def reference(tiny_llama_path):
    """Factory: token ids to the log-softmax of every position, one plain forward pass."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()

    def logprobs(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([token_ids])).logits[0]
        return torch.log_softmax(logits.double(), dim=-1)

    return logprobs


def test_llamppl_cached_causal_lm(lm, reference):
    llamppl = pytest.importorskip("llamppl", reason="llamppl is installed by scripts/setup.sh")
    cached = llamppl.CachedCausalLM(lm)
    ids = lm.tokenizer.encode(PROMPT + CONTINUATION)
    contexts = [ids[:6], ids[:8], ids]

    async def all_at_once():
        return await asyncio.gather(*(cached.next_token_logprobs(c) for c in contexts))

    rows = asyncio.run(all_at_once())
    expected = reference(ids)
    for context, row in zip(contexts, rows, strict=True):
        assert isinstance(row, np.ndarray)
        np.testing.assert_allclose(row, expected[len(context) - 1].numpy(), rtol=0, atol=ATOL)


def test_genlm_control_prompted_llm(lm, reference):
    control = pytest.importorskip(
        "genlm.control", reason="genlm-control is installed by scripts/setup.sh"
    )
    llm = control.PromptedLLM(lm)
    llm.set_prompt_from_str(PROMPT)
    context = llm.tokenize(CONTINUATION)
    prompt_ids = list(llm.prompt_ids)
    ids = prompt_ids + [token.token_id for token in context]
    expected = reference(ids)
    eos = lm.tokenizer.eos_token_id
    assert llm.eos_byte_strings == [lm.byte_vocab[eos].byte_string]

    async def scores():
        return await asyncio.gather(
            llm.prefix(context), llm.complete(context), llm.logw_next(context)
        )

    prefix, complete, next_weights = asyncio.run(scores())
    steps = range(len(prompt_ids), len(ids))
    expected_prefix = sum(expected[i - 1, ids[i]].item() for i in steps)
    assert prefix == pytest.approx(expected_prefix, abs=len(steps) * ATOL)
    expected_complete = expected_prefix + expected[-1, eos].item()
    assert complete == pytest.approx(expected_complete, abs=(len(steps) + 1) * ATOL)
    for token in context:  # each of these tokens as the next one
        assert next_weights[token] == pytest.approx(expected[-1, token.token_id].item(), abs=ATOL)
    assert next_weights[llm.eos] == pytest.approx(expected[-1, eos].item(), abs=ATOL)


def test_genlm_bytes_first_byte(lm, reference):
    genlm_bytes = pytest.importorskip(
        "genlm.bytes", reason="genlm-bytes is installed by scripts/setup.sh"
    )

    async def first_byte():
        beam = await genlm_bytes.ByteBeamState.initial(lm, genlm_bytes.BeamParams(K=5))
        return await beam.logp_next()

    found = asyncio.run(first_byte())
    assert found.log_space
    probabilities = np.exp(np.asarray(found.ps))
    # Brute force: the mass of every token, summed by the first byte of its byte string.
    token_probabilities = reference([lm.tokenizer.bos_token_id])[-1].exp().numpy()
    expected = np.zeros(256)
    for token, probability in zip(lm.byte_vocab, token_probabilities, strict=True):
        if token.byte_string:
            expected[token.byte_string[0]] += probability
    # Each token's probability is within a factor exp(+-ATOL) of the reference: so is a sum.
    np.testing.assert_allclose(probabilities[:256], expected, rtol=ATOL, atol=1e-12)
