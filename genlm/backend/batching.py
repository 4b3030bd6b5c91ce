"""Batching: the auto-batcher every backend and the async trie use, and the shared window.

`AutoBatcher` batches one component's requests (a backend's queries, a trie's
weight sums). `join_batch` is the window any code can join without owning a
batcher: the draws of `genlm.backend.draw` meet there, and `take_batch_stats`
says how its groups formed.

The auto-batcher:

Callers `await batcher.submit(request)` one request at a time; the batcher
queues requests and evaluates them together, in one call of the evaluator.
A batch runs at the first of:

- a whole pass of the event loop over its ready callbacks brought no new
  request: every task that was ready has run, so all awaits of one
  `asyncio.gather` are in (no setting to tune: a sampler's step of N
  particles is one batch of N);
- `batch_size` distinct requests are waiting, checked after each pass
  (requests that keep arriving pass after pass, e.g. from a stream, do not
  wait for a quiet loop);
- `timeout` seconds have passed since the oldest waiting request arrived.

A batch takes every request waiting when it runs, so its size may exceed
`batch_size` when many arrive within one pass. A caller that waits on a
thread or a timer before its request arrives later and joins a later batch.

Guarantees:

- Requests with the same key (see `key`) are evaluated once per batch, and a
  request whose key is already being evaluated joins that evaluation. Each
  caller gets its own result: callers beyond the first of a shared request get
  a copy (`clone()` or `copy()` of the result, when it has one).
- An exception raised by the evaluator reaches exactly the callers of that
  batch; later batches run normally. An evaluator may also return an
  exception in place of one request's result: only that request's callers
  receive it.
- A caller that cancels its await is skipped; a request whose callers have
  all cancelled is not evaluated.
- `reset()` cancels every waiting caller, so nobody hangs. A batch whose
  task is cancelled before its evaluator returns (e.g. by code that cancels
  every task of the loop) fails its callers with `BatchAbandoned`.
- Requests are queued per event loop: a batcher created outside an event
  loop, used by successive `asyncio.run` calls, or used at the same time from
  several threads that each run their own loop, batches each loop's requests
  separately and delivers every result in the caller's own loop.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import sys
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

RequestT = TypeVar("RequestT")
ResultT = TypeVar("ResultT")

Evaluator = Callable[[list[RequestT]], Sequence[ResultT] | Awaitable[Sequence[ResultT]]]


class BatchAbandoned(RuntimeError):
    """The batch that was computing a request stopped before it had a result.

    Raised to a request's callers when the task evaluating its batch was
    cancelled from outside (the callers themselves were not).
    """


@dataclass
class _Entry(Generic[RequestT]):
    request: RequestT
    futures: list[asyncio.Future] = field(default_factory=list)

    def has_caller(self) -> bool:
        """Whether a caller still waits for the result."""
        for future in self.futures:
            if not future.done():
                return True
        return False


class _LoopQueue:
    """The requests of one event loop: waiting, being evaluated, and its batch timer."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.pending: dict[Hashable, _Entry] = {}
        self.in_flight: dict[Hashable, _Entry] = {}
        self.timer: asyncio.TimerHandle | None = None
        self.check: asyncio.Handle | None = None  # the next end-of-iteration check
        self.arrivals = 0  # distinct requests queued so far
        self.lock = asyncio.Lock()
        self.tasks: set[asyncio.Task] = set()

    def cancel_timer(self) -> None:
        for handle in (self.timer, self.check):
            if handle is not None:
                handle.cancel()
        self.timer = self.check = None


