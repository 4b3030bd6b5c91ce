"""Tests of `OutputCache`, the bounded LRU map from token-id tuples to tensors."""

from __future__ import annotations

import threading
from collections import OrderedDict

import pytest
import torch

from genlm.backend.cache import OutputCache


def tensor(value):
    return torch.full((3,), float(value))


def test_get_set_contains_len_and_clear():
    cache = OutputCache(maxsize=4)
    assert len(cache) == 0 and (1, 2) not in cache and cache.get((1, 2)) is None
    cache[(1, 2)] = tensor(1)
    cache[(3,)] = tensor(2)
    assert (1, 2) in cache and (3,) in cache and len(cache) == 2
    assert torch.equal(cache[(1, 2)], tensor(1))
    assert torch.equal(cache.get((3,)), tensor(2))
    with pytest.raises(KeyError):
        cache[(9,)]
    cache.clear()
    assert len(cache) == 0 and (1, 2) not in cache


def test_overwriting_a_key_keeps_one_entry():
    cache = OutputCache(maxsize=2)
    cache[(1,)] = tensor(1)
    cache[(1,)] = tensor(5)
    assert len(cache) == 1 and torch.equal(cache[(1,)], tensor(5))


def test_a_byte_budget_evicts_the_least_recently_used():
    row_bytes = 3 * 4  # tensor() rows: 3 float32
    cache = OutputCache(maxsize=100, max_bytes=2 * row_bytes + 5)
    cache[(1,)] = tensor(1)
    cache[(2,)] = tensor(2)
    cache.get((1,))  # now (2,) is the least recently used
    cache[(3,)] = tensor(3)
    assert sorted(key for key in [(1,), (2,), (3,)] if key in cache) == [(1,), (3,)]
    assert cache.nbytes == 2 * row_bytes
    cache.store_rows([(4,), (5,), (6,)], torch.stack([tensor(4), tensor(5), tensor(6)]))
    assert len(cache) == 2 and (5,) in cache and (6,) in cache  # the batch's last rows
    assert torch.equal(cache[(6,)], tensor(6))
    cache.remove_if(lambda key: key == (5,))
    assert cache.nbytes == row_bytes
    cache.clear()
    assert cache.nbytes == 0
    tiny = OutputCache(maxsize=100, max_bytes=row_bytes - 1)  # holds no row
    tiny[(1,)] = tensor(1)
    assert len(tiny) == 0 and tiny.nbytes == 0
    with pytest.raises(ValueError, match="max_bytes"):
        OutputCache(maxsize=1, max_bytes=-1)


def test_get_rows_copies_found_entries_into_one_tensor_and_names_the_missing():
    cache = OutputCache(maxsize=3)
    for value in (1, 2, 3):
        cache[(value,)] = tensor(value)
    assert cache.get_rows([(8,), (9,)]) == (None, [0, 1])
    rows, missing = cache.get_rows([(2,), (7,), (1,)])
    assert missing == [1]
    assert torch.equal(rows[0], tensor(2)) and torch.equal(rows[2], tensor(1))
    rows.fill_(0.0)  # the caller's own
    assert torch.equal(cache[(2,)], tensor(2))
    cache[(4,)] = tensor(4)  # evicts (3,): (1,) and (2,) were used more recently
    assert (3,) not in cache and (1,) in cache and (2,) in cache


def test_touch_marks_entries_recently_used_and_names_the_missing():
    cache = OutputCache(maxsize=3)
    for value in (1, 2, 3):
        cache[(value,)] = tensor(value)
    assert cache.touch([(9,), (1,), (2,), (8,)]) == [0, 3]
    cache[(4,)] = tensor(4)  # evicts (3,): (1,) and (2,) were touched since
    assert (3,) not in cache and (1,) in cache and (2,) in cache
    assert cache.touch([]) == []


def test_evicts_the_least_recently_used():
    cache = OutputCache(maxsize=2)
    cache[(1,)] = tensor(1)
    cache[(2,)] = tensor(2)
    cache[(1,)]  # reading makes (1,) the most recent
    cache[(3,)] = tensor(3)
    assert (1,) in cache and (3,) in cache and (2,) not in cache
    cache.get((1,))
    cache[(4,)] = tensor(4)
    assert set(k for k in [(1,), (3,), (4,)] if k in cache) == {(1,), (4,)}
    assert len(cache) == 2


