"""`EngineLoop`'s scheduling on a stand-in engine: admission, failures, cancellation, closing.

The stand-in finishes a request after as many steps as its `params` says and
records which requests each step ran, which is what these tests check. Its
"worker processes", where a test needs them, are real processes that sleep.
The loop on a real vLLM engine is tested in `test_vllm.py` and, when the
engine dies, in `test_vllm_dead.py`.
"""

import gc
import multiprocessing
import os
import signal
import threading
import time
import weakref
from concurrent.futures import CancelledError, Future
from types import SimpleNamespace

import pytest

from genlm.backend.errors import EngineDeadError
from genlm.backend.llm.vllm.engine_loop import EngineLoop, EngineRequest
from genlm.backend.llm.vllm.futures import then

LIMIT = 10  # seconds any future may take


class StandInEngine:
    """Runs each request for `params` steps; `steps` lists the request ids of every step."""

    def __init__(self):
        self.remaining: dict[str, int] = {}
        self.adapters: dict[str, bool] = {}
        self.steps: list[list[str]] = []
        self.aborted: list[str] = []
        self.fail_next_step = False
        self.broken = False  # every step raises
        self.gate = threading.Event()  # steps wait for it
        self.gate.set()

    def add_request(self, request_id, prompt, params, lora_request=None):
        if params == "bad":
            raise ValueError("bad request")
        self.remaining[request_id] = params
        self.adapters[request_id] = lora_request is not None

    def step(self):
        self.gate.wait(LIMIT)
        if self.broken:
            raise RuntimeError("engine broken")
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("engine failure")
        running = list(self.remaining)
        kinds = {self.adapters[r] for r in running}
        assert len(kinds) <= 1, "base and adapter requests shared a step"
        self.steps.append(running)
        finished = []
        for request_id in running:
            self.remaining[request_id] -= 1
            if self.remaining[request_id] == 0:
                del self.remaining[request_id]
                finished.append(SimpleNamespace(request_id=request_id, finished=True))
        return finished

    def abort_request(self, request_ids):
        self.aborted.extend(request_ids)
        for request_id in request_ids:
            self.remaining.pop(request_id, None)


@pytest.fixture
def engine():
    return StandInEngine()


@pytest.fixture
def loop(engine):
    loop = EngineLoop(SimpleNamespace(llm_engine=engine), probe=request(1, prompt=(0,)))
    yield loop
    engine.gate.set()
    loop.close()


def request(steps, prompt=(1,), lora=None, check=None):
    return EngineRequest(tuple(prompt), steps, lora, check)


def request_ids(outputs):
    return [output.request_id for output in outputs]


def test_a_group_joins_a_running_engine_and_finishes_first(loop, engine):
    engine.gate.clear()
    long = loop.run([request(6)], request_ids)
    time.sleep(0.05)  # the loop is waiting inside the first step
    short = loop.run([request(1), request(2)], request_ids)
    engine.gate.set()
    long_ids, short_ids = long.result(LIMIT), short.result(LIMIT)
    assert engine.steps[0] == long_ids
    assert engine.steps[1] == long_ids + short_ids  # the next step runs both groups
    assert engine.steps[2] == long_ids + short_ids[1:]  # the short group is done after it
    assert engine.steps[3:] == [long_ids] * 3


def test_base_and_adapter_requests_never_share_a_step_and_neither_starves(loop, engine):
    engine.gate.clear()
    adapter = "an adapter"
    first = loop.run([request(3, lora=adapter)], request_ids)
    time.sleep(0.05)
    base = loop.run([request(1)], request_ids)
    later = loop.run([request(1, lora=adapter)], request_ids)  # arrived after `base`
    engine.gate.set()
    first_ids, base_ids, later_ids = (f.result(LIMIT) for f in (first, base, later))
    assert engine.steps == [first_ids] * 3 + [base_ids, later_ids]


def test_a_mixed_group_runs_one_kind_after_the_other(loop, engine):
    outputs = loop.run(
        [request(1), request(1, lora="a"), request(1), request(1, lora="b")], request_ids
    ).result(LIMIT)
    assert engine.steps == [[outputs[0], outputs[2]], [outputs[1], outputs[3]]]


def test_an_empty_group_is_answered_at_once(loop, engine):
    assert loop.run([], request_ids).result(LIMIT) == []
    assert engine.steps == []


