"""AsyncTransformer: every cached, batched, deduplicated, resampled or evicted path
against `next_token_logprobs_uncached` (one plain forward pass, no cache).

Tolerances: the cached paths compute the same float32 arithmetic as the plain
forward pass, but with other matrix shapes (batch rows, padded key/value
slots, split prefixes), so reductions round in another order. On the tiny
random models logits are O(1) and the differences stay at 1.9e-6 or less on CPU
(1 or 2 float32 ulps of their log-probabilities, near -11; the plain model's own
float32 error against a float64 copy is 8e-7 at most): we allow 1e-5, whatever
the CPU's kernels. On SmolLM2 (30 layers, logits O(10)) rounding depends on the
CPU's kernels at the 1e-4 to 1e-3 scale, so its test compares with a float64
copy of the model, within a tolerance measured in the test (see it). Models that
`from_name` puts on a CUDA device get the CUDA figures (see `TINY_ATOL`).
"""

import asyncio
import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from genlm.backend.llm.hf import AsyncTransformer, Query

# Largest |difference| allowed, per device the model runs on (float32). One wrong token or
# position moves these models' log-probabilities by 2e-2 or more (measured on the tiny GPT-2).
TINY_ATOL = {
    "cpu": 1e-5,  # at most 1.9e-6 measured (AMD EPYC): 1-2 ulps of log-probabilities near -11
    "cuda": 1e-4,  # cuBLAS picks kernels per shape: largest measured 1.3e-5 on an H100, ~8x
}
VOCAB = 49152  # both tiny models' input vocabulary is at least this large


def random_ids(seed, n, vocab=VOCAB):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def on(tensor, atols):
    """The tolerance in `atols` for the device `tensor` is on (the CPU one unless CUDA)."""
    return atols["cuda" if tensor.is_cuda else "cpu"]


def assert_exact(lm, token_ids, result, atols=TINY_ATOL):
    reference = lm.next_token_logprobs_uncached(token_ids)
    assert result.shape == reference.shape
    torch.testing.assert_close(result, reference, rtol=0, atol=on(result, atols))


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def shared_lm(request, tiny_llama_path, tiny_gpt2_path):
    path = tiny_llama_path if request.param == "llama" else tiny_gpt2_path
    return AsyncTransformer.from_name(str(path))


@pytest.fixture
def lm(shared_lm):
    shared_lm.clear_cache()
    shared_lm.batch_size, shared_lm.timeout = 20, 0.02
    yield shared_lm
    shared_lm.reset_async_queries()


class RowCounter:
    """Records the shape of every batch of input ids that reaches the model."""

    def __init__(self, lm):
        self.shapes = []
        self.handle = lm.model.get_input_embeddings().register_forward_hook(
            lambda module, args, output: self.shapes.append(tuple(args[0].shape))
        )

    def close(self):
        self.handle.remove()


def test_output_is_the_full_normalised_row(lm):
    ids = random_ids(0, 7)
    result = lm.next_token_logprobs_sync(ids)
    assert result.dtype == torch.float32
    assert result.shape == (lm.model.get_output_embeddings().out_features,)
    assert torch.logsumexp(result, 0).abs() < 1e-5
    assert_exact(lm, ids, result)


async def test_concurrent_queries_with_different_cached_prefixes(lm):
    prompt = random_ids(1, 30)
    lm.cache_kv(prompt[:10])
    lm.cache_kv(prompt[:25])
    contexts = [
        prompt[:12],  # 10 cached, 2 new
        prompt[:25] + [5],  # 25 cached, 1 new
        prompt[:25] + random_ids(2, 4),  # 25 cached, 4 new
        prompt,  # 25 cached, 5 new
        random_ids(3, 6),  # nothing cached
        prompt[:3],  # inside a cached edge
    ]
    results = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
    for context, result in zip(contexts, results, strict=True):
        assert_exact(lm, context, result)


async def test_cached_prefix_runs_only_the_new_tokens(lm):
    prompt = random_ids(4, 20)
    lm.cache_kv(prompt)
    counter = RowCounter(lm)
    try:
        result = await lm.next_token_logprobs(prompt + [11, 12])
    finally:
        counter.close()
    assert counter.shapes == [(1, 2)]
    assert_exact(lm, prompt + [11, 12], result)


async def test_identical_concurrent_queries_are_computed_once(lm):
    ids = random_ids(5, 9)
    counter = RowCounter(lm)
    try:
        results = await asyncio.gather(*(lm.next_token_logprobs(ids) for _ in range(5)))
        again = await lm.next_token_logprobs(ids)  # from the result cache
    finally:
        counter.close()
    assert counter.shapes == [(1, 9)]
    for result in [*results, again]:
        assert_exact(lm, ids, result)


