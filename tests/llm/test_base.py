"""Tests of the `AsyncLM` base behaviour through `MockAsyncLM`, and of `check_token_ids`."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from genlm.backend.cache import OutputCache
from genlm.backend.llm.base import AsyncLM, MockAsyncLM, check_token_ids, rows_through_cache

CONTEXTS = [[0], [1, 2, 3], [50256, 11, 290], [3, 2, 1]]


@pytest.fixture(scope="module")
def gpt2_tokenizer(tokenizer_path):
    return AutoTokenizer.from_pretrained(tokenizer_path("gpt-2"))


@pytest.fixture(scope="module")
def mock(gpt2_tokenizer):
    return MockAsyncLM(gpt2_tokenizer)


# -- the mock's log-probabilities ---------------------------------------------------


def test_from_name_loads_only_the_tokenizer(tokenizer_path, gpt2_tokenizer):
    lm = MockAsyncLM.from_name(str(tokenizer_path("gpt-2")))
    assert isinstance(lm, AsyncLM)
    assert lm.vocab_size == len(gpt2_tokenizer) == 50257
    assert len(lm.byte_vocab) == len(lm.str_vocab) == 50257


async def test_logprobs_are_normalised_over_the_vocabulary(mock):
    for ids in CONTEXTS:
        row = await mock.next_token_logprobs(ids)
        assert row.shape == (50257,) and row.dtype == torch.float32
        # float32 log_softmax over 50k entries: logsumexp within a few ulp of 0
        assert abs(torch.logsumexp(row.double(), dim=0).item()) < 1e-5
        assert torch.isfinite(row).all()


async def test_same_ids_give_the_same_tensor_across_instances_and_input_types(mock, gpt2_tokenizer):
    other = MockAsyncLM(gpt2_tokenizer)
    for ids in CONTEXTS:
        row = await mock.next_token_logprobs(ids)
        assert torch.equal(row, await other.next_token_logprobs(tuple(ids)))
        assert torch.equal(row, other.next_token_logprobs_sync(torch.tensor(ids)))
        assert torch.equal(row, mock.next_token_logprobs_sync(np.array(ids)))


async def test_different_ids_give_different_tensors(mock):
    rows = [await mock.next_token_logprobs(ids) for ids in CONTEXTS]
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            assert not torch.equal(rows[i], rows[j])


def test_same_ids_give_the_same_tensor_in_another_process(mock, tokenizer_path, tmp_path):
    out = tmp_path / "rows.pt"
    code = textwrap.dedent(
        f"""
        import torch
        from genlm.backend.llm.base import MockAsyncLM
        lm = MockAsyncLM.from_name({str(tokenizer_path("gpt-2"))!r})
        torch.save([lm.next_token_logprobs_sync(ids) for ids in {CONTEXTS!r}], {str(out)!r})
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for ids, row in zip(CONTEXTS, torch.load(out), strict=True):
        assert torch.equal(row, mock.next_token_logprobs_sync(ids))


async def test_batches_stack_rows_in_input_order(mock):
    expected = torch.stack([mock.next_token_logprobs_sync(ids) for ids in CONTEXTS])
    assert torch.equal(await mock.batch_next_token_logprobs(CONTEXTS), expected)
    assert torch.equal(mock.batch_next_token_logprobs_sync(CONTEXTS), expected)
    reordered = CONTEXTS[::-1]
    assert torch.equal(mock.batch_next_token_logprobs_sync(reordered), expected.flip(0))


def test_clear_cache_is_harmless_and_lora_is_not_supported(mock):
    mock.clear_cache()
    for call in (
        lambda: mock.add_new_lora("path", "name"),
        lambda: mock.set_lora("path", "name"),
        mock.clear_lora,
        lambda: mock.remove_lora("name"),
    ):
        with pytest.raises(NotImplementedError):
            call()


async def test_any_adapter_name_is_unknown_to_the_mock(mock):
    expected = mock.next_token_logprobs_sync(CONTEXTS[1])
    assert torch.equal(await mock.next_token_logprobs(CONTEXTS[1], lora_name=None), expected)
    unknown = "no LoRA adapter named 'mine'; registered adapters: none"
    for call in (
        lambda: mock.next_token_logprobs_sync(CONTEXTS[1], lora_name="mine"),
        lambda: mock.batch_next_token_logprobs_sync(CONTEXTS, lora_name="mine"),
        lambda: mock.batch_next_token_logprobs_sync([], lora_name="mine"),
    ):
        with pytest.raises(ValueError, match=unknown):
            call()
    for coroutine in (
        mock.next_token_logprobs(CONTEXTS[1], lora_name="mine"),
        mock.batch_next_token_logprobs(CONTEXTS, lora_name="mine"),
        mock.sample([1], 3, [], lora_name="mine"),
        mock.batch_sample([[1], [2]], 3, [], lora_name="mine"),
    ):
        with pytest.raises(ValueError, match=unknown):
            await coroutine


