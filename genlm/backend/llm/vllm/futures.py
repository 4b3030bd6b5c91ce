"""Futures answered from the engine thread: chaining, starting and answering them when another
thread may have answered or cancelled them already."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any


def then(first: Future, step: Callable[[Any], Any]) -> Future:
    """A future of `step(first's result)`: its value, or that of the future it returns.

    `step` runs in the thread that answers `first` (the engine thread), so it
    may post more work to the engine. Errors of `first`, of `step` and of a
    future it returns reach the returned future; cancelling that one cancels
    the future it waits on.

    Args:
        first: A future, e.g. of `EngineLoop.run`.
        step: Called with `first`'s result.

    Returns:
        A `concurrent.futures.Future`.
    """
    result: Future = Future()
    # The future `result` waits on, while it waits: `result` is answered through its callbacks,
    # so it must not keep it. (A `concurrent.futures.Future` keeps its callbacks once answered:
    # a reference back would make a cycle that holds the rows until the garbage collector runs.)
    waited = [first]

    def cancel_waited(done: Future) -> None:
        if done.cancelled() and waited:
            waited[-1].cancel()
        waited.clear()

    def relay(done: Future) -> None:
        if done.cancelled():
            result.cancel()
        elif done.exception() is not None:
            answer_future(result, error=done.exception())
        else:
            answer_future(result, done.result())

    def proceed(done: Future) -> None:
        if done.cancelled() or done.exception() is not None:
            relay(done)
            return
        try:
            following = step(done.result())
        except BaseException as exc:  # the caller gets it
            answer_future(result, error=exc)
            return
        if not isinstance(following, Future):
            answer_future(result, following)
            return
        waited[:] = [following]
        following.add_done_callback(relay)
        if result.cancelled():  # meanwhile, perhaps before `waited` named `following`
            following.cancel()
            waited.clear()

    result.add_done_callback(cancel_waited)
    first.add_done_callback(proceed)
    return result


def start_future(future: Future) -> bool:
    """Mark `future` running; `False` if it was cancelled or already answered (engine death)."""
    if future.done():
        return False
    try:
        return future.set_running_or_notify_cancel()
    except RuntimeError:  # answered by the engine's death meanwhile
        return False


def answer_future(future: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Answer `future` unless it was answered or cancelled already (by another thread)."""
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except InvalidStateError:
        pass
