"""Tests of the SGLang backend.

CPU tests drive `AsyncSGLTransformer` against `sgl_standin`, an in-process
stand-in for SGLang's scheduler that computes real logits with a tiny GPT-2
(a tiny Llama with real PEFT adapters for LoRA); results are checked against a
plain transformers forward pass of the same weights (for an adapter: the
adapter merged into a fresh model). The stand-in can take the shape of each
SGLang release whose scheduler changed (`sgl_standin.RELEASES`). The real
engine is tested in `test_sgl_real.py`.
"""

from __future__ import annotations

import asyncio
import gc
import re
import subprocess
import sys
import textwrap
import weakref

import pytest
import sgl_standin  # pytest's default "prepend" import mode puts tests/llm/sgl on sys.path
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from genlm.backend.llm.sgl import AsyncSGLTransformer

# Small enough that tests see several scheduler steps: 3 requests per batch and
# prompts longer than 16 tokens prefilled in chunks.
ENGINE_OPTS = {"max_running_requests": 3, "chunked_prefill_size": 16}

# The stand-in runs the same float32 weights as the reference, batched with right
# padding; padded positions are masked and causal attention keeps them out of the
# rows we read, so only float32 summation order differs (observed ~1e-6).
ATOL = 1e-4


@pytest.fixture(scope="module")
def scheduler(tiny_gpt2_path):
    with pytest.MonkeyPatch.context() as patch:
        sgl_standin.install(patch)
        lm = AsyncSGLTransformer.from_name(str(tiny_gpt2_path), engine_opts=ENGINE_OPTS)
    return lm.sgl_model


@pytest.fixture
def make_lm(scheduler, monkeypatch):
    """Backends over the shared stand-in scheduler, which starts each test idle and flushed."""
    assert scheduler.is_idle()
    assert scheduler.flush_cache()
    scheduler.received.clear()
    scheduler.submission_sizes.clear()
    scheduler.finished_reqs.clear()
    scheduler.batch_adapters.clear()
    scheduler.forward_ct = 0
    sgl_standin.install(monkeypatch)

    def make(**kwargs):
        return AsyncSGLTransformer(scheduler, **kwargs)

    yield make
    assert scheduler.is_idle(), "a call left work in the scheduler"


@pytest.fixture
def lm(make_lm):
    return make_lm()


@pytest.fixture(scope="module")
def reference(tiny_gpt2_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2_path)
    model.eval()

    @torch.no_grad()
    def logprobs(token_ids):
        logits = model(torch.tensor([list(token_ids)])).logits[0, -1]
        return torch.log_softmax(logits, dim=-1)

    return logprobs


def contexts(n, length=5, start=100):
    return [[start + 7 * i + j for j in range(length)] for i in range(n)]


LONG = [(37 * j) % 5000 + 11 for j in range(60)]  # 60 tokens: four 16-token chunks


async def until(condition, limit=100_000):
    """Yield to the event loop until `condition()` holds (bounded, not timed)."""
    for _ in range(limit):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


def assert_matches(rows, token_ids_list, reference):
    assert rows.shape == (len(token_ids_list), 50257)
    for row, ids in zip(rows, token_ids_list, strict=True):
        torch.testing.assert_close(row, reference(ids), atol=ATOL, rtol=0)
        assert abs(torch.logsumexp(row, dim=0).item()) < 1e-5


# -- construction -----------------------------------------------------------------


def test_import_without_sglang_and_use_names_the_extra():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["sglang"] = None  # as if SGLang were not installed
        import genlm.backend
        from genlm.backend.llm.sgl import AsyncSGLTransformer
        for use in (lambda: AsyncSGLTransformer.from_name("m"), lambda: AsyncSGLTransformer(None)):
            try:
                use()
            except ImportError as exc:
                assert "genlm-backend[sglang]" in str(exc), exc
            else:
                raise AssertionError("no ImportError")
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_from_name_builds_a_single_gpu_scheduler(tiny_gpt2_path, monkeypatch):
    sgl_standin.install(monkeypatch)
    lm = AsyncSGLTransformer.from_name(
        str(tiny_gpt2_path), engine_opts={"max_running_requests": 2}, gpu_id=0, cache_size=7
    )
    args = lm.sgl_model.server_args
    assert args.model_path == str(tiny_gpt2_path)
    assert args.disable_overlap_schedule is True  # default the driver needs
    assert args.max_running_requests == 2  # engine_opts override server arguments
    assert lm.cache.maxsize == 7  # other kwargs reach the constructor
    assert lm.vocab_size == 50257
    assert len(lm.byte_vocab) == len(AutoTokenizer.from_pretrained(tiny_gpt2_path))


