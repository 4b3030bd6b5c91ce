"""AsyncTransformer on batches whose contexts nest or share uncached prefixes (a scorer, an
LLM critic, a cold prompt) and under a small working-memory bound: every row against
`next_token_logprobs_uncached` (a plain forward pass), and the tokens that reach the model
against the batch's distinct new tokens. Tolerances as in test_hf.py.
"""

import asyncio

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from genlm.backend.llm.hf import AsyncTransformer

TINY_ATOL = {"cpu": 1e-5, "cuda": 1e-4}  # see test_hf.py
# The bound. Measured 0.0 (AMD EPYC): the backend runs the very pass its reference runs
# (one row of the whole sentence), so no CPU's kernels can round the two differently.
SMOLLM2_ATOL = 1e-4
VOCAB = 49152


def random_ids(seed, n):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_exact(lm, contexts, rows, atol=None):
    assert rows.shape == (len(contexts), lm.vocab_size)
    for context, row in zip(contexts, rows, strict=True):
        reference = lm.next_token_logprobs_uncached(context)
        tolerance = atol or TINY_ATOL["cuda" if row.is_cuda else "cpu"]
        torch.testing.assert_close(row, reference, rtol=0, atol=tolerance)


class TokenCounter:
    """Records the shape of every batch of input ids that reaches the model."""

    def __init__(self, lm):
        self.shapes = []
        self.handle = lm.model.get_input_embeddings().register_forward_hook(
            lambda module, args, output: self.shapes.append(tuple(args[0].shape))
        )

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model_and_tokenizer(request, tiny_llama_path, tiny_gpt2_path):
    path = tiny_llama_path if request.param == "llama" else tiny_gpt2_path
    lm = AsyncTransformer.from_name(str(path))
    return lm.model, lm.tokenizer


@pytest.fixture
def lm(model_and_tokenizer):
    return AsyncTransformer(*model_and_tokenizer)


async def test_all_prefixes_of_a_sequence_are_one_row_of_one_pass(lm):
    sequence = random_ids(1, 40)
    prefixes = [sequence[:n] for n in range(1, 41)]
    with TokenCounter(lm) as counter:
        rows = await lm.batch_next_token_logprobs(prefixes)
    assert counter.shapes == [(1, 40)]
    assert_exact(lm, prefixes, rows)


async def test_prefixes_are_read_from_their_particles_rows_past_the_cached_prompt(lm):
    prompt = random_ids(2, 12)
    lm.cache_kv(prompt)
    lm.output_cache.clear()  # the prompt's own row must be computed again
    particles = [prompt + random_ids(3 + i, 5) for i in range(3)]
    # Every prefix past the prompt of each particle, and the prompt itself, in one batch.
    contexts = [prompt] + [p[:n] for p in particles for n in range(13, 18)]
    with TokenCounter(lm) as counter:
        rows = await lm.batch_next_token_logprobs(contexts)
    # Each particle's prefixes are read from its row; the prompt, cached, runs its last token.
    assert counter.shapes == [(4, 5)]
    assert_exact(lm, contexts, rows)


async def test_a_shared_uncached_prompt_runs_once_before_its_rows(lm):
    prompt = random_ids(4, 48)
    contexts = [prompt + random_ids(5 + i, 2) for i in range(6)]
    with TokenCounter(lm) as counter:
        rows = await lm.batch_next_token_logprobs(contexts)
    assert counter.shapes == [(1, 48), (6, 2)]  # 48 + 12 tokens instead of 6 * 50
    assert_exact(lm, contexts, rows)


async def test_critic_rescoring_runs_only_the_new_token_per_particle(lm):
    critic_prompt = random_ids(6, 10)
    particles = [random_ids(7 + i, 1) for i in range(4)]
    for step in range(4):
        contexts = [critic_prompt + p[:n] for p in particles for n in range(len(p) + 1)]
        with TokenCounter(lm) as counter:
            rows = await lm.batch_next_token_logprobs(contexts)
        if step > 0:  # the earlier prefixes come from the output cache, keys from the tree
            assert sum(rows_ * new for rows_, new in counter.shapes) == len(particles)
        assert_exact(lm, contexts, rows)  # cached rows and new ones, in order
        rows[0].fill_(0.0)  # the caller's own: the cache is unchanged
        assert lm.output_cache.get((None, tuple(contexts[0]))).abs().sum() > 0
        for i, particle in enumerate(particles):
            particle.append(random_ids(20 + 4 * step + i, 1)[0])


class OpsOutsideTheModel(TorchDispatchMode):
    """Counts the tensor operations dispatched outside the model's forward passes."""

    def __init__(self, lm):
        super().__init__()
        self.count, self._inside = 0, False
        self._handles = [
            lm.model.register_forward_pre_hook(lambda *args: setattr(self, "_inside", True)),
            lm.model.register_forward_hook(lambda *args: setattr(self, "_inside", False)),
        ]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._inside and not func.is_view:
            self.count += 1
        return func(*args, **(kwargs or {}))

    def close(self):
        for handle in self._handles:
            handle.remove()