async def run_smc(lm, n, steps, seed, resample_every=3, lockstep=False):
    """Particles that grow by one or two tokens per step (one with `lockstep`) and get resampled."""
    generator = torch.Generator().manual_seed(seed)
    particles = [random_ids(seed, 16) for _ in range(n)]
    checked = 0
    for step in range(steps):
        results = await asyncio.gather(*(lm.next_token_logprobs(p) for p in particles))
        for particle, result in zip(particles, results, strict=True):
            assert_exact(lm, particle, result)
            checked += 1
        for i, particle in enumerate(particles):
            extra = 1 if lockstep else 1 + (i + step) % 2
            particle.extend(torch.randint(0, VOCAB, (extra,), generator=generator).tolist())
        if step % resample_every == resample_every - 1:
            ancestors = torch.randint(0, n, (n,), generator=generator).tolist()
            particles = [list(particles[a]) for a in ancestors]
    return checked


async def test_resampled_particles_match_uncached(lm):
    assert await run_smc(lm, n=5, steps=7, seed=6) == 35
    assert len(lm.kv_cache) > 0


async def test_lockstep_particles_reuse_the_previous_batch_and_match_uncached(lm, monkeypatch):
    # Particles of equal length that all grow by one token are the SMC pattern the backend
    # serves from the previous batch's buffer (in place, or one copy per row after
    # resampling) instead of gathering cached segments; results must not change.
    from genlm.backend.llm.hf.batch_kv import BatchKV

    gathers = []
    original = BatchKV._gather
    monkeypatch.setattr(
        BatchKV, "_gather", lambda self, buffer: gathers.append(1) or original(self, buffer)
    )
    steps = 10
    assert await run_smc(lm, n=6, steps=steps, seed=11, resample_every=4, lockstep=True) == 60
    assert len(gathers) < steps - 1


async def test_lockstep_rows_join_the_tree_when_no_batch_continues_them(lm):
    # A lockstep step keeps its rows in the batch buffer, outside the tree; rows that the
    # next batch drops (resampled away) and, at `walk_cache`, the rest are inserted then.
    prompt = random_ids(16, 12)
    a, b, c = prompt + [1], prompt + [2], prompt + [3]
    await asyncio.gather(*(lm.next_token_logprobs(p) for p in (a, b, c)))
    await asyncio.gather(*(lm.next_token_logprobs(p) for p in (a + [4], a + [5], b + [6])))
    # `c` was dropped: its key/values are in the tree although no walk has happened yet.
    assert lm.kv_cache.match(c).length == len(c)
    assert lm.kv_cache.match(a + [4]).length < len(a) + 1
    node, index, past, base = lm.walk_cache(a + [4, 7])
    assert index == base == len(a) + 1
    # The inserted key/values are those of a plain forward pass with transformers' cache.
    for context in (c, a + [4], b + [6]):
        found = lm.kv_cache.match(context)
        with torch.no_grad():
            ids = torch.tensor([context], device=lm.model.device)
            cache = lm.model(ids, use_cache=True).past_key_values
        expected = torch.stack(
            [torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers]
        )
        assert found.length == len(context)
        torch.testing.assert_close(
            found.key_values(), expected, rtol=0, atol=on(expected, TINY_ATOL)
        )
    assert_exact(lm, a + [4, 7], await lm.next_token_logprobs(a + [4, 7]))


@pytest.mark.parametrize(
    "ancestors", [[2, 3, 3, 3], [0, 0, 1, 1], [1, 1, 2, 3], [3, 3, 0, 1], [1, 2], [3, 2, 1, 0]]
)
async def test_resampled_rows_are_rebuilt_in_place_whatever_the_ancestors(lm, ancestors):
    # After resampling, rows are copied within the last batch's buffer: a row must not be
    # overwritten before every row descending from it has been copied from it.
    prompt = random_ids(20, 8)
    particles = [prompt + [i] for i in range(4)]
    await asyncio.gather(*(lm.next_token_logprobs(p) for p in particles))
    step = [particles[a] + [10 + i] for i, a in enumerate(ancestors)]
    for contexts in (step, [context + [30] for context in step]):
        results = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
        for context, result in zip(contexts, results, strict=True):
            assert_exact(lm, context, result)