def test_from_name_keeps_results_within_a_byte_budget_unless_told_otherwise(
    tiny_gpt2_path, monkeypatch
):
    sgl_standin.install(monkeypatch)
    lm = AsyncSGLTransformer.from_name(str(tiny_gpt2_path), cache_opts={"max_bytes": 4096})
    assert lm.cache.max_bytes == 4096 and lm.cache.maxsize > 10**9
    prompt = [1, 2, 3]
    first = lm.next_token_logprobs_sync(prompt)
    assert lm.cache.nbytes == 0  # a row of 50,257 float32s does not fit 4 KiB
    lm = AsyncSGLTransformer.from_name(str(tiny_gpt2_path))
    assert lm.cache.max_bytes == 256 * 1024**2
    assert torch.equal(lm.next_token_logprobs_sync(prompt), first)
    assert len(lm.cache) == 1


def test_overlap_scheduler_is_rejected(tiny_gpt2_path, monkeypatch):
    sgl_standin.install(monkeypatch)
    with pytest.raises(ValueError, match="disable_overlap_schedule"):
        AsyncSGLTransformer.from_name(
            str(tiny_gpt2_path), engine_opts={"disable_overlap_schedule": False}
        )


def test_scheduler_without_tokenizer_is_rejected(tiny_gpt2_path, monkeypatch):
    sgl_standin.install(monkeypatch)
    with pytest.raises(ValueError, match="tokenizer"):
        AsyncSGLTransformer.from_name(
            str(tiny_gpt2_path), engine_opts={"skip_tokenizer_init": True}
        )


# -- SGLang releases -----------------------------------------------------------------
# The stand-in shaped as each release that changed what a driver must do (see
# `sgl_standin.RELEASES`): building the scheduler, the request type, the next-batch
# call, chunked prefill, an engine error mid-batch, and the prefix cache.


@pytest.mark.parametrize("release", sgl_standin.RELEASES)
async def test_every_release_builds_runs_and_recovers(release, tiny_gpt2_path, reference):
    with pytest.MonkeyPatch.context() as patch:
        sgl_standin.install(patch, release)
        lm = AsyncSGLTransformer.from_name(str(tiny_gpt2_path), engine_opts=ENGINE_OPTS)
        scheduler = lm.sgl_model
        assert type(scheduler) is sgl_standin._scheduler_type(release)
        batch = contexts(4) + [LONG]  # two batches of at most 3, the long prompt in chunks
        rows = await asyncio.gather(*(lm.next_token_logprobs(ids) for ids in batch))
        assert_matches(torch.stack(rows), batch, reference)
        assert scheduler.forward_ct >= 4  # LONG alone takes 4 chunks
        scheduler.fail_next_run = RuntimeError("engine failure")
        with pytest.raises(RuntimeError, match="engine failure"):
            lm.batch_next_token_logprobs_sync(contexts(2, start=700))
        assert scheduler.is_idle()
        again = contexts(2, start=700)
        assert_matches(lm.batch_next_token_logprobs_sync(again), again, reference)
        lm.clear_kv_cache()
        assert scheduler.prefix_tree == set()


@pytest.mark.parametrize(
    ("release", "as_array"), [("0.5.12.post1", True), ("0.5.13", False), ("0.5.15", False)]
)
def test_token_ids_of_the_wrong_type_fail_in_the_stand_in(
    release, as_array, tiny_gpt2_path, monkeypatch
):
    # What the test above relies on: the stand-in takes token ids only as its release does.
    sgl_standin.install(monkeypatch, release)
    lm = AsyncSGLTransformer.from_name(str(tiny_gpt2_path), engine_opts=ENGINE_OPTS)
    lm._driver._sgl.ids_as_array = as_array
    with pytest.raises(TypeError, match="can only concatenate"):
        lm.next_token_logprobs_sync(contexts(1)[0])


def test_cleanup_releases_the_scheduler_and_refuses_later_calls(tiny_gpt2_path, monkeypatch):
    sgl_standin.install(monkeypatch)
    with AsyncSGLTransformer.from_name(str(tiny_gpt2_path), engine_opts=ENGINE_OPTS) as lm:
        scheduler = weakref.ref(lm.sgl_model)
        assert lm.next_token_logprobs_sync(contexts(1)[0]).shape == (50257,)
    gc.collect()
    assert scheduler() is None
    for call in (
        lambda: lm.next_token_logprobs_sync([1, 2]),
        lambda: lm.batch_next_token_logprobs_sync([[1, 2]]),
        lm.clear_kv_cache,
        lambda: lm.add_new_lora("adapter"),
    ):
        with pytest.raises(RuntimeError, match="cleaned up"):
            call()
    lm.cleanup()  # a second cleanup does nothing