def test_writing_refreshes_recency():
    cache = OutputCache(maxsize=2)
    cache[(1,)] = tensor(1)
    cache[(2,)] = tensor(2)
    cache[(1,)] = tensor(10)
    cache[(3,)] = tensor(3)
    assert (2,) not in cache and torch.equal(cache[(1,)], tensor(10))


def test_membership_does_not_refresh_recency():
    cache = OutputCache(maxsize=2)
    cache[(1,)] = tensor(1)
    cache[(2,)] = tensor(2)
    assert (1,) in cache
    cache[(3,)] = tensor(3)
    assert (1,) not in cache


def test_never_grows_past_maxsize():
    cache = OutputCache(maxsize=5)
    for i in range(100):
        cache[(i,)] = tensor(i)
        assert len(cache) <= 5
    assert [k for k in [(i,) for i in range(100)] if k in cache] == [(i,) for i in range(95, 100)]


def test_maxsize_zero_keeps_nothing():
    cache = OutputCache(maxsize=0)
    cache[(1,)] = tensor(1)
    assert len(cache) == 0 and (1,) not in cache and cache.get((1,)) is None


def test_negative_maxsize_is_rejected():
    with pytest.raises(ValueError):
        OutputCache(maxsize=-1)


def test_move_to_cpu_round_trips_values_on_cpu():
    cache = OutputCache(maxsize=2, move_to_cpu=True)
    value = torch.randn(4, generator=torch.Generator().manual_seed(0))
    cache[(1,)] = value
    out = cache[(1,)]
    assert out.device.type == "cpu" and torch.equal(out, value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_move_to_cpu_stores_on_cpu_and_returns_on_the_original_device():
    cache = OutputCache(maxsize=2, move_to_cpu=True)
    before = torch.cuda.memory_allocated()
    value = torch.randn(1 << 20, device="cuda")
    expected = value.cpu()
    cache[(1,)] = value
    del value
    assert torch.cuda.memory_allocated() == before  # the entry holds no GPU memory
    out = cache[(1,)]
    assert out.device.type == "cuda" and torch.equal(out.cpu(), expected)
    plain = OutputCache(maxsize=2)
    plain[(1,)] = out
    assert plain[(1,)].device.type == "cuda"


@pytest.mark.parametrize("move_to_cpu", [False, True])
def test_entries_are_private_copies(move_to_cpu):
    cache = OutputCache(maxsize=2, move_to_cpu=move_to_cpu)
    stored = tensor(1)
    cache[(1,)] = stored
    stored.fill_(7)  # the caller changes what it stored
    first = cache[(1,)]
    first.fill_(9)  # and what it read
    assert torch.equal(cache[(1,)], tensor(1))
    assert cache[(1,)].data_ptr() != cache[(1,)].data_ptr()


def test_store_rows_stores_each_row_under_its_key():
    cache = OutputCache(maxsize=4)
    rows = torch.arange(12.0).reshape(4, 3)
    cache.store_rows([(1,), (2,), (1,), (3,)], rows)  # a repeated key keeps its last row
    assert len(cache) == 3
    assert torch.equal(cache[(1,)], rows[2]) and torch.equal(cache[(2,)], rows[1])
    assert torch.equal(cache[(3,)], rows[3])
    rows.fill_(-1)  # the caller changes what it stored
    assert torch.equal(cache[(3,)], torch.tensor([9.0, 10.0, 11.0]))


def test_store_rows_keeps_the_last_rows_when_they_exceed_maxsize():
    cache = OutputCache(maxsize=2)
    cache[(0,)] = tensor(0)
    cache.store_rows([(i,) for i in range(1, 6)], torch.stack([tensor(i) for i in range(1, 6)]))
    assert [k for k in [(i,) for i in range(6)] if k in cache] == [(4,), (5,)]
    assert torch.equal(cache[(4,)], tensor(4))


def test_stored_rows_reuse_the_memory_of_evicted_ones():
    # Entries of one shape share one tensor; evicted entries' slots are reused, so the
    # memory held stays within `maxsize` rows per shape however many batches are stored.
    cache = OutputCache(maxsize=8)
    for step in range(50):
        batch = torch.stack([tensor(step * 10 + i) for i in range(3)])
        cache.store_rows([(step, i) for i in range(3)], batch)
        assert len(cache) <= 8
    assert [key for key in cache._entries] == [
        (47, 1),
        (47, 2),
        *((s, i) for s in (48, 49) for i in range(3)),
    ]
    for step, i in list(cache._entries):
        assert torch.equal(cache[(step, i)], tensor(step * 10 + i))
    cache[(7,)] = torch.zeros(5)  # another shape has its own rows
    assert torch.equal(cache[(7,)], torch.zeros(5)) and len(cache) == 8

    def memory() -> dict:
        return {key: (p.rows.data_ptr(), p.rows.shape[0]) for key, p in cache._pools.items()}

    held = memory()
    assert len(held) == 2 and all(rows <= 8 for _, rows in held.values())
    cache.clear()
    assert len(cache) == 0 and (49, 2) not in cache
    cache.store_rows([(1,), (2,)], torch.stack([tensor(1), tensor(2)]))  # into the kept memory
    assert memory() == held
    assert torch.equal(cache[(2,)], tensor(2)) and len(cache) == 2


def test_readers_in_other_threads_never_see_a_reused_slot():
    # A reader copying an entry while a writer in another thread evicts it and reuses its
    # slot would get the new entry's values. Rows are large so that copies take a while.
    cache = OutputCache(maxsize=4)
    width, batches = 1 << 20, 150
    done = threading.Event()
    wrong = []

    def write():
        for batch in range(batches):
            keys = [(batch, i) for i in range(2)]
            cache.store_rows(keys, torch.full((2, width), float(batch)))
        done.set()

    def read():
        while not done.is_set():
            for key in list(cache._entries):
                value = cache.get(key)
                if value is not None and not bool((value == float(key[0])).all()):
                    wrong.append(key)

    threads = [threading.Thread(target=write), threading.Thread(target=read)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def torch_threads(request):
    """Runs the test with torch set to 1 or 2 threads (the cache's CPU copy depends on it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_stored_rows_keep_their_dtype_and_values(dtype, torch_threads):
    # With one torch thread float rows are copied through numpy on the CPU, else (and
    # bfloat16 ones, which numpy lacks) by torch; a row that requires grad is stored
    # too. 13 floats a row: runs of rows that are not a multiple of 64 bytes.
    cache = OutputCache(maxsize=6)
    values = torch.randn(4, 13, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = values.clone()
    cache.store_rows([(i,) for i in range(4)], values.requires_grad_(dtype != torch.float16))
    cache.store_rows([(9,), (8,)], expected[[3, 1]] * 2)  # two more rows, in slots 4 and 5
    with torch.no_grad():
        values.zero_()
    for i in range(4):
        assert cache[(i,)].dtype == dtype and torch.equal(cache[(i,)], expected[i])
    assert torch.equal(cache[(9,)], expected[3] * 2) and torch.equal(cache[(8,)], expected[1] * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_separate_rows_keep_their_dtype_and_values(dtype):
    # Rows given as a list are copied on the CPU through numpy (float dtypes) or by torch
    # (bfloat16); columns of a matrix (strided rows) and rows that require grad too.
    cache = OutputCache(maxsize=8)
    matrix = torch.randn(13, 5, generator=torch.Generator().manual_seed(2)).to(dtype)
    rows = [matrix[:, 3], matrix[:, 0].clone().requires_grad_(dtype != torch.float16)]
    rows += [matrix[:, 4], torch.full((13,), 7.0, dtype=dtype)]
    expected = [row.detach().clone() for row in rows]
    cache.store_rows([(i,) for i in range(4)], rows)
    with torch.no_grad():
        matrix.zero_()
        rows[1].zero_()
    for i in range(4):
        assert cache[(i,)].dtype == dtype and torch.equal(cache[(i,)], expected[i])
    assert not cache[(1,)].requires_grad  # a copy, outside the caller's graph
    rows, missing = cache.get_rows([(3,), (0,), (9,), (2,)])  # gathered, numpy's way for floats
    assert missing == [2] and rows.dtype == dtype
    for position, i in ((0, 3), (1, 0), (3, 2)):
        assert torch.equal(rows[position], expected[i])


def test_store_rows_takes_separate_rows_from_several_tensors():
    # Rows given as a list (e.g. views of two engine steps' results) are stored as private
    # copies. The 10 slots freed below are not adjacent, so the 10 rows land in 10 runs
    # (the one-`index_copy_` path); the 4 after them replace the oldest entries (4 runs).
    cache = OutputCache(maxsize=20)
    cache.store_rows([(i,) for i in range(20)], torch.zeros(20, 3))
    cache.remove_if(lambda key: key[0] % 2 == 0)
    first, second = torch.arange(15.0).reshape(5, 3), torch.arange(15.0, 30.0).reshape(5, 3)
    rows = [first[4], second[0], first[0], second[3], first[2], second[1], first[1]]
    rows += [second[4], first[3], second[2]]
    keys = [("r", i) for i in range(10)]
    cache.store_rows(keys, rows)
    expected = [row.clone() for row in rows]
    first.fill_(-1)
    second.fill_(-1)
    for key, row in zip(keys, expected, strict=True):
        assert torch.equal(cache[key], row)
    assert all(torch.equal(cache[(i,)], torch.zeros(3)) for i in range(1, 20, 2))
    tail = [torch.full((3,), float(i)) for i in range(4)]
    cache.store_rows([("t", i) for i in range(4)], tail)
    assert [torch.equal(cache[("t", i)], tail[i]) for i in range(4)] == [True] * 4
    assert len(cache) == 20


@pytest.mark.parametrize(
    "pick",
    [
        [5, 0, 6, 1, 7, 2, 8, 3, 9, 4],  # all rows, interleaved (resampled particles)
        [3, 7, 5, 4, 6],  # a middle block, shuffled
        [9, 8, 7, 6, 5, 4, 3, 2, 1, 0],
        [0, 2, 3, 4, 5],  # a gap: not one block
        [4, 4, 5],  # a row twice
    ],
)
def test_rows_of_one_tensor_in_any_order_are_stored_under_their_own_keys(pick):
    # A step's rows reach the cache one view each, in the step's order or not; the first
    # 16 slots are taken, so a batch of 10 wraps around the ring of 20 slots.
    cache = OutputCache(maxsize=20)
    cache.store_rows([("old", i) for i in range(16)], torch.zeros(16, 6))
    step = torch.randn(10, 6, generator=torch.Generator().manual_seed(3))
    expected = step.clone()
    keys = [("new", position) for position in range(len(pick))]
    cache.store_rows(keys, [step[i] for i in pick])
    step.fill_(-1)  # the caller's rows: the cache's are its own
    for key, i in zip(keys, pick, strict=True):
        assert torch.equal(cache[key], expected[i])
    assert list(cache._entries)[-len(pick) :] == keys  # stored last, in the keys' order
    assert all(
        torch.equal(cache[("old", i)], torch.zeros(6)) for i in range(max(len(pick) - 4, 0), 16)
    )


def test_a_view_past_its_base_tensors_rows_is_stored_as_it_is():
    base = torch.arange(30.0)
    base.resize_(4, 3)  # its memory still holds 30 floats: a view may reach past its 4 rows
    rows = [base[3], base.as_strided((3,), (1,), 12)]
    expected = [row.clone() for row in rows]
    cache = OutputCache(maxsize=4)
    cache.store_rows([("a",), ("b",)], rows)
    assert torch.equal(cache[("a",)], expected[0]) and torch.equal(cache[("b",)], expected[1])


@pytest.mark.parametrize("as_rows", [False, True])
def test_random_operations_agree_with_a_plain_lru_map(as_rows):
    # Batches of varying sizes, reads, overwrites, removals and clears, against an
    # OrderedDict of private copies with the documented LRU rules; batches are given
    # as one tensor or as a list of rows.
    generator = torch.Generator().manual_seed(0)

    def randint(high):
        return int(torch.randint(high, (), generator=generator))

    cache, reference, maxsize = OutputCache(maxsize=12), OrderedDict(), 12
    for step in range(400):
        action = randint(10)
        if action < 6:  # a batch, some keys new, some stored before
            keys = list(dict.fromkeys((randint(40),) for _ in range(1 + randint(7))))
            rows = torch.randn(len(keys), 5, generator=generator)
            cache.store_rows(keys, list(rows.unbind(0)) if as_rows else rows)
            for key, row in zip(keys, rows, strict=True):
                reference.pop(key, None)
                reference[key] = row.clone()
            while len(reference) > maxsize:
                reference.popitem(last=False)
        elif action < 9:  # a read refreshes the entry
            key = (randint(40),)
            value = cache.get(key)
            assert (value is None) == (key not in reference)
            if value is not None:
                assert torch.equal(value, reference[key])
                reference.move_to_end(key)
        elif step % 3:
            odd = cache.remove_if(lambda key: key[0] % 2 == 1)
            assert odd == sum(key[0] % 2 for key in reference)
            reference = OrderedDict((k, v) for k, v in reference.items() if k[0] % 2 == 0)
        else:
            cache.clear()
            reference.clear()
        assert list(cache._entries) == list(reference)
    for key, row in reference.items():
        assert torch.equal(cache[key], row)


def test_batches_evicted_in_order_are_stored_in_consecutive_slots():
    # A sampler's steps (no reads, sizes varying with resampling): each batch takes the
    # slots the oldest entries left, in one run (two where the ring of slots wraps).
    cache = OutputCache(maxsize=64)
    sizes = [32, 20, 27, 32, 9, 31, 25, 32, 18, 30] * 3
    for step, size in enumerate(sizes):
        cache.store_rows([(step, i) for i in range(size)], torch.zeros(size, 4))
        (pool,) = cache._pools.values()
        slots = [cache._entries[(step, i)][1] for i in range(size)]
        capacity = pool.rows.shape[0]
        start = next((s for s in slots if (s - 1) % capacity not in slots), slots[0])
        interval = {(start + k) % capacity for k in range(size)}
        assert set(slots) == interval, (step, slots)


@pytest.mark.parametrize("move_to_cpu", [False, True])
def test_get_rows_from_several_pools_in_random_order_returns_the_stored_rows(move_to_cpu):
    # Rows of two dtypes (and devices, where CUDA is there) live in separate pools, in
    # slots scrambled by evictions and reads; any selection of keys, some missing, in any
    # order, reads back the rows stored (cast to the first found row's dtype, as a copy
    # would), each key's at its own position, whatever runs the read is copied in.
    generator = torch.Generator().manual_seed(0)
    kinds = [("cpu", torch.float32), ("cpu", torch.float64)]
    if torch.cuda.is_available():
        kinds.append(("cuda", torch.float32))
    cache, stored = OutputCache(maxsize=48, move_to_cpu=move_to_cpu), {}
    for batch in range(40):
        device, dtype = kinds[batch % len(kinds)]
        size = 1 + int(torch.randint(8, (), generator=generator))
        keys = [(batch, i) for i in range(size)]
        rows = torch.randn(size, 6, generator=generator).to(device, dtype)
        cache.store_rows(keys, rows)
        stored.update((key, row.clone()) for key, row in zip(keys, rows, strict=True))
        cache.get(keys[0])  # reads refresh some entries: evictions free scattered slots
    present = [key for key in stored if key in cache]
    # move_to_cpu keeps CUDA rows in the CPU pool of their dtype
    pools = {("cpu" if move_to_cpu else device, dtype) for device, dtype in kinds}
    assert len({id(pool) for pool, _, _ in cache._entries.values()}) == len(pools)
    for _ in range(60):
        count = 1 + int(torch.randint(20, (), generator=generator))
        picks = torch.randint(len(present) + 10, (count,), generator=generator).tolist()
        keys = [present[p] if p < len(present) else ("absent", p) for p in picks]
        rows, missing = cache.get_rows(keys)
        assert missing == [i for i, key in enumerate(keys) if key not in cache]
        first = next(key for key in keys if key in cache)
        assert rows.device == stored[first].device and rows.dtype == stored[first].dtype
        for i, key in enumerate(keys):
            if i not in missing:
                assert torch.equal(rows[i].cpu(), stored[key].to(rows.dtype).cpu()), key
