"""The auto-batcher shared by every backend and the async trie.

Callers `await batcher.submit(request)` one request at a time; the batcher
queues requests and evaluates them together, in one call of the evaluator,
when `batch_size` distinct requests are waiting or `timeout` seconds after the
oldest waiting one arrived, whichever comes first.

Guarantees:

- Requests with the same key (see `key`) are evaluated once per batch, and a
  request whose key is already being evaluated joins that evaluation.
- An exception raised by the evaluator reaches exactly the callers of that
  batch; later batches run normally.
- A caller that cancels its await is skipped; a request whose callers have
  all cancelled is not evaluated.
- `reset()` cancels every waiting caller, so nobody hangs.
- A batcher created outside an event loop, or used by successive
  `asyncio.run` calls, binds itself to the loop that is running when used.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

RequestT = TypeVar("RequestT")
ResultT = TypeVar("ResultT")

Evaluator = Callable[[list[RequestT]], Sequence[ResultT] | Awaitable[Sequence[ResultT]]]


@dataclass
class _Entry(Generic[RequestT]):
    request: RequestT
    futures: list[asyncio.Future] = field(default_factory=list)

    def live_futures(self) -> list[asyncio.Future]:
        return [f for f in self.futures if not f.done()]


class AutoBatcher(Generic[RequestT, ResultT]):
    """Collects concurrent requests and evaluates them in batches.

    Args:
        evaluate: Called with a list of distinct requests; returns one result
            per request, in order. May be a plain function (run inline in the
            event loop, and also usable through `flush()`) or a coroutine
            function (batches then run one at a time, as tasks).
        batch_size: Number of distinct waiting requests that triggers a batch.
        timeout: Seconds after the oldest waiting request that trigger a batch.
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
        self._pending: dict[Hashable, _Entry] = {}
        self._in_flight: dict[Hashable, _Entry] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._lock: asyncio.Lock | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def batch_size(self) -> int:
        """Number of distinct waiting requests that triggers a batch (at least 1)."""
        return self._batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        if value < 1:
            raise ValueError(f"batch_size must be at least 1, got {value}")
        self._batch_size = value

    @property
    def timeout(self) -> float:
        """Seconds after the oldest waiting request that trigger a batch (non-negative)."""
        return self._timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        if value < 0:
            raise ValueError(f"timeout must be non-negative, got {value}")
        self._timeout = value

    @property
    def pending(self) -> list[RequestT]:
        """The distinct requests waiting for a batch, oldest first."""
        return [entry.request for entry in self._pending.values()]

    async def submit(self, request: RequestT) -> ResultT:
        """Queue `request` and wait for its result.

        Args:
            request: The request to evaluate.

        Returns:
            The evaluator's result for `request`.

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
            future: A future of the running event loop.
        """
        self._bind(future.get_loop())
        key = self._key(request) if self._key is not None else next(self._counter)
        entry = self._in_flight.get(key) or self._pending.get(key)
        if entry is None:
            entry = self._pending[key] = _Entry(request)
        entry.futures.append(future)
        if len(self._pending) >= self.batch_size:
            self._trigger()
        elif self._pending and self._timer is None:
            self._timer = self._loop.call_later(self.timeout, self._trigger)

    def flush(self) -> None:
        """Evaluate everything waiting now, synchronously (plain evaluators only).

        Does nothing when no request is waiting.

        Raises:
            TypeError: If the evaluator is a coroutine function.
        """
        if self._is_async:
            raise TypeError("flush() needs a synchronous evaluator; this one is async")
        self._cancel_timer()
        while self._pending:
            keys, entries = self._take_batch()
            if entries:
                self._evaluate_sync(keys, entries)

    def reset(self) -> None:
        """Cancel every waiting and in-flight caller; queued requests are dropped."""
        self._cancel_timer()
        for entry in [*self._pending.values(), *self._in_flight.values()]:
            for future in entry.futures:
                if not future.done() and not future.get_loop().is_closed():
                    future.cancel()
        self._pending.clear()
        self._in_flight.clear()

    async def aclose(self) -> None:
        """Cancel waiting callers and wait for running batches to finish."""
        self.reset()
        tasks = [t for t in self._tasks if t.get_loop() is asyncio.get_running_loop()]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is loop:
            return
        # A new event loop (e.g. a later asyncio.run): state of the old one is unusable.
        self.reset()
        self._tasks.clear()
        self._loop = loop
        self._lock = asyncio.Lock()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _trigger(self) -> None:
        self._timer = None
        if not self._is_async:
            self.flush()
            return
        task = self._loop.create_task(self._run_async_batch())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _take_batch(self) -> tuple[list[Hashable], list[_Entry]]:
        keys, entries = [], []
        while self._pending and len(entries) < self.batch_size:
            key, entry = next(iter(self._pending.items()))
            del self._pending[key]
            if entry.live_futures():
                keys.append(key)
                entries.append(entry)
        return keys, entries

    async def _run_async_batch(self) -> None:
        self._cancel_timer()
        async with self._lock:
            keys, entries = self._take_batch()
            if self._pending:
                if len(self._pending) >= self.batch_size:
                    self._trigger()
                elif self._timer is None:
                    self._timer = self._loop.call_later(self.timeout, self._trigger)
            if not entries:
                return
            for key, entry in zip(keys, entries, strict=True):
                self._in_flight[key] = entry
            try:
                results = await self.evaluate([e.request for e in entries])
                error = None
            except Exception as exc:  # delivered to the batch's callers
                results, error = None, exc
            finally:
                for key in keys:
                    self._in_flight.pop(key, None)
            self._resolve(entries, results, error)

    def _evaluate_sync(self, keys: list[Hashable], entries: list[_Entry]) -> None:
        for key, entry in zip(keys, entries, strict=True):
            self._in_flight[key] = entry
        try:
            results, error = self.evaluate([e.request for e in entries]), None
        except Exception as exc:  # delivered to the batch's callers
            results, error = None, exc
        finally:
            for key in keys:
                self._in_flight.pop(key, None)
        self._resolve(entries, results, error)

    @staticmethod
    def _resolve(entries: list[_Entry], results: Any, error: BaseException | None) -> None:
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
        for i, entry in enumerate(entries):
            for future in entry.live_futures():
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(results[i])