class AutoBatcher(Generic[RequestT, ResultT]):
    """Collects concurrent requests and evaluates them in batches.

    Args:
        evaluate: Called with a list of distinct requests; returns one result
            per request, in order. May be a plain function (run inline in the
            event loop, and also usable through `flush()`) or a coroutine
            function (batches then run one at a time per event loop, as tasks).
        batch_size: Number of distinct waiting requests that starts a batch
            without waiting for the event loop to go quiet.
        timeout: Seconds after the oldest waiting request that start a batch
            at the latest.
        key: Maps a request to a hashable key; requests with equal keys are
            evaluated once. `None` treats every request as distinct.
    """

    def __init__(
        self,
        evaluate: Evaluator,
        batch_size: int = 20,
        timeout: float = 0.02,
        key: Callable[[RequestT], Hashable] | None = None,
    ):
        self.evaluate = evaluate
        self.batch_size = batch_size
        self.timeout = timeout
        self._key = key
        # A callable object counts as async when its __call__ is a coroutine function.
        self._is_async = inspect.iscoroutinefunction(evaluate) or inspect.iscoroutinefunction(
            type(evaluate).__call__
        )
        self._counter = itertools.count()
        self._queues: dict[asyncio.AbstractEventLoop, _LoopQueue] = {}
        self._queues_lock = threading.Lock()

    @property
    def batch_size(self) -> int:
        """Number of distinct waiting requests that starts a batch at once (at least 1)."""
        return self._batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        if value < 1:
            raise ValueError(f"batch_size must be at least 1, got {value}")
        self._batch_size = value

    @property
    def timeout(self) -> float:
        """Seconds after the oldest waiting request that start a batch at the latest (>= 0)."""
        return self._timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        if value < 0:
            raise ValueError(f"timeout must be non-negative, got {value}")
        self._timeout = value

    @property
    def pending(self) -> list[RequestT]:
        """The distinct requests waiting for a batch, oldest first (per event loop)."""
        return [entry.request for q in self._live_queues() for entry in q.pending.values()]

    async def submit(self, request: RequestT) -> ResultT:
        """Queue `request` and wait for its result.

        Args:
            request: The request to evaluate.

        Returns:
            The evaluator's result for `request` (the caller's own).

        Raises:
            Exception: Whatever the evaluator raised for this request's batch.
            asyncio.CancelledError: If `reset()` dropped the request.
        """
        future = asyncio.get_running_loop().create_future()
        self.add(request, future)
        return await future

    def add(self, request: RequestT, future: asyncio.Future) -> None:
        """Queue `request`; `future` receives its result when its batch has run.

        Args:
            request: The request to evaluate.
            future: A future of the event loop of the calling thread.
        """
        queue = self._queue(future.get_loop())
        key = self._key(request) if self._key is not None else next(self._counter)
        # A key is in flight or waiting, never both.
        entry = queue.in_flight.get(key) if queue.in_flight else None
        if entry is None:
            new = _Entry(request)
            entry = queue.pending.setdefault(key, new)
            if entry is new:
                queue.arrivals += 1
        entry.futures.append(future)
        if queue.pending:
            self._schedule(queue)

    def flush(self) -> None:
        """Evaluate everything waiting now, synchronously (plain evaluators only).

        Does nothing when no request is waiting. Results for callers of an
        event loop running in another thread are handed to that loop.

        Raises:
            TypeError: If the evaluator is a coroutine function.
        """
        if self._is_async:
            raise TypeError("flush() needs a synchronous evaluator; this one is async")
        for queue in self._live_queues():
            self._flush_queue(queue)

    def retain(self, keep: Callable[[RequestT], bool]) -> None:
        """Drop the waiting requests for which `keep` is false; their callers are cancelled.

        Args:
            keep: Called with each waiting request (not with those being evaluated).
        """
        for queue in self._live_queues():
            run = _runner(queue.loop)
            for key, entry in list(queue.pending.items()):
                if keep(entry.request):
                    continue
                del queue.pending[key]
                for future in entry.futures:
                    if run is not None:
                        run(future.cancel)
            if not queue.pending:
                queue.cancel_timer()

    def reset(self) -> None:
        """Cancel every waiting and in-flight caller; queued requests are dropped."""
        for queue in self._live_queues():
            queue.cancel_timer()
            run = _runner(queue.loop)
            for entry in [*queue.pending.values(), *queue.in_flight.values()]:
                for future in entry.futures:
                    if run is not None:
                        run(future.cancel)
            queue.pending.clear()
            queue.in_flight.clear()

    async def aclose(self) -> None:
        """Cancel waiting callers and wait for this loop's running batches to finish."""
        self.reset()
        queue = self._queues.get(asyncio.get_running_loop())
        if queue is not None and queue.tasks:
            await asyncio.gather(*queue.tasks, return_exceptions=True)

    def _queue(self, loop: asyncio.AbstractEventLoop) -> _LoopQueue:
        queue = self._queues.get(loop)
        if queue is None:
            with self._queues_lock:
                for closed in [other for other in self._queues if other.is_closed()]:
                    del self._queues[closed]  # what a finished `asyncio.run` left behind
                queue = self._queues[loop] = _LoopQueue(loop)
        return queue

    def _live_queues(self) -> list[_LoopQueue]:
        with self._queues_lock:
            return [q for loop, q in self._queues.items() if not loop.is_closed()]

    def _schedule(self, queue: _LoopQueue) -> None:
        """Make sure the waiting requests have an end-of-iteration check and a deadline."""
        if queue.check is None:
            queue.check = queue.loop.call_soon(self._check, queue, None)
        if queue.timer is None:
            queue.timer = queue.loop.call_later(self.timeout, self._trigger, queue)

    def _check(self, queue: _LoopQueue, arrivals_at_last_check: int | None) -> None:
        """Run the batch if it is full, or if no request arrived since the last check.

        Checks are callbacks at the end of the loop's ready queue: between two
        of them every callback and task that was ready has run once.
        """
        queue.check = None
        if len(queue.pending) >= self.batch_size or queue.arrivals == arrivals_at_last_check:
            self._trigger(queue)
        else:
            queue.check = queue.loop.call_soon(self._check, queue, queue.arrivals)

    def _trigger(self, queue: _LoopQueue) -> None:
        queue.cancel_timer()
        if not self._is_async:
            self._flush_queue(queue)
            return
        task = queue.loop.create_task(self._run_async_batch(queue))
        queue.tasks.add(task)
        task.add_done_callback(queue.tasks.discard)

    def _flush_queue(self, queue: _LoopQueue) -> None:
        queue.cancel_timer()
        batch = self._take_batch(queue)
        if batch:
            self._evaluate_sync(queue, batch)

    @staticmethod
    def _take_batch(queue: _LoopQueue) -> dict[Hashable, _Entry]:
        """Every waiting request that still has a caller, now in flight (the waiting ones'
        dict itself: its keys are not hashed again)."""
        batch, queue.pending = queue.pending, {}
        for key in [key for key, entry in batch.items() if not entry.has_caller()]:
            del batch[key]
        queue.in_flight = batch
        return batch

    async def _run_async_batch(self, queue: _LoopQueue) -> None:
        async with queue.lock:
            batch = self._take_batch(queue)
            if not batch:
                return
            entries = list(batch.values())
            try:
                results = await self.evaluate([e.request for e in entries])
                error = None
            except Exception as exc:  # delivered to the batch's callers
                results, error = None, exc
            except asyncio.CancelledError:
                abandoned = BatchAbandoned("the batch evaluating this request was cancelled")
                self._resolve(queue, entries, None, abandoned)
                raise
            finally:
                if queue.in_flight is batch:
                    queue.in_flight = {}
            self._resolve(queue, entries, results, error)

    def _evaluate_sync(self, queue: _LoopQueue, batch: dict[Hashable, _Entry]) -> None:
        entries = list(batch.values())
        try:
            results, error = self.evaluate([e.request for e in entries]), None
        except Exception as exc:  # delivered to the batch's callers
            results, error = None, exc
        finally:
            if queue.in_flight is batch:
                queue.in_flight = {}
        self._resolve(queue, entries, results, error)

    @staticmethod
    def _resolve(
        queue: _LoopQueue, entries: list[_Entry], results: Any, error: BaseException | None
    ) -> None:
        run = _runner(queue.loop)
        if run is None:  # the callers' loop is closed: nobody to deliver to
            return
        if error is None:
            # Anything indexable with a length works: a list, a batched tensor, an array.
            try:
                count = len(results)
            except TypeError:
                error = TypeError(f"batch evaluator returned {type(results).__name__}, no results")
            else:
                if count != len(entries):
                    error = RuntimeError(
                        f"batch evaluator returned {count} results for {len(entries)} requests"
                    )
        try:
            # Answered futures (cancelled callers) are skipped when their answer runs.
            for i, entry in enumerate(entries):
                for n, future in enumerate(entry.futures):
                    if error is not None:
                        run(_set_exception, future, error)
                    elif isinstance(results[i], BaseException):
                        run(_set_exception, future, results[i])
                    else:
                        result = results[i] if n == 0 else _own_copy(results[i])
                        run(_set_result, future, result)
        except Exception as exc:  # reading a result or copying it failed: no caller may hang
            for entry in entries:
                for future in entry.futures:
                    run(_set_exception, future, exc)  # those answered already stay answered