async def test_an_empty_batch_is_an_empty_tensor(mock):
    for rows in (await mock.batch_next_token_logprobs([]), mock.batch_next_token_logprobs_sync([])):
        assert rows.shape == (0, 50257) and rows.dtype == torch.float32


async def test_results_belong_to_the_caller(mock):
    first = await mock.next_token_logprobs(CONTEXTS[2])
    expected = first.clone()
    first.fill_(0.0)
    assert torch.equal(await mock.next_token_logprobs(CONTEXTS[2]), expected)
    assert torch.equal(mock.batch_next_token_logprobs_sync(CONTEXTS[2:3])[0], expected)


# -- a batch read through the output cache ---------------------------------------------


def computing_into(cache: OutputCache, step: torch.Tensor, keys: list, rows: list[int]):
    """A backend's `compute` whose row for `keys[i]` is row `rows[i]` of one step's tensor."""

    async def compute(i: int) -> torch.Tensor:
        cache[keys[i]] = step[rows[i]]
        return step[rows[i]]

    return compute


async def test_rows_computed_for_a_call_are_its_result_in_key_order():
    keys = ["a", "b", "c", "d"]
    for rows in ([0, 1, 2, 3], [2, 0, 3, 1]):
        step = torch.randn(4, 6)
        expected, cache = step[rows], OutputCache(10)
        result = await rows_through_cache(cache, keys, computing_into(cache, step, keys, rows))
        assert torch.equal(result, expected)
        result.fill_(0.0)  # the caller's: the cached rows stay as computed
        assert torch.equal(torch.stack([cache[key] for key in keys]), expected)


async def test_rows_of_a_tensor_that_holds_other_rows_are_copied():
    step, keys = torch.randn(4, 6), ["a", "b", "c"]
    expected = step.clone()
    cache = OutputCache(10)
    result = await rows_through_cache(cache, keys, computing_into(cache, step, keys, [0, 1, 2]))
    result.fill_(0.0)  # row 3 belongs to another caller
    assert torch.equal(step, expected)


# -- sampling -----------------------------------------------------------------------


async def test_sampling_with_a_seed_is_reproducible(mock):
    first = await mock.sample([1, 2], max_tokens=6, eos_token_ids=[], seed=11)
    assert first == await mock.sample([1, 2], max_tokens=6, eos_token_ids=[], seed=11)
    assert len(first) == 6
    draws = {tuple(await mock.sample([1, 2], 6, [], seed=s)) for s in range(5)}
    assert len(draws) > 1  # seeds matter (50k-way draws: collisions essentially impossible)


async def test_sampling_stops_at_eos_without_returning_it(mock):
    full = await mock.sample([1, 2], max_tokens=8, eos_token_ids=[], seed=4)
    # the last position holding a token's first occurrence: nothing before it is that token
    stop_at = max(i for i, t in enumerate(full) if t not in full[:i])
    stopped = await mock.sample([1, 2], max_tokens=8, eos_token_ids=[full[stop_at]], seed=4)
    assert stopped == full[:stop_at]
    everything = list(range(mock.vocab_size))
    assert await mock.sample([1, 2], max_tokens=8, eos_token_ids=everything, seed=4) == []


async def test_sampling_respects_max_tokens(mock):
    assert await mock.sample([5], max_tokens=0, eos_token_ids=[], seed=1) == []
    assert len(await mock.sample([5], max_tokens=3, eos_token_ids=[], seed=1)) == 3


async def test_low_temperature_sampling_follows_the_argmax(mock):
    context = [7, 8]
    tokens = await mock.sample(context, max_tokens=4, eos_token_ids=[], temperature=1e-4, seed=0)
    for token in tokens:
        assert token == int(mock.next_token_logprobs_sync(context).argmax())
        context = context + [token]


async def test_batch_sample_seeds_prompt_i_with_seed_plus_i(mock):
    prompts = [[1], [2, 3], [1]]
    batch = await mock.batch_sample(prompts, max_tokens=3, eos_token_ids=[], seed=20)
    for i, prompt in enumerate(prompts):
        assert batch[i] == await mock.sample(prompt, 3, [], seed=20 + i)