def test_a_step_error_the_probe_survives_fails_only_the_running_groups(loop, engine):
    discarded = []
    engine.fail_next_step = True
    failed = loop.run([request(2), request(2)], request_ids, lambda: discarded.append(True))
    with pytest.raises(RuntimeError, match="engine failure"):
        failed.result(LIMIT)
    assert len(engine.aborted) == 2 and engine.remaining == {} and discarded == [True]
    assert len(engine.steps) == 1 and engine.steps[0][0].startswith("genlm-probe")
    assert len(loop.run([request(1)], request_ids).result(LIMIT)) == 1 and not loop.dead


def test_a_step_error_the_probe_meets_too_kills_the_engine_for_every_caller(loop, engine):
    discarded = []
    engine.gate.clear()
    running = loop.run([request(2), request(2)], request_ids, lambda: discarded.append(True))
    time.sleep(0.05)  # the loop is waiting inside the first step
    waiting = loop.run([request(1, lora="an adapter")], request_ids)  # not in the engine yet
    engine.broken = True
    engine.gate.set()
    reported = "RuntimeError('engine broken') from its step, then RuntimeError('engine broken')"
    for group in (running, waiting):
        with pytest.raises(EngineDeadError) as caught:
            group.result(LIMIT)
        message = str(caught.value)
        assert message.startswith("the vLLM engine died: vLLM reported ") and reported in message
        assert "cleanup()" in message and "load_model_by_name" in message
        assert repr(caught.value.__cause__) == "RuntimeError('engine broken')"
    assert loop.dead and not loop.closed
    loop._thread.join(LIMIT)  # nothing left to serve
    assert not loop._thread.is_alive()
    # Later uses fail at once and leave the dead engine alone.
    engine.broken = False
    with pytest.raises(EngineDeadError, match="engine broken"):
        loop.run([request(1)], request_ids)
    with pytest.raises(EngineDeadError, match="engine broken"):
        loop.call(len, [])
    with pytest.raises(EngineDeadError, match="engine broken"):
        loop.check_alive()
    assert discarded == [] and engine.steps == [] and len(engine.remaining) == 1  # the probe's
    loop.close()
    with pytest.raises(RuntimeError, match="closed"):
        loop.run([request(1)], request_ids)


def test_without_a_probe_any_step_error_kills_the_engine(engine):
    loop = EngineLoop(SimpleNamespace(llm_engine=engine))
    engine.fail_next_step = True
    with pytest.raises(EngineDeadError) as caught:
        loop.run([request(1)], request_ids).result(LIMIT)
    assert "vLLM reported RuntimeError('engine failure') from its step. " in str(caught.value)
    loop.close()


def test_a_refused_request_stays_out_and_the_rest_of_its_group_runs(loop, engine):
    refusal = ValueError("adapter gone")
    requests = [request(1), request(1, lora="gone", check=lambda: refusal), request(1)]
    outcomes = loop.run(requests, lambda outcomes: outcomes).result(LIMIT)
    assert outcomes[1] is refusal
    assert outcomes[0].finished and outcomes[2].finished
    assert engine.steps == [[outcomes[0].request_id, outcomes[2].request_id]]
    assert engine.adapters == {outcomes[0].request_id: False, outcomes[2].request_id: False}


def test_a_refused_request_fails_its_group_and_leaves_no_request_behind(loop, engine):
    group = loop.run([request(2), request("bad")], request_ids)
    with pytest.raises(ValueError, match="bad request"):
        group.result(LIMIT)
    assert engine.remaining == {} and len(engine.aborted) == 1
    assert loop.call(len, engine.steps).result(LIMIT) == 0


def test_an_error_in_finish_reaches_the_caller(loop):
    def finish(outputs):
        raise KeyError("no rows")

    with pytest.raises(KeyError, match="no rows"):
        loop.run([request(1)], finish).result(LIMIT)
    assert loop.call(sum, [1, 2]).result(LIMIT) == 3


def test_a_group_cancelled_before_it_reaches_the_engine_stays_out(loop, engine):
    engine.gate.clear()
    running = loop.run([request(1)], request_ids)
    time.sleep(0.05)
    cancelled = loop.run([request(1, prompt=(2,))], request_ids)
    assert cancelled.cancel()
    engine.gate.set()
    assert loop.call(lambda: list(engine.steps)).result(LIMIT) == [running.result(LIMIT)]
    with pytest.raises(CancelledError):
        cancelled.result(LIMIT)