# -- numbers ----------------------------------------------------------------------


async def test_async_logprobs_match_a_forward_pass(lm, reference):
    ids = contexts(1)[0]
    row = await lm.next_token_logprobs(ids)
    assert_matches(row[None], [ids], reference)


def test_sync_logprobs_match_a_forward_pass_outside_a_loop(lm, reference):
    ids = contexts(1)[0]
    assert_matches(lm.next_token_logprobs_sync(ids)[None], [ids], reference)
    batch = contexts(4) + [contexts(1)[0]]
    assert_matches(lm.batch_next_token_logprobs_sync(batch), batch, reference)
    # 4 distinct contexts, one repeated from the batch: one submission of 4.
    assert lm.sgl_model.submission_sizes == [1, 4]


async def test_sync_methods_work_inside_a_running_loop(lm, reference):
    batch = contexts(3)
    assert_matches(lm.batch_next_token_logprobs_sync(batch), batch, reference)
    assert_matches(lm.next_token_logprobs_sync(LONG)[None], [LONG], reference)


async def test_long_prompt_prefilled_in_chunks_gives_the_final_logits(lm, reference):
    row = await lm.next_token_logprobs(LONG)
    assert_matches(row[None], [LONG], reference)
    assert lm.sgl_model.forward_ct >= 4  # really chunked


async def test_more_requests_than_the_scheduler_runs_at_once(lm, reference):
    batch = contexts(10)
    rows = await lm.batch_next_token_logprobs(batch)
    assert_matches(rows, batch, reference)


def test_bad_token_ids_are_rejected_before_the_engine(lm):
    for bad in ([], [50257], [-1], [1.5], [[1, 2]]):
        with pytest.raises(ValueError):
            lm.next_token_logprobs_sync(bad)
    # The model's context is 1024: SGLang takes prompts shorter than max_req_input_len = 1023.
    with pytest.raises(ValueError, match="at most 1022"):
        lm.next_token_logprobs_sync([1] * 1023)
    assert lm.sgl_model.received == []


def test_the_longest_accepted_prompt_runs(lm, reference, monkeypatch):
    monkeypatch.setattr(lm.sgl_model.server_args, "chunked_prefill_size", 1024)  # one step
    longest = [(13 * j) % 50000 for j in range(1022)]
    assert_matches(lm.next_token_logprobs_sync(longest)[None], [longest], reference)


async def test_bad_token_ids_are_rejected_in_async_calls(lm):
    with pytest.raises(ValueError):
        await lm.next_token_logprobs([])
    assert lm.sgl_model.received == []


async def test_sample_is_seeded_and_stops_at_eos(lm):
    prompt = contexts(1)[0]
    first = await lm.sample(prompt, max_tokens=4, eos_token_ids=[], seed=3)
    assert first == await lm.sample(prompt, max_tokens=4, eos_token_ids=[], seed=3)
    assert len(first) == 4
    assert await lm.sample(prompt, max_tokens=4, eos_token_ids=[first[0]], seed=3) == []


# -- orchestration ----------------------------------------------------------------


async def test_concurrent_queries_are_drained_into_the_scheduler_together(lm, reference):
    batch = contexts(6)
    rows = await asyncio.gather(*(lm.next_token_logprobs(ids) for ids in batch))
    assert_matches(torch.stack(rows), batch, reference)
    assert lm.sgl_model.submission_sizes == [6]


async def test_identical_concurrent_queries_are_computed_once(lm, reference):
    a, b = contexts(2)
    rows = await asyncio.gather(*(lm.next_token_logprobs(ids) for ids in (a, b, a, a)))
    assert sorted(lm.sgl_model.received) == sorted([tuple(a), tuple(b)])
    assert_matches(torch.stack(rows), [a, b, a, a], reference)


async def test_a_request_in_flight_is_not_submitted_twice(lm, reference):
    scheduler = lm.sgl_model
    first = asyncio.create_task(lm.next_token_logprobs(LONG))
    await until(lambda: scheduler.forward_ct > 0)  # LONG is being prefilled (4 steps)
    assert not first.done()
    second = asyncio.create_task(lm.next_token_logprobs(LONG))
    other = asyncio.create_task(lm.next_token_logprobs(contexts(1)[0]))
    rows = await asyncio.gather(first, second, other)
    assert scheduler.received.count(tuple(LONG)) == 1
    assert_matches(torch.stack(rows), [LONG, LONG, contexts(1)[0]], reference)


