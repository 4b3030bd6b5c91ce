"""AsyncSGLTransformer when its SGLang scheduler breaks for good: every call fails.

SGLang's scheduler runs in the caller's process, so no process of its own can
die; what can break it for good is the device (a `torch.AcceleratorError`: the
GPU context may be corrupted) or its state (cleaning up after a failed batch
fails too). These tests drive the stand-in scheduler (`sgl_standin`; SGLang
cannot run here), each on a scheduler of its own since a dead one cannot be
shared. That other errors leave the scheduler usable is tested in `test_sgl.py`.
"""

import asyncio

import pytest
import sgl_standin  # pytest's default "prepend" import mode puts tests/llm/sgl on sys.path
import torch
from test_sgl import ENGINE_OPTS, LONG, contexts, until

from genlm.backend import EngineDeadError
from genlm.backend.llm.sgl import AsyncSGLTransformer

AcceleratorError = getattr(torch, "AcceleratorError", None)
needs_accelerator_error = pytest.mark.skipif(
    AcceleratorError is None, reason="torch.AcceleratorError is new in torch 2.8"
)


@pytest.fixture
def scheduler(tiny_gpt2_path, monkeypatch):
    sgl_standin.install(monkeypatch)
    return AsyncSGLTransformer.from_name(str(tiny_gpt2_path), engine_opts=ENGINE_OPTS).sgl_model


def assert_says_dead(error, *details):
    """`error` is an `EngineDeadError` that names what broke and what to do."""
    assert isinstance(error, EngineDeadError), repr(error)
    message = str(error)
    assert message.startswith("the SGLang scheduler died: ")
    assert "load_model_by_name" in message and "new process" in message
    for detail in details:
        assert detail in message


async def assert_every_later_call_fails(lm, scheduler, *details):
    """Each call that needs the scheduler raises `EngineDeadError` without reaching it."""
    attempts, received = scheduler.run_attempts, list(scheduler.received)
    ids = contexts(1)[0]
    coroutines = [
        lambda: lm.next_token_logprobs(ids),  # cached before the death
        lambda: lm.batch_next_token_logprobs([ids, [7]]),
        lambda: lm.sample(ids, 2, []),
    ]
    calls = [
        lambda: lm.next_token_logprobs_sync(ids),
        lambda: lm.batch_next_token_logprobs_sync([[8], [9]]),
        lambda: lm.batch_next_token_logprobs_sync([]),
        lambda: lm.clear_kv_cache(),
        lambda: lm.clear_cache(),
        lambda: lm.add_new_lora("some/adapter", "new"),
    ]
    for call in [*coroutines, *calls]:
        with pytest.raises(EngineDeadError) as caught:
            outcome = call()
            if asyncio.iscoroutine(outcome):
                await outcome
        assert_says_dead(caught.value, *details)
    assert scheduler.run_attempts == attempts and scheduler.received == received


@needs_accelerator_error
async def test_a_device_error_kills_the_scheduler_for_every_caller(scheduler):
    lm = AsyncSGLTransformer(scheduler, cache_size=8)
    other = AsyncSGLTransformer(scheduler)  # a second backend over the same scheduler
    await lm.next_token_logprobs(contexts(1)[0])  # cached
    uncached = [LONG, *contexts(4, start=500)]
    waiting = [asyncio.create_task(lm.next_token_logprobs(ids)) for ids in uncached]
    await until(lambda: scheduler.forward_ct > 1)  # LONG is half prefilled
    device_error = AcceleratorError("CUDA error: an illegal memory access was encountered")
    scheduler.device_error = device_error
    outcomes = await asyncio.gather(*waiting, return_exceptions=True)
    reported = "a batch raised AcceleratorError('CUDA error: an illegal memory access"
    for outcome in outcomes:
        assert_says_dead(outcome, reported)
        assert outcome.__cause__ is device_error
    assert scheduler.run_attempts == scheduler.forward_ct + 1  # the failed batch, then nothing
    for backend in (lm, other):
        await assert_every_later_call_fails(backend, scheduler, reported)


def test_a_failed_cleanup_after_a_batch_error_kills_the_scheduler(scheduler, monkeypatch):
    lm = AsyncSGLTransformer(scheduler)
    scheduler.fail_next_run = RuntimeError("batch failed")

    def broken_abort(request):
        raise RuntimeError("request pool corrupted")

    monkeypatch.setattr(scheduler, "abort_request", broken_abort)
    with pytest.raises(EngineDeadError) as caught:
        lm.batch_next_token_logprobs_sync(contexts(3))
    detail = "RuntimeError('batch failed'), aborting its requests raised"
    assert_says_dead(caught.value, detail, "RuntimeError('request pool corrupted')")
    assert repr(caught.value.__cause__) == "RuntimeError('request pool corrupted')"
    asyncio.run(assert_every_later_call_fails(lm, scheduler, detail))
