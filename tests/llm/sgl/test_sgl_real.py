"""`AsyncSGLTransformer` against a real SGLang engine, on the CPU or a CUDA GPU.

These tests need SGLang itself: `scripts/test.sh` runs this file in the
environment `scripts/setup_sglang.sh` builds (SGLang 0.5.18 and its CPU
kernels, on an x86-64 CPU with AVX-512 BF16; AMX is used where the CPU has
it). Elsewhere they are skipped, with that reason.

SmolLM2-135M runs in bfloat16 (SGLang's AMX kernels have no float32). Rows are
compared with a float32 transformers forward pass by total variation, and the
tolerance comes from the variation of transformers' own bfloat16 rows from
the same float32 reference on the same contexts, measured in the test (twice
it, at least 0.1: see `TV_FACTOR`): both are bfloat16 implementations of one
model. Measured here (AMD EPYC, SGLang 0.5.18,
torch_native attention): SGLang's rows at most 0.015 (five prompts) and 0.038
(31 prefixes of a sentence) from float32, transformers' bfloat16 rows 0.016
and 0.14.
"""

import asyncio
import os
import subprocess
import sys
import textwrap

import pytest
import torch

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # read when SGLang is imported
pytest.importorskip(
    "sglang",
    reason="SGLang is not installed here: scripts/test.sh runs this file in the environment "
    "scripts/setup_sglang.sh builds (x86-64 with AVX-512 BF16, or CUDA)",
)

from transformers import AutoModelForCausalLM  # noqa: E402

from genlm.backend.llm.sgl import AsyncSGLTransformer  # noqa: E402


def engine_opts() -> dict:
    if torch.cuda.is_available():
        return {"dtype": "bfloat16", "mem_fraction_static": 0.3}
    amx = torch.cpu._is_amx_tile_supported()
    return {
        "device": "cpu",
        "dtype": "bfloat16",
        "attention_backend": "intel_amx" if amx else "torch_native",
        "max_total_tokens": 4096,
    }


# Twice the reference's spread, and at least 0.1: over a handful of contexts the spread is a
# small sample (SGLang's rows reached 0.084 where transformers' reached 0.056 on two prompts).
# A real fault moves a row much further: the row of the neighbouring position of the
# sentence below is 0.22 to 1.0 away in total variation (median 0.98), measured in float32.
TV_FACTOR, TV_FLOOR = 2.0, 0.1
# A favourite that leads by more than this stays the favourite: bfloat16 moves single
# log-probabilities by up to 0.4 here.
CLEAR_LEAD = 1.0


@pytest.fixture(scope="module")
def real_lm(smollm2_path):
    lm = AsyncSGLTransformer.from_name(str(smollm2_path), engine_opts=engine_opts(), cache_size=0)
    yield lm
    lm.cleanup()


@pytest.fixture(scope="module")
def references(smollm2_path):
    """Next-token log-probabilities of every prefix of a context, by transformers in float32
    and in bfloat16 (one forward pass each)."""
    models = {
        dtype: AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=dtype).eval()
        for dtype in (torch.float32, torch.bfloat16)
    }

    @torch.no_grad()
    def rows(token_ids, dtype=torch.float32):
        logits = models[dtype](torch.tensor([list(token_ids)])).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)

    return rows


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a.exp() - b.exp()).abs().sum().item()


def assert_like_transformers(rows, contexts, references):
    """Each row within the spread of transformers' bfloat16 rows from float32 (see the module)."""
    exact = [references(ids)[-1] for ids in contexts]
    spread = max(
        total_variation(references(ids, torch.bfloat16)[-1], row)
        for ids, row in zip(contexts, exact, strict=True)
    )
    tolerance = max(TV_FACTOR * spread, TV_FLOOR)
    for ids, row, expected in zip(contexts, rows, exact, strict=True):
        assert row.shape == expected.shape
        assert abs(torch.logsumexp(row, dim=0).item()) < 1e-4
        tv = total_variation(row, expected)
        assert tv <= tolerance, f"total variation {tv:.4f} > {tolerance:.4f} for {ids}"
        top2 = expected.topk(2).values
        if top2[0] - top2[1] > CLEAR_LEAD:
            assert row.argmax() == expected.argmax()


def encode(lm, texts):
    return [lm.tokenizer.encode(text) for text in texts]


PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def hello():", "Once upon a time"]
SENTENCE = (
    "In 1492, Columbus sailed across the Atlantic Ocean and reached the islands of the "
    "Caribbean, believing he had found a western route to Asia."
)


async def test_rows_match_transformers(real_lm, references):
    contexts = encode(real_lm, PROMPTS)
    rows = await asyncio.gather(*(real_lm.next_token_logprobs(ids) for ids in contexts))
    assert_like_transformers(rows, contexts, references)
    assert_like_transformers(real_lm.batch_next_token_logprobs_sync(contexts), contexts, references)
    paris = real_lm.tokenizer.encode(" Paris")[0]
    assert rows[0].argmax().item() == paris


