"""AsyncTokenCharacterTrie: batching, errors, cancellation, lifecycle."""

import asyncio
import gc
import weakref

import numpy as np
import pytest

from genlm.backend import AsyncTokenCharacterTrie, ParallelTokenCharacterTrie, TokenCharacterTrie

VOCAB = [b"a", b"ab", b"abc", b"b", b"", b"ba"]

# Plain byte strings are deprecated items (see tests/trie/test_trie.py for the warning);
# they work, and keep these tests short.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Passing plain bytes to TokenCharacterTrie is deprecated:DeprecationWarning"
)


class RecordingTrie(TokenCharacterTrie):
    """A trie that records its batched calls and can be told to fail."""

    def __init__(self, decode):
        super().__init__(decode)
        self.batches: list[tuple[str, int]] = []
        self.fail_next = False

    def _record(self, name, ws):
        self.batches.append((name, len(ws)))
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("batch failed")

    def batch_weight_sum(self, ws):
        self._record("sum", ws)
        return super().batch_weight_sum(ws)

    def batch_weight_max(self, ws):
        self._record("max", ws)
        return super().batch_weight_max(ws)


def random_weights(count, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=len(VOCAB)) for _ in range(count)]


async def test_concurrent_calls_share_one_batch_per_operation():
    trie = RecordingTrie(VOCAB)
    async_trie = AsyncTokenCharacterTrie(trie)
    weights = random_weights(10)
    sums, maxes = await asyncio.gather(
        asyncio.gather(*(async_trie.weight_sum(ws) for ws in weights)),
        asyncio.gather(*(async_trie.weight_max(ws) for ws in weights)),
    )
    assert sorted(trie.batches) == [("max", 10), ("sum", 10)]
    reference = TokenCharacterTrie(VOCAB)
    for ws, total, best in zip(weights, sums, maxes, strict=True):
        np.testing.assert_array_equal(total, reference.weight_sum(ws))
        np.testing.assert_array_equal(best, reference.weight_max(ws))


async def test_mass_sum_is_weight_sum():
    async_trie = AsyncTokenCharacterTrie(TokenCharacterTrie(VOCAB))
    (ws,) = random_weights(1)
    np.testing.assert_array_equal(await async_trie.mass_sum(ws), await async_trie.weight_sum(ws))


async def test_one_gather_is_one_batched_call_even_beyond_batch_size():
    trie = RecordingTrie(VOCAB)
    async_trie = AsyncTokenCharacterTrie(trie, batch_size=4, timeout=60.0)
    weights = random_weights(10)
    results = await asyncio.gather(*(async_trie.weight_sum(ws) for ws in weights))
    assert trie.batches == [("sum", 10)]
    for ws, result in zip(weights, results, strict=True):
        np.testing.assert_array_equal(result, trie.weight_sum(ws))


async def test_error_reaches_every_caller_of_its_batch_and_trie_recovers():
    trie = RecordingTrie(VOCAB)
    async_trie = AsyncTokenCharacterTrie(trie)
    trie.fail_next = True
    results = await asyncio.gather(
        *(async_trie.weight_sum(ws) for ws in random_weights(5)), return_exceptions=True
    )
    assert all(isinstance(r, RuntimeError) and str(r) == "batch failed" for r in results)
    (ws,) = random_weights(1, seed=1)
    np.testing.assert_array_equal(await async_trie.weight_sum(ws), trie.weight_sum(ws))


async def test_wrong_length_fails_only_its_caller():
    trie = RecordingTrie(VOCAB)
    async_trie = AsyncTokenCharacterTrie(trie)
    good = random_weights(3)
    results = await asyncio.gather(
        *(async_trie.weight_max(ws) for ws in good),
        async_trie.weight_max(np.ones(len(VOCAB) + 1)),
        return_exceptions=True,
    )
    assert isinstance(results[-1], ValueError)
    for ws, result in zip(good, results[:-1], strict=True):
        np.testing.assert_array_equal(result, trie.weight_max(ws))
    assert trie.batches == [("max", 3)]