@pytest.mark.parametrize(
    ("ancestors", "n_new"),
    [([0, 1, 2, 3], 48), ([0, 0, 1, 2, 3, 3], 1), ([2] * 6, 1), ([3, 1, 1, 0, 2, 2], 1)],
    ids=["more-slots", "more-rows", "one-ancestor", "unsorted"],
)
async def test_a_step_that_outgrows_the_buffer_copies_its_rows_into_a_new_one(
    lm, monkeypatch, ancestors, n_new
):
    # More rows, or more tokens than the buffer's spare slots: the step's rows are copied
    # from the last batch's buffer into the other storage, not gathered from the tree.
    from genlm.backend.llm.hf.batch_kv import BatchKV

    prompt = random_ids(22, 8)
    particles = [prompt + [i] for i in range(4)]
    await asyncio.gather(*(lm.next_token_logprobs(p) for p in particles))
    gathers = []
    original = BatchKV._gather
    monkeypatch.setattr(
        BatchKV, "_gather", lambda self, buffer: gathers.append(1) or original(self, buffer)
    )
    step = [particles[a] + random_ids(23 + i, n_new) for i, a in enumerate(ancestors)]
    results = await asyncio.gather(*(lm.next_token_logprobs(c) for c in step))
    assert gathers == []
    for context, result in zip(step, results, strict=True):
        assert_exact(lm, context, result)


async def test_a_sampler_and_a_critic_that_alternate_both_continue_in_place(lm, monkeypatch):
    # A sampler's step and an LLM critic's call (every prefix of each particle under its own
    # prompt, all but the newest cached) alternate, each extending its previous batch by one
    # token. Both batches stay in the workspace: once each has run, no batch gathers its
    # rows from the tree or inserts rows into it.
    from genlm.backend.llm.hf.batch_kv import BatchKV

    gathers, inserts = [], []
    original_gather, original_insert = BatchKV._gather, lm.kv_cache.insert
    monkeypatch.setattr(
        BatchKV, "_gather", lambda self, buffer: gathers.append(1) or original_gather(self, buffer)
    )
    monkeypatch.setattr(
        lm.kv_cache, "insert", lambda *args: inserts.append(1) or original_insert(*args)
    )
    generator = torch.Generator().manual_seed(24)
    prompt, critic_prompt = random_ids(25, 10), random_ids(26, 6)
    particles = [prompt + [i] for i in range(4)]
    for step in range(7):
        if step == 3:  # the critic's batch grows from one row at step 1: it takes the
            gathers.clear()  # sampler's storage, and the sampler's step 2 runs from the tree
            inserts.clear()
        rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in particles))
        tokens = [p[len(prompt) :] for p in particles]
        prefixes = [critic_prompt + t[:n] for t in tokens for n in range(len(t))]
        scores = await lm.batch_next_token_logprobs(prefixes)
        for context, result in zip(particles + prefixes, [*rows, *scores], strict=True):
            assert_exact(lm, context, result)
        for particle in particles:
            particle.append(int(torch.randint(0, VOCAB, (1,), generator=generator)))
    assert gathers == [] and inserts == []
    # A batch that continues neither runs from the tree, which holds both batches' rows.
    other = [random_ids(27, 5), random_ids(28, 7)]
    assert_exact(lm, other[0], (await lm.batch_next_token_logprobs(other))[0])
    assert all(lm.kv_cache.match(p).length == len(p) - 1 for p in particles)
    rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in particles))
    for context, result in zip(particles, rows, strict=True):
        assert_exact(lm, context, result)


def test_the_workspace_keeps_two_batches_one_per_storage_and_spills_the_one_it_reuses():
    from genlm.backend.llm.kv_workspace import KVWorkspace

    spilled = []
    workspace = KVWorkspace(batches=2, spill=spilled.append)
    like = torch.empty(0)
    shape = (1, 2, 2, 1, 3, 4)  # [layers, 2, rows, kv_heads, slots, head_dim]
    a = workspace.take(shape, like)
    workspace.remember("x", [(1, 2, 3), (1, 2, 4)], a)
    b = workspace.take(shape, like)  # the storage without a remembered batch
    workspace.remember("x", [(5, 6, 7), (5, 6, 8)], b)
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert [batch.storage for batch in workspace.remembered] == [a, b] and spilled == []
    found, sources = workspace.extension("x", [(1, 2, 4, 9), (1, 2, 3, 9)])
    assert found.storage is a and sources == [1, 0]
    assert workspace.extension("y", [(1, 2, 4, 9)]) is None  # another adapter
    assert workspace.extension("x", [(1, 2, 4, 9), (5, 6, 7, 9)]) is None  # two batches
    # A buffer built from `b` takes `a`'s storage: `a`'s batch is spilled first.
    c = workspace.take(shape, like, avoid=b)
    assert c.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    assert [batch.storage for batch in spilled] == [a]
    assert [batch.storage for batch in workspace.remembered] == [b]
    workspace.forget(b)
    assert workspace.remembered == [] and len(spilled) == 1
    # One batch at most (MLX): remembering another spills the older.
    single = KVWorkspace(spill=spilled.append)
    single.remember("x", [(1,)], "first")
    single.remember("x", [(2,)], "second")
    assert spilled[-1].storage == "first" and single.recall("x", [(2, 3)], [1]) == ("second", [0])
    assert single.remembered == []