def test_close_fails_unfinished_work_and_refuses_more(engine):
    loop = EngineLoop(SimpleNamespace(llm_engine=engine))
    engine.gate.clear()
    running = loop.run([request(100)], request_ids)
    time.sleep(0.05)
    closer = threading.Thread(target=loop.close)
    closer.start()
    engine.gate.set()
    closer.join(LIMIT)
    assert loop.closed
    with pytest.raises(RuntimeError, match="closed"):
        running.result(LIMIT)
    assert engine.remaining == {}
    with pytest.raises(RuntimeError, match="closed"):
        loop.run([request(1)], request_ids)
    with pytest.raises(RuntimeError, match="closed"):
        loop.call(len, [])


@pytest.fixture
def workers():
    """Two processes that sleep, standing in for an engine's worker processes."""
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=time.sleep, args=(LIMIT * 6,)) for _ in range(2)]
    for process in processes:
        process.start()
    yield processes
    for process in processes:
        process.kill()
        process.join(LIMIT)


def test_a_worker_exit_fails_every_caller_at_once_even_during_a_step(engine, workers):
    loop = EngineLoop(SimpleNamespace(llm_engine=engine), workers)
    assert loop.run([request(1)], request_ids).result(LIMIT)
    engine.gate.clear()  # the next step waits, as vLLM's would for a dead worker
    running = loop.run([request(3)], request_ids)
    time.sleep(0.05)
    killed = time.monotonic()
    os.kill(workers[1].pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError) as caught:
        running.result(LIMIT)
    assert time.monotonic() - killed < 5  # the step still waits
    assert f"(pid {workers[1].pid}) was killed by SIGKILL" in str(caught.value)
    assert caught.value.__cause__ is None  # nothing was raised: the watcher saw the exit
    with pytest.raises(EngineDeadError, match="SIGKILL"):
        loop.call(len, [])
    engine.gate.set()  # the step ends (in vLLM, when it shuts its executor down)
    loop.close()
    assert not workers[0].is_alive()  # the survivor could not have finished a step: killed
    assert not loop._thread.is_alive() and not loop._watcher.is_alive()


def test_closing_a_live_loop_stops_its_watcher_and_leaves_the_workers(engine, workers):
    loop = EngineLoop(SimpleNamespace(llm_engine=engine), workers)
    assert loop.run([request(1)], request_ids).result(LIMIT)
    loop.close()
    assert not loop._watcher.is_alive() and not loop.dead
    assert all(worker.is_alive() for worker in workers)  # vLLM's shutdown stops them


def test_a_loop_nobody_holds_ends_its_thread(engine):
    loop = EngineLoop(SimpleNamespace(llm_engine=engine))
    assert loop.run([request(1)], request_ids).result(LIMIT)
    thread = loop._thread
    reference = weakref.ref(loop)
    del loop
    thread.join(LIMIT)  # it holds the loop for at most one idle wait
    assert not thread.is_alive()
    gc.collect()
    assert reference() is None


class Result:
    """A result a weak reference can follow (a list cannot be weakly referenced)."""


@pytest.mark.parametrize("ending", ["value", "future", "cancelled first", "cancelled later"])
def test_a_chained_future_lets_go_of_its_result_without_the_garbage_collector(ending):
    # `concurrent.futures.Future` keeps its callbacks once answered: a future that named the
    # future it waits on from a callback of its own made a cycle, and the futures and the
    # result (a step's rows) lived until the garbage collector ran.
    gc.collect()
    gc.disable()
    try:
        first, following, value = Future(), Future(), Result()
        answer = value if ending == "value" else following
        result = then(first, lambda _, answer=answer: answer)
        del answer
        if ending == "cancelled first":
            assert result.cancel() and first.cancelled()
        else:
            first.set_result(None)
        if ending == "cancelled later":
            assert result.cancel() and following.cancelled()
        elif ending == "future":
            following.set_result(value)
        if not ending.startswith("cancelled"):
            assert result.result(0) is value
        freed = [weakref.ref(thing) for thing in (first, following, value, result)]
        del first, following, value, result
        assert [reference() for reference in freed] == [None] * 4
    finally:
        gc.enable()