async def test_cancelled_caller_does_not_disturb_the_others():
    trie = RecordingTrie(VOCAB)
    async_trie = AsyncTokenCharacterTrie(trie, timeout=0.05)
    weights = random_weights(4)
    tasks = [asyncio.create_task(async_trie.weight_sum(ws)) for ws in weights]
    await asyncio.sleep(0)
    tasks[1].cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[1], asyncio.CancelledError)
    for i in (0, 2, 3):
        np.testing.assert_array_equal(results[i], trie.weight_sum(weights[i]))
    assert trie.batches == [("sum", 3)]


def pending_tasks():
    return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]


async def test_cleanup_cancels_waiting_callers_and_leaves_nothing_running():
    trie = RecordingTrie(VOCAB)
    async_trie = AsyncTokenCharacterTrie(trie, batch_size=100, timeout=60.0)
    callers = [asyncio.create_task(async_trie.weight_sum(ws)) for ws in random_weights(3)]
    await asyncio.sleep(0)
    await async_trie.cleanup()
    results = await asyncio.gather(*callers, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    assert trie.batches == []
    assert pending_tasks() == []
    assert async_trie._sum.pending == [] and async_trie._max.pending == []
    # Still usable afterwards.
    (ws,) = random_weights(1)
    async_trie._sum.timeout = 0.0
    np.testing.assert_array_equal(await async_trie.weight_sum(ws), trie.weight_sum(ws))


async def test_shutdown_cancels_waiting_callers():
    async_trie = AsyncTokenCharacterTrie(TokenCharacterTrie(VOCAB), timeout=60.0)
    callers = [asyncio.create_task(async_trie.weight_max(ws)) for ws in random_weights(2)]
    await asyncio.sleep(0)
    async_trie.shutdown()
    results = await asyncio.gather(*callers, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    assert pending_tasks() == []


async def test_async_context_manager_cleans_up():
    async with AsyncTokenCharacterTrie(TokenCharacterTrie(VOCAB), timeout=60.0) as async_trie:
        caller = asyncio.create_task(async_trie.weight_sum(np.ones(len(VOCAB))))
        await asyncio.sleep(0)
    with pytest.raises(asyncio.CancelledError):
        await caller


def test_created_outside_a_loop_and_used_by_successive_runs():
    trie = RecordingTrie(VOCAB)
    async_trie = AsyncTokenCharacterTrie(trie)
    async_trie.start()
    weights = random_weights(3)

    async def run():
        return await asyncio.gather(*(async_trie.weight_sum(ws) for ws in weights))

    for _ in range(3):
        for ws, result in zip(weights, asyncio.run(run()), strict=True):
            np.testing.assert_array_equal(result, trie.weight_sum(ws))
    assert trie.batches == [("sum", 3)] * 3
    async_trie.shutdown()


def test_from_vocab_backends():
    sequential = AsyncTokenCharacterTrie.from_vocab(VOCAB, backend="sequential")
    parallel = AsyncTokenCharacterTrie.from_vocab(VOCAB, device="cpu")
    assert type(sequential.trie) is TokenCharacterTrie
    assert isinstance(parallel.trie, ParallelTokenCharacterTrie)
    with pytest.raises(ValueError, match="backend"):
        AsyncTokenCharacterTrie.from_vocab(VOCAB, backend="gpu")

    async def both(ws):
        return await sequential.weight_max(ws), await parallel.weight_max(ws)

    (ws,) = random_weights(1)
    first, second = asyncio.run(both(ws))
    np.testing.assert_array_equal(first, second)


@pytest.mark.parametrize("backend", ["sequential", "parallel"])
def test_a_trie_its_users_drop_is_freed_without_the_garbage_collector(backend):
    # The tries of a large vocabulary hold tens of MB; a bound method of the wrapper in its
    # batchers made a cycle that only the collector's full passes freed.
    gc.collect()
    gc.disable()
    try:
        async_trie = AsyncTokenCharacterTrie.from_vocab(VOCAB, backend=backend)
        (ws,) = random_weights(1)
        total = asyncio.run(async_trie.weight_sum(ws))
        np.testing.assert_array_equal(total, TokenCharacterTrie(VOCAB).weight_sum(ws))
        freed = [weakref.ref(async_trie), weakref.ref(async_trie.trie)]
        del async_trie
        assert [reference() for reference in freed] == [None, None]
    finally:
        gc.enable()