def _own_copy(result: Any) -> Any:
    """A copy of `result` for a further caller of the same request (tensors, arrays, lists)."""
    for method in ("clone", "copy"):
        copy = getattr(result, method, None)
        if callable(copy):
            return copy()
    return result


def _runner(loop: asyncio.AbstractEventLoop) -> Callable[..., Any] | None:
    """How this thread runs callbacks in `loop` (`run(callback, *args)`).

    At once when this thread runs `loop` or nobody does, handed over when
    another thread runs it, `None` when `loop` is closed.
    """
    if loop.is_closed():
        return None
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop or not loop.is_running():
        return _call
    return loop.call_soon_threadsafe


def _call(callback: Callable[..., Any], *args: Any) -> None:
    callback(*args)


def _set_result(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


GroupEvaluator = Callable[[list[Any]], Sequence[Any]]

_stats: Counter[tuple[str, int]] = Counter()
_stats_lock = threading.Lock()


def take_batch_stats() -> Counter[tuple[str, int]]:
    """How the window's groups formed since the last call, then forgotten.

    Returns:
        A `Counter` mapping `(kind, group size)` to the number of groups of
        that kind and size the window evaluated (every event loop, every
        thread); e.g. `{("draw", 32): 1}` after one SMC step of 32 draws.
    """
    global _stats
    with _stats_lock:
        taken, _stats = _stats, Counter()
    return taken


def _evaluate_window(items: list[tuple[str, Hashable, GroupEvaluator, Any]]) -> list[Any]:
    """One pass of the window: each group evaluated in one call, in order of first arrival."""
    groups: dict[tuple[str, Hashable, GroupEvaluator], list[int]] = {}
    for position, (kind, group, evaluate, _) in enumerate(items):
        groups.setdefault((kind, group, evaluate), []).append(position)
    results: list[Any] = [None] * len(items)
    for (kind, _, evaluate), positions in groups.items():
        with _stats_lock:
            _stats[kind, len(positions)] += 1
        try:
            outputs = evaluate([items[p][3] for p in positions])
            if len(outputs) != len(positions):
                raise RuntimeError(
                    f"{kind} group evaluator returned {len(outputs)} results "
                    f"for {len(positions)} items"
                )
        except Exception as exc:  # this group's callers get it; the other groups go on
            outputs = [exc] * len(positions)
        for position, output in zip(positions, outputs, strict=True):
            results[position] = output
    return results


# A batch waits for the loop's quiet pass only: no size cap splits a cohort. The deadline
# bounds the wait while asks keep arriving pass after pass.
_window: AutoBatcher = AutoBatcher(_evaluate_window, batch_size=sys.maxsize, timeout=0.02)


async def join_batch(kind: str, item: Any, evaluate: GroupEvaluator, group: Hashable = None) -> Any:
    """Evaluate `item` together with the like items other tasks of this loop ask for now.

    The asks of one event loop that arrive before a pass of the loop brings no
    new one form the window's batch (as `AutoBatcher` forms a backend's). In
    it, items of equal `(kind, group, evaluate)` are one group: `evaluate` is
    called once with the group's items, in order of arrival, and each caller
    gets its own item's result. Groups are evaluated in order of their first
    ask, so randomness drawn by evaluators is reproducible under a seed.

    Args:
        kind: What the group computes; `take_batch_stats` counts groups by it.
        item: This caller's part of the group's input.
        evaluate: Maps a list of items to one result per item, in order. An
            exception it raises reaches that group's callers only; a result
            that is an exception reaches only its own caller.
        group: Further splits items of one kind that cannot be evaluated
            together (e.g. arrays of different widths or devices).

    Returns:
        `evaluate`'s result for `item`.
    """
    return await _window.submit((kind, group, evaluate, item))