async def test_a_step_that_fails_mid_pass_leaves_the_last_batch_usable(lm):
    # The failure comes after the new buffer was taken (the output layer runs last);
    # retrying the resampled step must not build the buffer over the one it copies from.
    prompt = random_ids(19, 10)
    particles = [prompt + [i] for i in range(4)]
    await asyncio.gather(*(lm.next_token_logprobs(p) for p in particles))
    step = [particles[a] + [5 + i] for i, a in enumerate([0, 0, 1, 1])]

    def fail(module, args, output):
        raise RuntimeError("injected failure")

    handle = lm.model.get_output_embeddings().register_forward_hook(fail)
    try:
        failed = await asyncio.gather(
            *(lm.next_token_logprobs(p) for p in step), return_exceptions=True
        )
    finally:
        handle.remove()
    assert all(isinstance(error, RuntimeError) for error in failed)
    for contexts in (step, [step[a] + [9 + i] for i, a in enumerate([3, 2, 2, 0])]):
        results = await asyncio.gather(*(lm.next_token_logprobs(p) for p in contexts))
        for context, result in zip(contexts, results, strict=True):
            assert_exact(lm, context, result)


async def test_a_batch_split_in_two_passes_keeps_every_row(lm):
    # One long and five short contexts run in two passes (padding would more than double
    # the work); neither pass's rows may be lost or overwritten by the other's buffer.
    contexts = [random_ids(17, 60)] + [random_ids(18 + i, 2) for i in range(5)]
    counter = RowCounter(lm)
    try:
        await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
    finally:
        counter.close()
    assert len(counter.shapes) == 2
    assert all(lm.kv_cache.match(c).length == len(c) for c in contexts)
    longer = [c + [1] for c in contexts]
    results = await asyncio.gather(*(lm.next_token_logprobs(c) for c in longer))
    for context, result in zip(longer, results, strict=True):
        assert_exact(lm, context, result)


async def test_tiny_budget_evicts_and_stays_exact(shared_lm):
    probe = AsyncTransformer(shared_lm.model, shared_lm.tokenizer)
    probe.cache_kv(random_ids(7, 10))
    bytes_per_token = probe.kv_cache.nbytes // 10
    lm = AsyncTransformer(shared_lm.model, shared_lm.tokenizer, kv_cache_bytes=40 * bytes_per_token)
    await run_smc(lm, n=4, steps=6, seed=8)
    assert 0 < lm.kv_cache.peak_nbytes <= lm.kv_cache.max_bytes
    no_kv = AsyncTransformer(shared_lm.model, shared_lm.tokenizer, kv_cache_bytes=0)
    await run_smc(no_kv, n=3, steps=3, seed=9)
    assert no_kv.kv_cache.peak_nbytes == 0


def test_walk_cache_returns_the_cached_prefix_and_its_key_values(lm):
    prompt = random_ids(10, 12)
    node, index, past, base = lm.walk_cache(prompt)
    assert (index, past, base) == (0, None, 0) and node.past_key_values is None
    lm.cache_kv(prompt)
    node, index, past, base = lm.walk_cache(prompt + [3, 4])
    assert index == base == len(prompt)
    assert node.past_key_values is not None
    # Reference key/values: a plain forward pass with transformers' own cache.
    with torch.no_grad():
        ids = torch.tensor([prompt], device=lm.model.device)
        cache = lm.model(ids, use_cache=True).past_key_values
    expected = torch.stack(
        [torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers]
    )
    torch.testing.assert_close(past.key_values(), expected, rtol=0, atol=on(expected, TINY_ATOL))


async def test_add_query_and_batch_evaluate_queries(lm):
    lm.batch_evaluate_queries()  # nothing queued: no-op
    prompt = random_ids(11, 10)
    lm.cache_kv(prompt)
    lm.timeout = 60  # only batch_evaluate_queries will run the batch
    _, _, past, _ = lm.walk_cache(prompt)
    loop = asyncio.get_running_loop()
    first, second = loop.create_future(), loop.create_future()
    lm.add_query(Query(prompt + [1, 2]), first, past)
    lm.add_query(Query(random_ids(12, 5)), second, None)
    assert [len(q.token_ids) for q in lm.queries] == [12, 5]
    lm.batch_evaluate_queries()
    assert lm.queries == []
    assert_exact(lm, prompt + [1, 2], first.result())
    assert_exact(lm, random_ids(12, 5), second.result())


