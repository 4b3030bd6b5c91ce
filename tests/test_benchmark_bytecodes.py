"""The host work the per-step rows count (`workload.BytecodeCounter`): the Python bytecodes of
this package (and of vLLM) that run while the counter is on, in the entering thread, in threads
started meanwhile, and in an engine thread running already, reached through its loop's `call`;
and the garbage collector's time (`workload.CollectorTimer`)."""

import gc
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from benchmarks.workload import BytecodeCounter, CollectorTimer
from genlm.backend.llm.base import check_token_ids


def outside_the_package(n: int) -> int:
    """Code of this test file: not counted."""
    return sum(i * i for i in range(n))


def test_counts_this_packages_bytecodes_and_nothing_else():
    with BytecodeCounter() as counter:
        outside_the_package(1000)
    assert counter.read() == (0, 0)
    with BytecodeCounter() as counter:
        check_token_ids([1, 2, 3], 10)
    once = counter.read()[0]
    assert once > 0 and counter.read()[1] == 0
    with BytecodeCounter() as counter:
        for _ in range(5):
            check_token_ids([1, 2, 3], 10)
    assert counter.read()[0] == 5 * once  # the same calls, the same count


def test_counts_threads_started_meanwhile():
    with BytecodeCounter() as counter:
        thread = threading.Thread(target=check_token_ids, args=([1, 2, 3], 10))
        thread.start()
        thread.join()
    assert counter.read()[0] > 0


def test_counts_an_engine_thread_running_already_through_its_loop():
    with ThreadPoolExecutor(max_workers=1) as engine_thread:
        engine_thread.submit(lambda: None).result()  # the thread runs before the counter
        with BytecodeCounter() as counter:  # no loop given: that thread is not traced
            engine_thread.submit(check_token_ids, [1, 2, 3], 10).result()
        assert counter.read() == (0, 0)
        lm = SimpleNamespace(_engine=SimpleNamespace(call=engine_thread.submit))
        with BytecodeCounter(lm) as counter:
            engine_thread.submit(check_token_ids, [1, 2, 3], 10).result()
        assert counter.read()[0] > 0
        with BytecodeCounter(lm) as counter:
            pass
        engine_thread.submit(check_token_ids, [1, 2, 3], 10).result()  # after: untraced
        assert counter.read() == (0, 0)


def test_the_collector_timer_counts_collections_while_entered_only():
    def cycles(count: int) -> None:
        for _ in range(count):
            node: list = []
            node.append(node)

    with CollectorTimer() as timer:
        cycles(100_000)
        gc.collect()
    entered = timer.seconds
    assert entered > 0
    cycles(100_000)
    gc.collect()
    assert timer.seconds == entered and timer._callback not in gc.callbacks
