"""The output cache's row pools: memory taken ahead on the CPU, and the pages of the next rows
faulted in before rows are stored there."""

import ctypes
import mmap
import sys
import time

import pytest
import torch

from genlm.backend.cache import OutputCache
from genlm.backend.row_pool import _prefaulter

PAGE = mmap.PAGESIZE


def resident_pages(address: int, nbytes: int) -> list[bool]:
    """Whether each page of `nbytes` from page-aligned `address` is in memory (`mincore`)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    vector = ctypes.create_string_buffer(-(-nbytes // PAGE))
    assert libc.mincore(address, nbytes, vector) == 0, ctypes.get_errno()
    return [bool(byte & 1) for byte in vector.raw]


@pytest.mark.skipif(sys.platform != "linux", reason="pages are faulted in ahead on Linux only")
def test_the_prefaulter_brings_in_the_pages_asked_for_and_leaves_their_contents_alone():
    # Fresh anonymous memory: no page is in memory before it is written or asked for.
    region = mmap.mmap(-1, 64 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory = torch.frombuffer(region, dtype=torch.uint8)
    address = memory.data_ptr()
    assert not any(resident_pages(address, 64 * PAGE))
    memory[16 * PAGE : 16 * PAGE + 10] = 7  # a page written before its range is asked for
    _prefaulter.ask(memory, 16 * PAGE + 100, 16 * PAGE)  # from inside page 16 to inside page 32
    deadline = time.monotonic() + 10
    while not all(resident_pages(address + 16 * PAGE, 17 * PAGE)) and time.monotonic() < deadline:
        time.sleep(0.01)
    resident = resident_pages(address, 64 * PAGE)
    assert resident[16:33] == [True] * 17
    assert not any(resident[:16]) and not any(resident[33:])
    assert memory[16 * PAGE : 16 * PAGE + 10].tolist() == [7] * 10
    assert not memory[16 * PAGE + 10 : 33 * PAGE].any()
    del memory


def test_a_pool_asks_for_the_next_batches_rows_ahead_of_its_stores(monkeypatch):
    asked = []
    monkeypatch.setattr(_prefaulter, "ask", lambda rows, at, nbytes: asked.append((at, nbytes)))
    cache = OutputCache(maxsize=64)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randn(4, 8, generator=generator) for _ in range(20)]
    row_bytes = 8 * 4
    for step, batch in enumerate(batches):
        cache.store_rows([(step, i) for i in range(4)], batch)
        end = min(4 * (step + 1), 64)  # the rows stored so far, in order from the first slot
        asked_to = max((at + nbytes) // row_bytes for at, nbytes in asked)
        assert asked_to >= min(end + 8, 64), (step, asked)  # two more batches at least
        assert asked_to <= end + 16  # four at most
    spans = sorted((at // row_bytes, (at + nbytes) // row_bytes) for at, nbytes in asked)
    assert spans[0][0] == 4 and spans[-1][1] == 64
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))  # each row once
    for step, batch in enumerate(batches[-16:], 4):
        for i in range(4):
            assert torch.equal(cache[(step, i)], batch[i])


def test_a_cpu_pool_holds_the_cache_bound_from_its_first_store_and_never_copies_to_grow():
    cache = OutputCache(maxsize=1000, max_bytes=40 * 4 * 8)  # 40 rows of 8 floats
    cache.store_rows([(0,)], torch.zeros(1, 8))
    (pool,) = cache._pools.values()
    rows = pool.rows
    for step in range(1, 100):
        cache.store_rows([(step, i) for i in range(3)], torch.full((3, 8), float(step)))
    assert pool.rows is rows and rows.shape[0] == 40 and len(cache) == 40
    for step, i in list(cache._entries):
        assert torch.equal(cache[(step, i)], torch.full((8,), float(step)))


def test_a_cpu_pool_of_small_rows_without_a_bound_takes_a_bounded_number_of_slots():
    cache = OutputCache(maxsize=sys.maxsize)  # no bound in bytes: 4-byte rows
    cache.store_rows([(0,), (1,)], torch.zeros(2, 1))
    (pool,) = cache._pools.values()
    assert 2 <= pool.rows.shape[0] <= 1 << 16 and len(pool.free) == pool.rows.shape[0] - 2