async def test_add_query_takes_token_ids_as_in_0_3(lm):
    lm.timeout = 60
    loop = asyncio.get_running_loop()
    plain, listed = loop.create_future(), loop.create_future()
    context = random_ids(40, 6)
    lm.add_query(context, plain, None)  # a list of ids, as 0.3.x takes it
    lm.add_query(context + [3], listed, None, lora_name=None)
    assert [q.token_ids for q in lm.queries] == [tuple(context), tuple(context + [3])]
    lm.batch_evaluate_queries()
    assert_exact(lm, context, plain.result())
    assert_exact(lm, context + [3], listed.result())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        lm.add_query([-1], loop.create_future(), None)
    with pytest.raises(ValueError, match="no LoRA adapter named 'missing'"):
        lm.add_query(context, loop.create_future(), None, lora_name="missing")
    assert lm.queries == []


async def test_assigning_queries_drops_them_and_cancels_their_callers(lm):
    lm.timeout = 60
    kept_ids, dropped_ids = random_ids(41, 5), random_ids(42, 5)
    kept = asyncio.ensure_future(lm.next_token_logprobs(kept_ids))
    dropped = asyncio.ensure_future(lm.next_token_logprobs(dropped_ids))
    await asyncio.sleep(0)
    assert len(lm.queries) == 2
    lm.queries = [q for q in lm.queries if q.token_ids == tuple(kept_ids)]
    assert [q.token_ids for q in lm.queries] == [tuple(kept_ids)]
    with pytest.raises(ValueError, match="queued queries"):
        lm.queries = [Query(dropped_ids)]
    assert len(lm.queries) == 1
    lm.queries = []
    assert lm.queries == []
    for task in (dropped, kept):
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=30)
    lm.timeout = 0
    assert_exact(lm, kept_ids, await lm.next_token_logprobs(kept_ids))


async def test_batch_size_and_timeout_are_attributes(lm):
    lm.batch_size, lm.timeout = 2, 60
    contexts = [random_ids(13, 4), random_ids(14, 4)]
    results = await asyncio.wait_for(
        asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts)), timeout=30
    )  # a full batch runs without waiting for the timeout
    for context, result in zip(contexts, results, strict=True):
        assert_exact(lm, context, result)
    lm.batch_size, lm.timeout = 20, 0
    assert_exact(lm, contexts[0] + [1], await lm.next_token_logprobs(contexts[0] + [1]))
    with pytest.raises(ValueError):
        lm.batch_size = 0


@pytest.mark.parametrize(
    "bad",
    [[], [-1], [VOCAB * 4], [1.5], ["a"], "abc", [[1, 2]], [1] * 100_000],
    ids=["empty", "negative", "out-of-vocab", "float", "str-id", "str", "nested", "too-long"],
)
async def test_bad_input_raises_value_error_and_spares_the_batch(lm, bad):
    good = random_ids(15, 6)
    results = await asyncio.gather(
        lm.next_token_logprobs(good), lm.next_token_logprobs(bad), return_exceptions=True
    )
    assert isinstance(results[1], ValueError)
    assert_exact(lm, good, results[0])
    for call in (lm.next_token_logprobs_sync, lm.next_token_logprobs_uncached, lm.cache_kv):
        with pytest.raises(ValueError):
            call(bad)


async def test_reset_async_queries_cancels_waiting_callers(lm):
    lm.timeout = 60
    task = asyncio.ensure_future(lm.next_token_logprobs(random_ids(16, 5)))
    await asyncio.sleep(0)
    assert len(lm.queries) == 1
    lm.reset_async_queries()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=30)
    assert lm.queries == []
    lm.timeout = 0
    assert_exact(lm, random_ids(16, 5), await lm.next_token_logprobs(random_ids(16, 5)))


async def test_failing_batch_reaches_its_callers_and_model_stays_usable(lm, monkeypatch):
    prompt = random_ids(17, 8)
    lm.cache_kv(prompt)

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(lm.model, "forward", broken)
    contexts = [prompt + [1], prompt + [2], random_ids(18, 3)]
    results = await asyncio.gather(
        *(lm.next_token_logprobs(c) for c in contexts), return_exceptions=True
    )
    assert all(isinstance(r, RuntimeError) for r in results)
    monkeypatch.undo()
    results = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
    for context, result in zip(contexts, results, strict=True):
        assert_exact(lm, context, result)


def test_clear_kv_cache_and_clear_cache(lm):
    prompt = random_ids(19, 10)
    lm.cache_kv(prompt)
    assert len(lm.kv_cache) > 0 and len(lm.output_cache) > 0
    lm.clear_kv_cache()
    assert len(lm.kv_cache) == 0 and len(lm.output_cache) > 0
    assert lm.walk_cache(prompt)[1] == 0
    assert_exact(lm, prompt + [4], lm.next_token_logprobs_sync(prompt + [4]))
    lm.clear_cache()
    assert len(lm.kv_cache) == 0 and len(lm.output_cache) == 0