@pytest.mark.parametrize(
    ("max_tokens", "temperature"), [(-1, 1.0), (1.5, 1.0), (True, 1.0), (3, 0.0), (3, -2.0)]
)
async def test_bad_sampling_arguments_are_rejected(mock, max_tokens, temperature):
    with pytest.raises(ValueError):
        await mock.sample([1], max_tokens=max_tokens, eos_token_ids=[], temperature=temperature)


# -- check_token_ids ----------------------------------------------------------------


@pytest.mark.parametrize(
    "token_ids",
    [[3, 1, 4], (3, 1, 4), torch.tensor([3, 1, 4]), np.array([3, 1, 4]), [np.int64(3), 1, 4]],
)
def test_check_token_ids_accepts_flat_integer_sequences(token_ids):
    checked = check_token_ids(token_ids, vocab_size=10)
    assert checked == (3, 1, 4) and all(type(t) is int for t in checked)


@pytest.mark.parametrize(
    ("token_ids", "message"),
    [
        ([], "empty"),
        ([1, -1], "outside the vocabulary"),
        ([1, 10], "outside the vocabulary"),
        ([1, 2.0], "not an integer"),
        ([1, "2"], "not an integer"),
        ([True], "not an integer"),
        ([[1, 2]], "not an integer"),
        (torch.tensor([[1, 2]]), "1-D"),
        (np.array([[1, 2]]), "1-D"),
        ("12", "sequence of ints"),
        (5, "sequence of ints"),
    ],
)
def test_check_token_ids_rejects_bad_contexts(token_ids, message):
    with pytest.raises(ValueError, match=message):
        check_token_ids(token_ids, vocab_size=10)


@pytest.mark.parametrize("length", [5, 127, 128, 1000])
def test_check_token_ids_checks_the_range_of_every_id_short_or_long(length):
    # Long contexts take another path for the range (packed into an array): every position
    # and both ends of the range, against the rule written out id by id.
    rng = random.Random(length)
    good = [rng.randrange(50) for _ in range(length)]
    assert check_token_ids(good, vocab_size=50) == tuple(good)
    for position in {0, length // 2, length - 1}:
        for bad in (-1, 50, 2**32, 2**64):
            ids = list(good)
            ids[position] = bad
            with pytest.raises(ValueError, match=rf"token_ids\[{position}\] = {bad} is outside"):
                check_token_ids(ids, vocab_size=50)
    assert check_token_ids([49] * length, vocab_size=50) == (49,) * length


def test_checked_contexts_equal_and_hash_like_tuples_and_keep_their_prefix():
    checked = check_token_ids([5, 6, 7], vocab_size=10)
    assert checked == (5, 6, 7) and hash(checked) == hash((5, 6, 7))
    assert {(None, (5, 6, 7)): "row"}[(None, checked)] == "row"
    assert checked.prefix == (5, 6) and checked.prefix is checked.prefix
    assert hash(checked.prefix) == hash((5, 6))
    earlier = check_token_ids([5, 6], vocab_size=10)
    checked.adopt_prefix(earlier)
    assert checked.prefix is earlier


def test_checked_contexts_compare_as_the_tuples_of_their_ids():
    # Against plain tuples' own answers, both ways round: equal ids, a prefix, an extension,
    # one id changed, and objects that are not tuples.
    checked = check_token_ids([5, 6, 7], vocab_size=10)
    others = [(5, 6, 7), (5, 6), (5, 6, 7, 8), (5, 6, 8), (), [5, 6, 7], 5, "567", None]
    others += [check_token_ids(list(ids), vocab_size=10) for ids in others[:4]]
    for other in others:
        plain = tuple(checked)
        assert (checked == other) is (plain == other), other
        assert (checked != other) is (plain != other), other
        assert (other == checked) is (other == plain), other
        assert (other != checked) is (other != plain), other
        assert ((None, checked) == (None, other)) is ((None, plain) == (None, other)), other


def test_check_token_ids_rejects_contexts_longer_than_the_model_accepts():
    assert check_token_ids([1] * 4, vocab_size=10, max_length=4) == (1,) * 4
    with pytest.raises(ValueError, match="at most 4"):
        check_token_ids([1] * 5, vocab_size=10, max_length=4)


async def test_the_mock_validates_at_its_boundary(mock):
    for bad in ([], [50257], [-1], [0.5], torch.tensor([[1, 2]])):
        with pytest.raises(ValueError):
            await mock.next_token_logprobs(bad)
        with pytest.raises(ValueError):
            mock.next_token_logprobs_sync(bad)