async def test_a_cancelled_caller_does_not_disturb_the_others(lm, reference):
    a, b = contexts(2)
    cancelled = asyncio.create_task(lm.next_token_logprobs(a))
    kept = asyncio.create_task(lm.next_token_logprobs(b))
    await asyncio.sleep(0)
    cancelled.cancel()
    assert_matches((await kept)[None], [b], reference)
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert_matches((await lm.next_token_logprobs(a))[None], [a], reference)


async def test_reset_cancels_waiters_and_the_running_batch(lm, reference):
    scheduler = lm.sgl_model
    in_flight = [asyncio.create_task(lm.next_token_logprobs(LONG))]
    await until(lambda: scheduler.forward_ct > 0)
    queued = [asyncio.create_task(lm.next_token_logprobs(ids)) for ids in contexts(3)]
    await asyncio.sleep(0)
    lm.reset_async_queries()
    outcomes = await asyncio.wait_for(  # a hang guard, not a timing check
        asyncio.gather(*in_flight, *queued, return_exceptions=True), timeout=120
    )
    assert all(isinstance(o, asyncio.CancelledError) for o in outcomes)
    assert scheduler.is_idle()
    ids = contexts(1, start=900)[0]
    assert_matches((await lm.next_token_logprobs(ids))[None], [ids], reference)


async def test_engine_error_reaches_every_waiter_and_the_backend_recovers(lm, reference):
    scheduler = lm.sgl_model
    scheduler.fail_next_run = RuntimeError("engine failure")
    batch = contexts(3)
    outcomes = await asyncio.gather(
        *(lm.next_token_logprobs(ids) for ids in batch), return_exceptions=True
    )
    assert [str(o) for o in outcomes] == ["engine failure"] * 3
    assert scheduler.is_idle()
    rows = await asyncio.gather(*(lm.next_token_logprobs(ids) for ids in batch))
    assert_matches(torch.stack(rows), batch, reference)


async def test_engine_error_while_a_prompt_is_half_prefilled(lm, reference):
    scheduler = lm.sgl_model
    pending = asyncio.create_task(lm.next_token_logprobs(LONG))
    await until(lambda: scheduler.forward_ct > 0)
    scheduler.fail_next_run = RuntimeError("engine failure")
    with pytest.raises(RuntimeError, match="engine failure"):
        await pending
    assert scheduler.is_idle()
    assert_matches((await lm.next_token_logprobs(LONG))[None], [LONG], reference)


def test_engine_error_in_a_sync_call_leaves_the_backend_usable(lm, reference):
    scheduler = lm.sgl_model
    scheduler.fail_next_run = RuntimeError("engine failure")
    batch = contexts(3)
    with pytest.raises(RuntimeError, match="engine failure"):
        lm.batch_next_token_logprobs_sync(batch)
    assert scheduler.is_idle()
    assert_matches(lm.batch_next_token_logprobs_sync(batch), batch, reference)


async def test_a_sync_call_while_an_async_batch_is_in_flight(lm, reference):
    scheduler = lm.sgl_model
    pending = asyncio.create_task(lm.next_token_logprobs(LONG))
    await until(lambda: scheduler.forward_ct > 0)
    ids = contexts(1)[0]
    assert_matches(lm.next_token_logprobs_sync(ids)[None], [ids], reference)
    assert_matches((await pending)[None], [LONG], reference)


async def test_output_cache_serves_repeats_and_evicts_least_recent(make_lm, reference):
    lm = make_lm(cache_size=2)
    received = lm.sgl_model.received
    a, b, c = contexts(3)
    row_a = await lm.next_token_logprobs(a)
    assert torch.equal(await lm.next_token_logprobs(a), row_a)
    assert torch.equal(lm.next_token_logprobs_sync(a), row_a)
    assert received == [tuple(a)]
    lm.batch_next_token_logprobs_sync([a, b])  # only b is new
    assert received == [tuple(a), tuple(b)]
    lm.batch_next_token_logprobs_sync([c])  # evicts a, the least recently used
    await lm.next_token_logprobs(a)
    assert received.count(tuple(a)) == 2
    assert_matches(lm.batch_next_token_logprobs_sync([a, b, c]), [a, b, c], reference)


def test_without_output_cache_every_call_recomputes(lm):
    a = contexts(1)[0]
    lm.next_token_logprobs_sync(a)
    lm.next_token_logprobs_sync(a)
    assert lm.sgl_model.received == [tuple(a)] * 2