async def test_a_call_copies_its_rows_at_once_however_many_were_computed(lm):
    # Cached rows and the rows the call computes are copied into its tensor together, from
    # the output cache: the operations outside the forward pass do not grow with the rows.
    counts = []
    # Rows for 12 entries in the output cache's memory (`clear_cache` keeps it): no call grows it.
    lm.batch_next_token_logprobs_sync([random_ids(60 + i, 6) for i in range(12)])
    for n_new in (1, 5):
        lm.clear_cache()
        cached = [random_ids(30 + i, 6) for i in range(6)]
        lm.batch_next_token_logprobs_sync(cached)
        new = [random_ids(40 + i, 6) for i in range(n_new)]
        contexts = [c for pair in zip(cached, new + cached[n_new:], strict=True) for c in pair]
        counter = OpsOutsideTheModel(lm)
        try:
            with counter:
                rows = await lm.batch_next_token_logprobs(contexts)
        finally:
            counter.close()
        counts.append(counter.count)
        assert_exact(lm, contexts, rows)
    assert counts[0] == counts[1]


async def test_rows_evicted_while_the_call_computes_are_computed_again(model_and_tokenizer):
    # An output cache of two rows: the call's two new rows evict its two cached ones, which
    # run again (their last token: their key/values are in the tree).
    lm = AsyncTransformer(*model_and_tokenizer, cache_size=2)
    cached = [random_ids(50, 4), random_ids(51, 4)]
    lm.batch_next_token_logprobs_sync(cached)
    contexts = [cached[0], random_ids(52, 4), cached[1], random_ids(53, 5)]
    with TokenCounter(lm) as counter:
        rows = await lm.batch_next_token_logprobs(contexts)
    assert counter.shapes[-1] == (2, 1)
    assert_exact(lm, contexts, rows)


async def test_a_small_working_memory_bound_splits_batches_with_the_same_results(
    model_and_tokenizer,
):
    big = AsyncTransformer(*model_and_tokenizer)
    per_row = big._passes.memory.working_set(1, 40 + 8, 1, 1)
    small = AsyncTransformer(*model_and_tokenizer, max_batch_bytes=2 * 3 * per_row)
    prompt = random_ids(8, 40)
    particles = [prompt + random_ids(9 + i, 1) for i in range(10)]
    for step in range(8):
        with TokenCounter(small) as counter:
            rows = await small.batch_next_token_logprobs(particles)
        expected = await big.batch_next_token_logprobs(particles)
        assert len(counter.shapes) >= 4 and max(n for n, _ in counter.shapes) <= 3
        torch.testing.assert_close(rows, expected, rtol=0, atol=TINY_ATOL["cpu"])
        if step == 7:
            assert_exact(small, particles, rows)
        generator = torch.Generator().manual_seed(step)
        if step % 3 == 2:
            ancestors = torch.randint(0, len(particles), (len(particles),), generator=generator)
            particles = [list(particles[a]) for a in ancestors.tolist()]
        particles = [p + random_ids(100 * step + i, 1) for i, p in enumerate(particles)]
    # The prompt is held once in the tree, not once per particle.
    assert small.kv_cache.nbytes < 2 * big.kv_cache.nbytes + 10 * per_row


def test_a_bound_that_cannot_hold_one_row_is_a_value_error(model_and_tokenizer):
    with pytest.raises(ValueError, match="max_batch_bytes=1000 cannot hold"):
        AsyncTransformer(*model_and_tokenizer, max_batch_bytes=1000)
    with pytest.raises(TypeError, match="max_batch_bytes must be an int"):
        AsyncTransformer(*model_and_tokenizer, max_batch_bytes=2.5e9)
    probe = AsyncTransformer(*model_and_tokenizer)
    with pytest.raises(ValueError, match="max_batch_bytes=1000 cannot hold"):
        probe.max_batch_bytes = 1000
    with pytest.raises(TypeError, match="max_batch_bytes must be an int"):
        probe.max_batch_bytes = "2 GiB"
    assert probe.max_batch_bytes == 2 * 1024**3
    bound = 2 * probe._passes.memory.working_set(1, 8, 8, 1)
    lm = AsyncTransformer(*model_and_tokenizer, max_batch_bytes=bound)
    assert lm.next_token_logprobs_sync(random_ids(10, 4)).shape == (lm.vocab_size,)
    with pytest.raises(ValueError, match="raise max_batch_bytes"):
        lm.next_token_logprobs_sync(random_ids(11, 64))
    assert asyncio.run(lm.next_token_logprobs(random_ids(12, 4))).shape == (lm.vocab_size,)


def test_the_output_cache_is_bounded_in_bytes(model_and_tokenizer):
    row_bytes = 4 * AsyncTransformer(*model_and_tokenizer).vocab_size
    lm = AsyncTransformer(*model_and_tokenizer, output_cache_bytes=5 * row_bytes)
    contexts = [random_ids(13 + i, 3) for i in range(8)]
    lm.batch_next_token_logprobs_sync(contexts)
    assert len(lm.output_cache) == 5 and lm.output_cache.nbytes == 5 * row_bytes
    assert sum((None, tuple(c)) in lm.output_cache for c in contexts) == 5


@pytest.mark.slow
async def test_smollm2_scores_every_prefix_like_the_uncached_forward(smollm2_path):
    lm = AsyncTransformer.from_name(str(smollm2_path), hf_opts={"dtype": torch.float32})
    sequence = lm.tokenizer.encode(
        "The capital of France is Paris. It lies on the Seine, and about two million people "
        "live in the city itself, twelve million in its metropolitan area."
    )
    prefixes = [sequence[:n] for n in range(1, len(sequence) + 1)]
    with TokenCounter(lm) as counter:
        rows = await lm.batch_next_token_logprobs(prefixes)
    assert counter.shapes == [(1, len(sequence))]  # the reference's pass: see SMOLLM2_ATOL
    with torch.no_grad():
        logits = lm.model(torch.tensor([sequence])).logits[0].float()
    torch.testing.assert_close(rows, logits.log_softmax(-1), rtol=0, atol=SMOLLM2_ATOL)