def test_batch_next_token_logprobs_sync(lm):
    contexts = [random_ids(20, 5), random_ids(21, 9), random_ids(20, 5)]
    results = lm.batch_next_token_logprobs_sync(contexts)
    assert results.shape[0] == 3
    for context, result in zip(contexts, results, strict=True):
        assert_exact(lm, context, result)


async def test_sampling_is_seeded(lm):
    prompt = random_ids(22, 5)
    first = await lm.sample(prompt, max_tokens=6, eos_token_ids=[], seed=3)
    second = await lm.sample(prompt, max_tokens=6, eos_token_ids=[], seed=3)
    assert first == second and len(first) == 6
    stopped = await lm.sample(prompt, max_tokens=6, eos_token_ids=[first[2]], seed=3)
    assert stopped == first[: first.index(first[2])]
    batch = await lm.batch_sample([prompt, prompt], max_tokens=4, eos_token_ids=[], seed=3)
    assert batch[0] == first[:4]


def test_bitsandbytes_opts(tiny_llama_path):
    if importlib.util.find_spec("bitsandbytes") is None:
        with pytest.raises(ImportError, match=r"genlm-backend\[quantization\]"):
            AsyncTransformer.from_name(
                str(tiny_llama_path), bitsandbytes_opts={"load_in_8bit": True}
            )
        return
    lm = AsyncTransformer.from_name(
        str(tiny_llama_path),
        bitsandbytes_opts={"load_in_8bit": True},
        hf_opts={"device_map": "cpu"},
    )
    ids = random_ids(23, 6)
    # Quantised weights change the model; the cached path must still agree with its own forward.
    assert_exact(lm, ids, lm.next_token_logprobs_sync(ids), atols={"cpu": 1e-4})


@pytest.fixture(scope="module")
def lora_setup(tiny_llama_path, tmp_path_factory):
    """Two saved adapters and, for each, the merged model as an independent reference."""
    from peft import LoraConfig, PeftModel, get_peft_model

    folders, merged = {}, {}
    for name, seed in (("a", 0), ("b", 1)):
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(tiny_llama_path)
        config = LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        folders[name] = tmp_path_factory.mktemp(f"lora_{name}")
        get_peft_model(base, config).save_pretrained(folders[name])
        fresh = AutoModelForCausalLM.from_pretrained(tiny_llama_path)
        merged[name] = PeftModel.from_pretrained(fresh, folders[name]).merge_and_unload().eval()
    return folders, merged


def reference_logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)


async def test_lora_switching_never_serves_another_adapters_cache(tiny_llama_path, lora_setup):
    folders, merged = lora_setup
    lm = AsyncTransformer(
        AutoModelForCausalLM.from_pretrained(tiny_llama_path),
        AutoTokenizer.from_pretrained(tiny_llama_path),
    )
    base_model = AutoModelForCausalLM.from_pretrained(tiny_llama_path).eval()
    prompt = random_ids(24, 12)
    contexts = [prompt + [1], prompt + [2, 3]]
    lm.cache_kv(prompt)
    base = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
    lm.add_new_lora(str(folders["a"]), "a")
    lm.set_lora(str(folders["b"]), "b")  # loads and activates b
    with pytest.raises(ValueError):
        lm.set_lora(lora_name="missing")
    for name in ("b", "a", None, "b"):
        if name is None:
            lm.clear_lora()
            reference = base_model
        else:
            lm.set_lora(lora_name=name)
            reference = merged[name]
        lm.cache_kv(prompt)
        results = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
        for context, result in zip(
            [prompt, *contexts], [lm.next_token_logprobs_sync(prompt), *results], strict=True
        ):
            torch.testing.assert_close(
                result, reference_logprobs(reference, context), rtol=0, atol=on(result, TINY_ATOL)
            )
    assert not torch.allclose(base[0], reference_logprobs(merged["a"], contexts[0]), atol=1e-3)


