"""The output cache's row pools: memory taken ahead on the CPU, and the pages of the next rows
faulted in before rows are stored there."""

import ctypes
import mmap
import sys
import time

import pytest
import torch

from genlm.backend.cache import OutputCache

ROW = 1 << 18  # floats: 1 MiB a row, so that a pool is mapped anew (not reused heap memory)


def resident_rows(rows: torch.Tensor, start: int, stop: int) -> list[bool]:
    """Whether every page of each of `rows[start:stop]` is in memory (Linux's `mincore`)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    row_bytes, page = rows[0].numel() * rows.element_size(), mmap.PAGESIZE
    found = []
    for row in range(start, stop):
        first = rows.data_ptr() + row * row_bytes
        aligned = first - first % page
        pages = -(-(first + row_bytes - aligned) // page)
        vector = ctypes.create_string_buffer(pages)
        assert libc.mincore(aligned, first + row_bytes - aligned, vector) == 0, ctypes.get_errno()
        found.append(all(byte & 1 for byte in vector.raw))
    return found


@pytest.mark.skipif(sys.platform != "linux", reason="pages are faulted in ahead on Linux only")
def test_the_next_rows_are_in_memory_before_they_are_stored_and_the_rest_is_not():
    cache = OutputCache(maxsize=64)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randn(4, ROW, generator=generator) for _ in range(3)]
    cache.store_rows([(0, i) for i in range(4)], batches[0])
    (pool,) = cache._pools.values()
    assert pool.rows.shape[0] == 64  # the cache's bound, taken at once
    deadline = time.monotonic() + 10
    while not all(resident_rows(pool.rows, 4, 12)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(resident_rows(pool.rows, 4, 12)), "the next two batches' rows were not faulted in"
    assert not any(resident_rows(pool.rows, 32, 64)), "rows far ahead took memory"
    for step, batch in enumerate(batches[1:], 1):
        cache.store_rows([(step, i) for i in range(4)], batch)
    for step, batch in enumerate(batches):
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