def test_clear_kv_cache_flushes_the_prefix_cache(make_lm, reference):
    lm = make_lm(cache_size=10)
    scheduler = lm.sgl_model
    prompt = contexts(1, length=8)[0]
    lm.next_token_logprobs_sync(prompt)
    lm.next_token_logprobs_sync(prompt + [5])
    assert scheduler.finished_reqs[-1].cached_tokens == len(prompt)  # prefix reused
    lm.clear_kv_cache()
    assert_matches(lm.next_token_logprobs_sync(prompt + [6])[None], [prompt + [6]], reference)
    assert scheduler.finished_reqs[-1].cached_tokens == 0
    assert len(lm.cache) == 3  # clear_kv_cache keeps results
    lm.clear_cache()
    assert len(lm.cache) == 0
    lm.next_token_logprobs_sync(prompt)
    assert scheduler.finished_reqs[-1].cached_tokens == 0


async def test_clear_kv_cache_during_an_async_batch_finishes_it_first(lm, reference):
    scheduler = lm.sgl_model
    pending = asyncio.create_task(lm.next_token_logprobs(LONG))
    await until(lambda: scheduler.forward_ct > 0)
    lm.clear_kv_cache()
    assert_matches((await pending)[None], [LONG], reference)


def test_outputs_do_not_pile_up_on_the_scheduler_sockets(lm):
    lm.batch_next_token_logprobs_sync(contexts(4))
    for socket in (lm.sgl_model.send_to_detokenizer, lm.sgl_model.send_to_tokenizer):
        assert not isinstance(socket, sgl_standin.RecordingSocket) or socket.sent == []


def test_successive_event_loops(lm, reference):
    a, b = contexts(2)
    assert_matches(asyncio.run(lm.next_token_logprobs(a))[None], [a], reference)
    assert_matches(asyncio.run(lm.next_token_logprobs(b))[None], [b], reference)


# -- LoRA adapters ------------------------------------------------------------------

LORA_OPTS = {
    **ENGINE_OPTS,
    "enable_lora": True,
    "max_lora_rank": 8,
    "lora_target_modules": ["q_proj", "v_proj"],
    "max_loras_per_batch": 2,  # below the three models queried at once: batches must split
}
LLAMA_VOCAB = 49152

# The stand-in applies each adapter unmerged (x W + s x A B, peft's mixed-adapter forward over
# a right-padded batch); the reference merges it (x (W + s A B)) and runs one unpadded prompt.
# Both are float32; only summation order differs. Measured: at most 1.9e-6 (9.5e-7 for base
# rows) over the 39 rows these tests compare; 1e-5 keeps a 5x margin and is far below the
# adapters' effect (> 1e-2, checked).
LORA_ATOL = 1e-5


@pytest.fixture(scope="module")
def lora_setup(tiny_llama_path, tmp_path_factory):
    """Two saved rank-8 adapters and, for each, the merged model as an independent reference."""
    from peft import LoraConfig, PeftModel, get_peft_model

    folders, references = {}, {}
    for name, seed in (("a", 0), ("b", 1)):
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(tiny_llama_path)
        config = LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        folders[name] = tmp_path_factory.mktemp(f"lora_{name}")
        get_peft_model(base, config).save_pretrained(folders[name])
        fresh = AutoModelForCausalLM.from_pretrained(tiny_llama_path)
        references[name] = PeftModel.from_pretrained(fresh, folders[name]).merge_and_unload()
    references[None] = AutoModelForCausalLM.from_pretrained(tiny_llama_path)

    @torch.no_grad()
    def logprobs(name, token_ids):
        logits = references[name].eval()(torch.tensor([list(token_ids)])).logits[0, -1]
        return torch.log_softmax(logits, dim=-1)

    return folders, logprobs


@pytest.fixture(scope="module")
def lora_scheduler(tiny_llama_path):
    with pytest.MonkeyPatch.context() as patch:
        sgl_standin.install(patch)
        lm = AsyncSGLTransformer.from_name(str(tiny_llama_path), engine_opts=LORA_OPTS)
    return lm.sgl_model


@pytest.fixture
def make_lora_lm(lora_scheduler, lora_setup, monkeypatch):
    """Backends over the shared LoRA scheduler with adapters "a" and "b" registered, none active.

    Every adapter a test leaves registered is removed again, so the scheduler starts each
    test holding none.
    """
    folders, _ = lora_setup
    assert lora_scheduler.is_idle() and lora_scheduler.loaded_loras == {}
    lora_scheduler.received.clear()
    lora_scheduler.submission_sizes.clear()
    lora_scheduler.finished_reqs.clear()
    lora_scheduler.batch_adapters.clear()
    lora_scheduler.forward_ct = 0
    sgl_standin.install(monkeypatch)
    made = []

    def make(**kwargs):
        lm = AsyncSGLTransformer(lora_scheduler, **kwargs)
        lm.add_new_lora(str(folders["a"]), "a")
        lm.add_new_lora(str(folders["b"]), "b")
        made.append(lm)
        return lm

    yield make
    for lm in made:
        for name in lm.loras.names:
            lm.remove_lora(name)
    assert lora_scheduler.is_idle(), "a call left work in the scheduler"
    assert lora_scheduler.loaded_loras == {}