async def test_every_prefix_of_a_sequence(real_lm, references):
    sequence = encode(real_lm, [SENTENCE])[0]
    prefixes = [sequence[:n] for n in range(1, len(sequence) + 1)]
    rows = await real_lm.batch_next_token_logprobs(prefixes)
    assert rows.shape == (len(prefixes), real_lm.vocab_size)
    assert_like_transformers(rows, prefixes, references)


async def test_a_cancelled_caller_leaves_the_others_their_rows(real_lm, references):
    contexts = encode(real_lm, [f"{PROMPTS[0]} {word}" for word in ("not", "a", "very", "big")])
    tasks = [asyncio.create_task(real_lm.next_token_logprobs(ids)) for ids in contexts]
    await asyncio.sleep(0)  # all four queued
    tasks[1].cancel()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(outcomes[1], asyncio.CancelledError)
    kept = [0, 2, 3]
    assert_like_transformers([outcomes[i] for i in kept], [contexts[i] for i in kept], references)
    assert not real_lm.sgl_model.waiting_queue  # the scheduler is idle again


async def test_reset_cancels_the_waiters_and_leaves_the_engine_usable(real_lm, references):
    contexts = encode(real_lm, [f"{PROMPTS[3]} there was a {word}" for word in ("cat", "dog")])
    tasks = [asyncio.create_task(real_lm.next_token_logprobs(ids)) for ids in contexts]
    await asyncio.sleep(0)
    real_lm.reset_async_queries()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(outcome, asyncio.CancelledError) for outcome in outcomes)
    assert_like_transformers(real_lm.batch_next_token_logprobs_sync(contexts), contexts, references)


async def test_an_engine_error_reaches_only_the_callers_of_its_batch(
    real_lm, references, monkeypatch
):
    scheduler = real_lm.sgl_model
    real_run = scheduler.run_batch
    failures = []

    def fail_once(batch, *args, **kwargs):
        if not failures:
            failures.append(batch)
            raise RuntimeError("injected engine failure")
        return real_run(batch, *args, **kwargs)

    monkeypatch.setattr(scheduler, "run_batch", fail_once)
    doomed = encode(real_lm, ["A failing batch, first", "A failing batch, second"])
    outcomes = await asyncio.gather(
        *(real_lm.next_token_logprobs(ids) for ids in doomed), return_exceptions=True
    )
    assert [str(outcome) for outcome in outcomes] == ["injected engine failure"] * 2
    later = encode(real_lm, PROMPTS[:2])
    rows = await asyncio.gather(*(real_lm.next_token_logprobs(ids) for ids in later))
    assert_like_transformers(rows, later, references)
    assert_like_transformers(real_lm.batch_next_token_logprobs_sync(doomed), doomed, references)


def test_clear_cache_empties_the_prefix_cache(real_lm, references):
    contexts = encode(real_lm, [SENTENCE])
    real_lm.batch_next_token_logprobs_sync(contexts)
    tree = real_lm.sgl_model.tree_cache
    assert tree.evictable_size() >= len(contexts[0]) - 1  # the sentence's tokens are cached
    real_lm.clear_cache()
    assert tree.evictable_size() == 0
    assert_like_transformers(real_lm.batch_next_token_logprobs_sync(contexts), contexts, references)


def test_bad_token_ids_never_reach_the_engine(real_lm):
    with pytest.raises(ValueError):
        real_lm.next_token_logprobs_sync([real_lm.vocab_size])
    with pytest.raises(ValueError):
        real_lm.next_token_logprobs_sync([])


def test_after_cleanup_calls_fail_and_the_process_exits_alone(smollm2_path):
    code = textwrap.dedent(
        f"""
        import gc, threading
        import psutil
        from genlm.backend.llm.sgl import AsyncSGLTransformer
        from test_sgl_real import engine_opts

        lm = AsyncSGLTransformer.from_name({str(smollm2_path)!r}, engine_opts=engine_opts())
        row = lm.next_token_logprobs_sync(lm.tokenizer.encode("Hello"))
        lm.cleanup()
        gc.collect()
        try:
            lm.next_token_logprobs_sync(lm.tokenizer.encode("Hello"))
        except RuntimeError as error:
            print("after cleanup:", error)
        print("children:", len(psutil.Process().children(recursive=True)))
        print("threads:", sorted(t.name for t in threading.enumerate() if not t.daemon))
        """
    )
    here = os.path.dirname(__file__)
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=here,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([here, *sys.path])},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.strip().splitlines()[-3:]
    assert lines == [
        "after cleanup: this AsyncSGLTransformer was cleaned up; create a new one",
        "children: 0",
        "threads: ['MainThread']",
    ]