@pytest.mark.slow
async def test_smollm2_agrees_with_uncached(smollm2_path, float64_reference):
    """Cached, batched, deduplicated and resampled SmolLM2 rows against a float64 reference.

    The backend computes these rows in passes of other shapes than one plain pass over each
    context (the cached prompt, then 4 rows x 1 new token, then 3 rows x 2), and float32
    kernels round differently for other shapes, by amounts that depend on the CPU. On an
    AMD EPYC the plain float32 model's own rows for these contexts vary with the split of
    the pass by up to 4.6e-5 (one pass, the prefix then the last token, one token at a
    time), and the backend's differ from one plain pass by up to 4.4e-5: too close to a
    fixed 1e-4 for a CPU whose kernels vary more (SmolLM2's rows varied by 1.46e-3 with the
    pass length on an Intel Xeon with AMX). So the reference is a float64 copy of the model,
    whose own rounding is negligible, and the tolerance is measured in the test: `error`,
    the plain float32 model's largest difference from it over these contexts, in one pass
    and split before the last token (3.7e-5 on the AMD EPYC), is how far float32 rounding
    takes these rows on this machine; any order of the same float32 arithmetic rounds by
    about as much (the backend's rows: 4.3e-5 there). We allow 3x that plus 2e-5 (a few
    float32 ulps of log-probabilities down to -40): 1.3e-4 on the AMD EPYC. A wrong
    position, token or row moves these rows by 0.1 or more.
    """
    lm = AsyncTransformer.from_name(str(smollm2_path), hf_opts={"dtype": torch.float32})
    prompt = lm.tokenizer.encode("The capital of France is")
    lm.cache_kv(prompt)
    particles = [list(prompt) for _ in range(4)]
    generator = torch.Generator().manual_seed(25)
    rows = {}  # context -> the backend's rows for it
    for step in range(3):
        results = await asyncio.gather(*(lm.next_token_logprobs(p) for p in particles))
        for particle, result in zip(particles, results, strict=True):
            assert result.shape == (lm.vocab_size,) and result.dtype == torch.float32
            rows.setdefault(tuple(particle), []).append(result.cpu())
        for particle in particles:
            particle.extend(torch.randint(0, 49152, (1 + step % 2,), generator=generator).tolist())
        if step == 1:
            particles = [list(particles[i]) for i in (0, 0, 1, 3)]
    references, tolerance = float64_reference(lm.model, list(rows))
    for results, reference in zip(rows.values(), references, strict=True):
        for result in results:
            torch.testing.assert_close(result.double(), reference, rtol=0, atol=tolerance)
    paris = lm.tokenizer.encode(" Paris")[0]
    assert int(lm.next_token_logprobs_sync(prompt).argmax()) == paris


@pytest.fixture
def lora_lm(tiny_llama_path, lora_setup):
    """A fresh model with adapters "a" and "b" registered, none active."""
    folders, _ = lora_setup
    lm = AsyncTransformer(
        AutoModelForCausalLM.from_pretrained(tiny_llama_path),
        AutoTokenizer.from_pretrained(tiny_llama_path),
        batch_size=100,
        timeout=0.05,
    )
    lm.add_new_lora(str(folders["a"]), "a")
    lm.add_new_lora(str(folders["b"]), "b")
    return lm


async def test_adapters_and_base_in_one_window_each_match_their_reference(
    tiny_llama_path, lora_setup, lora_lm
):
    _, merged = lora_setup
    references = {**merged, None: AutoModelForCausalLM.from_pretrained(tiny_llama_path).eval()}
    prompt = random_ids(40, 10)
    lora_lm.cache_kv(prompt, lora_name="a")
    contexts = [prompt + [5], prompt + [6, 7], random_ids(41, 4)]
    for active in (None, "b"):  # what lora_name=None means follows set_lora
        if active is not None:
            lora_lm.set_lora(lora_name=active)
        calls = [(c, name) for c in contexts for name in ("a", "b", None)]
        results = await asyncio.gather(
            *(lora_lm.next_token_logprobs(c, lora_name=name) for c, name in calls)
        )
        for (context, name), result in zip(calls, results, strict=True):
            reference = references[active if name is None else name]
            torch.testing.assert_close(
                result, reference_logprobs(reference, context), rtol=0, atol=on(result, TINY_ATOL)
            )
    assert lora_lm.loras.active == "b"
    batch = await lora_lm.batch_next_token_logprobs(contexts, lora_name="a")
    batch_sync = lora_lm.batch_next_token_logprobs_sync(contexts, lora_name=None)
    atol = on(batch, TINY_ATOL)
    for i, context in enumerate(contexts):
        torch.testing.assert_close(
            batch[i], reference_logprobs(merged["a"], context), rtol=0, atol=atol
        )
        torch.testing.assert_close(
            batch_sync[i], reference_logprobs(merged["b"], context), rtol=0, atol=atol
        )


async def test_per_call_adapter_reuses_its_own_prefix_only(lora_lm):
    prompt = random_ids(42, 16)
    lora_lm.cache_kv(prompt, lora_name="a")
    counter = RowCounter(lora_lm)
    try:
        await lora_lm.next_token_logprobs(prompt + [9], lora_name="a")
        await lora_lm.next_token_logprobs(prompt + [9], lora_name="b")
    finally:
        counter.close()
    assert counter.shapes == [(1, 1), (1, len(prompt) + 1)]


async def test_sampling_with_a_per_call_adapter_equals_activating_it(lora_lm):
    prompt = random_ids(43, 5)
    per_call = await lora_lm.sample(prompt, 6, [], seed=3, lora_name="a")
    batch = await lora_lm.batch_sample([prompt, prompt], 6, [], seed=3, lora_name="a")
    lora_lm.set_lora(lora_name="a")
    activated = await lora_lm.sample(prompt, 6, [], seed=3)
    assert per_call == activated == batch[0] and len(per_call) == 6