@pytest.fixture
def lora_lm(make_lora_lm):
    return make_lora_lm()


def llama_contexts():
    generator = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, LLAMA_VOCAB, (10,), generator=generator).tolist()
    return [prompt + [5], prompt + [6, 7], LONG]  # LONG is prefilled in chunks


def assert_lora_matches(row, name, token_ids, reference):
    torch.testing.assert_close(row, reference(name, token_ids), atol=LORA_ATOL, rtol=0)


async def test_adapters_and_base_in_one_window_each_match_their_reference(make_lora_lm, lora_setup):
    _, reference = lora_setup
    lm = make_lora_lm(cache_size=64)
    scheduler = lm.sgl_model
    contexts = llama_contexts()
    for context in contexts:  # the adapters do change the numbers
        for name in ("a", "b"):
            assert (reference(name, context) - reference(None, context)).abs().max() > 1e-2
    for active in (None, "b"):  # what lora_name=None means follows set_lora
        if active is not None:
            lm.set_lora(lora_name=active)
        calls = [(c, name) for c in contexts for name in ("a", "b", None)]
        rows = await asyncio.gather(*(lm.next_token_logprobs(c, lora_name=n) for c, n in calls))
        for (context, name), row in zip(calls, rows, strict=True):
            assert_lora_matches(row, active if name is None else name, context, reference)
    # The first window went to the scheduler as one submission; the second was all cached
    # (its lora_name=None calls asked for "b", already computed under that name).
    assert scheduler.submission_sizes == [9]
    assert all(len(set(ids)) <= 2 for ids in scheduler.batch_adapters)
    assert any(len(set(ids)) == 2 for ids in scheduler.batch_adapters)  # mixed batches
    assert lm.loras.active == "b"
    batch = await lm.batch_next_token_logprobs(contexts, lora_name="a")
    batch_sync = lm.batch_next_token_logprobs_sync(contexts, lora_name=None)
    for context, row_a, row_b in zip(contexts, batch, batch_sync, strict=True):
        assert_lora_matches(row_a, "a", context, reference)
        assert_lora_matches(row_b, "b", context, reference)
    lm.clear_lora()
    assert_lora_matches(lm.next_token_logprobs_sync(contexts[0]), None, contexts[0], reference)


async def test_sample_with_an_adapter_draws_from_that_adapter(lora_lm, lora_setup):
    _, reference = lora_setup
    prompt = llama_contexts()[0]
    generator, context, expected = torch.Generator().manual_seed(3), list(prompt), []
    for _ in range(3):
        probs = torch.softmax(reference("a", context).double(), dim=-1)
        expected.append(int(torch.multinomial(probs, 1, generator=generator)))
        context.append(expected[-1])
    assert await lora_lm.sample(prompt, 3, [], seed=3, lora_name="a") == expected
    assert (await lora_lm.batch_sample([prompt], 3, [], seed=3, lora_name="a")) == [expected]


def test_prefix_cache_is_kept_per_adapter(lora_lm, lora_setup):
    _, reference = lora_setup
    scheduler = lora_lm.sgl_model
    prompt = llama_contexts()[0]
    lora_lm.next_token_logprobs_sync(prompt, lora_name="a")
    for name, cached in ((None, 0), ("b", 0), ("a", len(prompt))):
        row = lora_lm.next_token_logprobs_sync(prompt + [9], lora_name=name)
        assert scheduler.finished_reqs[-1].cached_tokens == cached
        assert_lora_matches(row, name, prompt + [9], reference)


async def test_replacing_an_adapter_under_its_name(make_lora_lm, lora_setup):
    folders, reference = lora_setup
    lora_lm = make_lora_lm(cache_size=16)
    scheduler = lora_lm.sgl_model
    context = llama_contexts()[0]
    lora_lm.set_lora(lora_name="a")
    assert_lora_matches(await lora_lm.next_token_logprobs(context), "a", context, reference)
    assert len(lora_lm.cache) == 1
    lora_lm.add_new_lora(str(folders["b"]), "a")  # "a" now holds b's weights
    assert len(lora_lm.cache) == 0  # the old adapter's results are gone
    assert lora_lm.loras.names == ["b", "a"] and lora_lm.loras.active == "a"
    assert sorted(scheduler.loaded_loras.values()) == ["a", "b"]  # the old "a" is unloaded
    assert_lora_matches(await lora_lm.next_token_logprobs(context), "b", context, reference)
    assert_lora_matches(lora_lm.next_token_logprobs_sync(context, "a"), "b", context, reference)