async def test_replacing_and_removing_adapters(lora_setup, lora_lm):
    folders, merged = lora_setup
    context = random_ids(44, 7)
    old = await lora_lm.next_token_logprobs(context, lora_name="a")
    torch.testing.assert_close(
        old, reference_logprobs(merged["a"], context), rtol=0, atol=on(old, TINY_ATOL)
    )
    lora_lm.add_new_lora(str(folders["b"]), "a")  # "a" now holds b's weights
    new = await lora_lm.next_token_logprobs(context, lora_name="a")
    torch.testing.assert_close(
        new, reference_logprobs(merged["b"], context), rtol=0, atol=on(new, TINY_ATOL)
    )
    lora_lm.cache_kv(context, lora_name="a")  # its key/values join the tree now
    before = lora_lm.kv_cache.nbytes
    lora_lm.set_lora(lora_name="a")
    lora_lm.remove_lora("a")
    assert lora_lm.loras.names == ["b"] and lora_lm.loras.active is None
    assert lora_lm.kv_cache.nbytes < before
    assert all(key[0] != "a" for key in lora_lm.output_cache._entries)
    with pytest.raises(ValueError, match=r"no LoRA adapter named 'a'; registered adapters: 'b'"):
        await lora_lm.next_token_logprobs(context, lora_name="a")
    with pytest.raises(ValueError, match="registered adapters: 'b'"):
        lora_lm.remove_lora("a")
    lora_lm.remove_lora("b")
    with pytest.raises(ValueError, match="registered adapters: none"):
        lora_lm.next_token_logprobs_sync(context, lora_name="b")
    assert_exact(lora_lm, context, await lora_lm.next_token_logprobs(context))


async def test_results_belong_to_the_caller(lm):
    context = random_ids(45, 6)
    reference = lm.next_token_logprobs_uncached(context)
    first, twin = await asyncio.gather(
        lm.next_token_logprobs(context), lm.next_token_logprobs(context)
    )
    first.fill_(0.0)
    torch.testing.assert_close(twin, reference, rtol=0, atol=on(twin, TINY_ATOL))
    again = await lm.next_token_logprobs(context)  # served by the output cache
    again.fill_(1.0)
    sync = lm.next_token_logprobs_sync(context)
    sync.fill_(2.0)
    torch.testing.assert_close(
        await lm.next_token_logprobs(context), reference, rtol=0, atol=on(reference, TINY_ATOL)
    )


async def test_an_empty_batch_is_an_empty_tensor(lm):
    for rows in (await lm.batch_next_token_logprobs([]), lm.batch_next_token_logprobs_sync([])):
        assert rows.shape == (0, lm.vocab_size) and rows.dtype == torch.float32


def test_two_threads_with_their_own_loops_share_the_model(shared_lm):
    import threading

    shared_lm.clear_cache()
    contexts = {t: [random_ids(50 + t * 10 + i, 3 + i) for i in range(4)] for t in (0, 1)}
    outcomes: dict[int, list] = {}
    barrier = threading.Barrier(2)

    def worker(t):
        async def run():
            barrier.wait()
            return await asyncio.gather(*(shared_lm.next_token_logprobs(c) for c in contexts[t]))

        outcomes[t] = asyncio.run(run())

    threads = [threading.Thread(target=worker, args=(t,)) for t in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for t in (0, 1):
        for context, result in zip(contexts[t], outcomes[t], strict=True):
            assert_exact(shared_lm, context, result)


def test_half_precision_log_softmax_is_taken_in_float32(tiny_llama_path):
    lm = AsyncTransformer.from_name(str(tiny_llama_path), hf_opts={"dtype": torch.bfloat16})
    reference_model = AutoModelForCausalLM.from_pretrained(
        tiny_llama_path, dtype=torch.bfloat16
    ).to(lm.model.device)
    reference_model.eval()
    context = random_ids(46, 8)
    result = lm.next_token_logprobs_sync(context)
    assert result.dtype == torch.float32
    # Normalised in float32: a bfloat16 log-softmax would be off by up to ~0.1 nats.
    assert abs(float(torch.logsumexp(result.double(), dim=0))) < 1e-5
    with torch.no_grad():
        logits = reference_model(torch.tensor([context], device=result.device)).logits[0, -1]
    # Same bfloat16 weights on the same device: measured identical (0.0) on CPU; a bfloat16
    # log-softmax would be off by 0.054 on this context, so 0.01 tells the two apart.
    torch.testing.assert_close(result, torch.log_softmax(logits.float(), dim=-1), rtol=0, atol=0.01)