def test_a_failed_load_registers_nothing(lora_lm, lora_setup, tmp_path):
    _, reference = lora_setup
    with pytest.raises(RuntimeError, match="could not load LoRA adapter 'c'.*adapter_config"):
        lora_lm.add_new_lora(str(tmp_path / "missing"), "c")
    assert lora_lm.loras.names == ["a", "b"]
    # A failed replacement leaves the name unregistered rather than naming stale weights.
    with pytest.raises(RuntimeError, match="could not load LoRA adapter 'a'"):
        lora_lm.add_new_lora(str(tmp_path / "missing"), "a")
    assert lora_lm.loras.names == ["b"]
    assert list(lora_lm.sgl_model.loaded_loras.values()) == ["b"]
    context = llama_contexts()[0]
    assert_lora_matches(lora_lm.next_token_logprobs_sync(context, "b"), "b", context, reference)


def test_remove_lora_unloads_and_forgets_the_adapter(make_lora_lm, lora_setup):
    folders, reference = lora_setup
    lm = make_lora_lm(cache_size=16)
    scheduler = lm.sgl_model
    contexts = llama_contexts()[:2]
    lm.batch_next_token_logprobs_sync(contexts, lora_name="a")
    lm.batch_next_token_logprobs_sync(contexts, lora_name="b")
    assert len(lm.cache) == 4
    lm.remove_lora("a")
    assert len(lm.cache) == 2 and lm.loras.names == ["b"]
    assert list(scheduler.loaded_loras.values()) == ["b"]
    with pytest.raises(ValueError, match="no LoRA adapter named 'a'; registered adapters: 'b'"):
        lm.next_token_logprobs_sync(contexts[0], lora_name="a")
    lm.set_lora(lora_name="b")
    lm.remove_lora("b")  # the active adapter: the base model becomes active
    assert lm.loras.active is None and scheduler.loaded_loras == {}
    rows = lm.batch_next_token_logprobs_sync(contexts)
    for context, row in zip(contexts, rows, strict=True):
        assert_lora_matches(row, None, context, reference)
    lm.set_lora(str(folders["a"]), "a")  # set_lora with a path loads and activates
    assert_lora_matches(lm.next_token_logprobs_sync(contexts[0]), "a", contexts[0], reference)


async def test_removing_an_adapter_finishes_its_requests_in_flight(make_lora_lm, lora_setup):
    _, reference = lora_setup
    lora_lm = make_lora_lm(cache_size=16)
    scheduler = lora_lm.sgl_model
    pending = asyncio.create_task(lora_lm.next_token_logprobs(LONG, lora_name="a"))
    await until(lambda: scheduler.forward_ct > 0)  # LONG is being prefilled (4 steps)
    assert not pending.done()
    lora_lm.remove_lora("a")
    assert_lora_matches(await pending, "a", LONG, reference)
    assert len(lora_lm.cache) == 0  # nothing cached under an adapter that is gone


async def test_a_request_for_an_adapter_the_scheduler_lacks_is_aborted(lora_lm, lora_setup):
    _, reference = lora_setup
    scheduler = lora_lm.sgl_model
    lora_lm.loras.add("stale", "0" * 32)  # as if its adapter had been unloaded meanwhile
    context = llama_contexts()[0]
    stale, served = await asyncio.gather(
        lora_lm.next_token_logprobs(context, lora_name="stale"),
        lora_lm.next_token_logprobs(context, lora_name="a"),
        return_exceptions=True,
    )  # one batch: only the aborted request's caller gets the error
    assert isinstance(stale, RuntimeError)
    assert re.search("SGLang aborted the request: .* is not loaded", str(stale))
    assert_lora_matches(served, "a", context, reference)
    with pytest.raises(RuntimeError, match="SGLang aborted the request: .* is not loaded"):
        lora_lm.next_token_logprobs_sync(context, lora_name="stale")
    lora_lm.loras.remove("stale")
    assert scheduler.is_idle()
    assert_lora_matches(await lora_lm.next_token_logprobs(context, "a"), "a", context, reference)


async def test_a_query_whose_adapter_is_removed_while_it_waits_fails_alone(lora_lm, lora_setup):
    _, reference = lora_setup
    context = llama_contexts()[0]
    names = ("a", "b", None)
    tasks = [asyncio.ensure_future(lora_lm.next_token_logprobs(context, n)) for n in names]
    await asyncio.sleep(0)
    assert len(lora_lm._batcher.pending) == 3  # queued, not yet handed to the scheduler
    lora_lm.remove_lora("a")
    removed, *served = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(removed, ValueError)
    assert str(removed) == (
        "LoRA adapter 'a' was removed while this query waited; registered adapters: 'b'"
    )
    for name, row in zip(names[1:], served, strict=True):
        assert_lora_matches(row, name, context, reference)
    assert lora_lm.sgl_model.received == [tuple(context)] * 2  # "a"'s never reached SGLang


async def test_unknown_adapter_names_list_the_registered_ones(lora_lm, lm):
    ids = llama_contexts()[0]
    registered = "registered adapters: 'a', 'b'"
    calls = [
        lambda: lora_lm.next_token_logprobs_sync(ids, lora_name="c"),
        lambda: lora_lm.batch_next_token_logprobs_sync([ids], lora_name="c"),
        lambda: lora_lm.batch_next_token_logprobs_sync([], lora_name="c"),
        lambda: lora_lm.set_lora(lora_name="c"),
        lambda: lora_lm.remove_lora("c"),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=registered):
            call()
    coroutines = [
        lambda: lora_lm.next_token_logprobs(ids, lora_name="c"),
        lambda: lora_lm.batch_next_token_logprobs([ids], lora_name="c"),
        lambda: lora_lm.batch_next_token_logprobs([], lora_name="c"),
        lambda: lora_lm.sample(ids, 2, [], lora_name="c"),
        lambda: lora_lm.batch_sample([ids], 2, [], lora_name="c"),
    ]
    for coroutine in coroutines:
        with pytest.raises(ValueError, match=registered):
            await coroutine()
    assert lora_lm.sgl_model.received == []
    with pytest.raises(ValueError, match="registered adapters: none"):
        lm.next_token_logprobs_sync(contexts(1)[0], lora_name="a")


def test_lora_needs_a_scheduler_built_with_lora(lm, lora_setup):
    folders, _ = lora_setup
    with pytest.raises(ValueError, match="enable_lora.*max_lora_rank.*lora_target_modules"):
        lm.add_new_lora(str(folders["a"]), "a")
    with pytest.raises(ValueError, match="enable_lora"):
        lm.set_lora(str(folders["a"]), "a")
    assert lm.loras.names == []


# -- owned results and empty batches --------------------------------------------------


async def test_changing_a_returned_row_changes_nothing_else(make_lora_lm, lora_setup):
    _, reference = lora_setup
    lm = make_lora_lm(cache_size=16)
    context = llama_contexts()[0]
    first, twin = await asyncio.gather(  # one computation, two callers
        lm.next_token_logprobs(context, lora_name="a"),
        lm.next_token_logprobs(context, lora_name="a"),
    )
    first.fill_(0.0)
    assert_lora_matches(twin, "a", context, reference)
    cached = await lm.next_token_logprobs(context, lora_name="a")
    assert_lora_matches(cached, "a", context, reference)
    cached.add_(1.0)
    rows = lm.batch_next_token_logprobs_sync([context, context], lora_name="a")
    rows[0].mul_(2.0)
    assert_lora_matches(rows[1], "a", context, reference)
    assert_lora_matches(lm.next_token_logprobs_sync(context, "a"), "a", context, reference)
    assert lm.sgl_model.received.count(tuple(context)) == 1  # all but the first were cached


async def test_empty_batches(lora_lm, lm):
    for backend, vocab in ((lm, 50257), (lora_lm, LLAMA_VOCAB)):
        for rows in (
            backend.batch_next_token_logprobs_sync([]),
            await backend.batch_next_token_logprobs([]),
        ):
            assert rows.shape == (0, vocab) and rows.dtype == torch.float32
    assert lora_lm.batch_next_token_logprobs_sync([], lora_name="a").shape == (0, LLAMA_VOCAB)
    assert lm.sgl_model.submission_sizes == [] and lora_lm.sgl_model.submission_sizes == []


def test_rows_follow_the_row_contract(lm, reference):
    assert lm.model is lm.sgl_model
    assert lm.device == torch.device("cpu")
    row = lm.next_token_logprobs_sync([5, 6, 7])
    assert row.dtype == torch.float32 and row.shape == (len(lm.str_vocab),)
    assert row.device == lm.device
    torch.testing.assert_close(row, reference([5, 6, 7]), rtol=0, atol=ATOL)
