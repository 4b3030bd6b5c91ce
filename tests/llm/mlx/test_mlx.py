"""AsyncMlxLM (MLX's CPU build on Linux): against transformers on the same float32 weights,
and every cached, batched, deduplicated, resampled or evicted path against a plain mlx-lm
forward pass that the test runs itself (no cache, one row).

Tolerances: the cached paths run the same float32 arithmetic as a plain forward
pass but with other shapes (batch rows, padded key/value slots); on the tiny
random Llama they were measured identical (0.0), and we allow 1e-5. MLX against
transformers on the same weights (both normalised by torch's float32
log-softmax): measured at most 2e-6 on the tiny Llama (we allow 1e-5; its float32
rows are within 8e-7 of a float64 copy's, so other CPUs' kernels cannot move them
near 1e-5). On SmolLM2 (30 layers, logits O(10)) float32 rounding depends on the
CPU's kernels at the 1e-4 to 1e-3 scale: its test compares with a float64 copy,
within a tolerance measured in the test (see it).
"""

import asyncio
import json
import threading

import pytest

mx = pytest.importorskip("mlx.core", reason="the MLX tests need genlm-backend[mlx]")
mlx_lm = pytest.importorskip("mlx_lm")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from genlm.backend.llm import load_model_by_name  # noqa: E402
from genlm.backend.llm.mlx import AsyncMlxLM  # noqa: E402

TINY_ATOL = 1e-5
VOCAB = 49152


def random_ids(seed, n, vocab=VOCAB):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def mlx_reference(model, ids):
    """Log-probabilities from one plain mlx-lm forward pass (no cache), log-softmax in float32."""
    return mlx_reference_rows(model, ids)[-1]


def mlx_reference_rows(model, ids):
    """The same after every prefix of `ids` (row i: after `ids[: i + 1]`), from one pass."""
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    return torch.log_softmax(torch.from_numpy(np.array(logits)), dim=-1)


def hf_reference(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)


def assert_close(result, reference, atol=TINY_ATOL):
    assert result.dtype == torch.float32 and result.shape == reference.shape
    torch.testing.assert_close(result, reference, rtol=0, atol=atol)


@pytest.fixture(scope="module")
def plain(tiny_llama_path):
    """The tiny Llama loaded by mlx-lm alone: the reference the backend is checked against."""
    model, _ = mlx_lm.load(str(tiny_llama_path))
    return model


@pytest.fixture(scope="module")
def shared_lm(tiny_llama_path):
    return AsyncMlxLM.from_name(str(tiny_llama_path))


@pytest.fixture
def lm(shared_lm):
    shared_lm.clear_cache()
    shared_lm.batch_size, shared_lm.timeout = 20, 0.02
    yield shared_lm
    shared_lm.reset_async_queries()


class Spy:
    """Stands in for a part of the model (its body, `model.model`, by default) and records
    the shape of every input: for the body, every batch of input ids."""

    def __init__(self, lm, part="model"):
        self.wrapped, self.owner, self.part, self.shapes = lm.model[part], lm.model, part, []
        self.owner[part] = self

    def __call__(self, inputs, *args, **kwargs):
        self.shapes.append(tuple(inputs.shape))
        return self.wrapped(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.wrapped, name)

    def close(self):
        self.owner[self.part] = self.wrapped


def test_agrees_with_transformers_on_the_same_weights(lm, tiny_llama_path):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    ids = random_ids(0, 7)
    result = lm.next_token_logprobs_sync(ids)
    assert result.shape == (lm.vocab_size,) == (VOCAB,)
    assert abs(float(torch.logsumexp(result.double(), 0))) < 1e-5
    assert_close(result, hf_reference(hf, ids))


async def test_concurrent_queries_with_different_cached_prefixes(lm, plain):
    prompt = random_ids(1, 30)
    lm.cache_kv(prompt[:10])
    lm.cache_kv(prompt[:25])
    contexts = [
        prompt[:12],  # 10 cached, 2 new
        prompt[:25] + [5],  # 25 cached, 1 new
        prompt[:25] + random_ids(2, 4),  # 25 cached, 4 new
        prompt,  # 25 cached, 5 new
        random_ids(3, 6),  # nothing cached
        prompt[:3],  # inside a cached edge
    ]
    spy = Spy(lm)
    try:
        results = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
    finally:
        spy.close()
    # Rows of 2-6 new tokens from different prefixes share a batch, padded to 6; the two
    # one-token rows run apart (padding them to 6 would cost more than they do).
    assert spy.shapes == [(2, 1), (4, 6)]
    for context, result in zip(contexts, results, strict=True):
        assert_close(result, mlx_reference(plain, context))


async def test_cached_prefix_runs_only_the_new_tokens_and_duplicates_once(lm, plain):
    prompt = random_ids(4, 20)
    lm.cache_kv(prompt)
    spy = Spy(lm)
    try:
        results = await asyncio.gather(
            *(lm.next_token_logprobs(prompt + [11, 12]) for _ in range(4))
        )
        again = await lm.next_token_logprobs(prompt + [11, 12])  # from the result cache
    finally:
        spy.close()
    assert spy.shapes == [(1, 2)]
    for result in [*results, again]:
        assert_close(result, mlx_reference(plain, prompt + [11, 12]))


async def run_smc(lm, plain, n, steps, seed, resample_every=3, lockstep=False):
    """Particles that grow by one or two tokens per step (one with `lockstep`) and get resampled."""
    generator = torch.Generator().manual_seed(seed)
    particles = [random_ids(seed, 16) for _ in range(n)]
    checked = 0
    for step in range(steps):
        results = await asyncio.gather(*(lm.next_token_logprobs(p) for p in particles))
        for particle, result in zip(particles, results, strict=True):
            assert_close(result, mlx_reference(plain, particle))
            checked += 1
        for i, particle in enumerate(particles):
            extra = 1 if lockstep else 1 + (i + step) % 2
            particle.extend(torch.randint(0, VOCAB, (extra,), generator=generator).tolist())
        if step % resample_every == resample_every - 1:
            ancestors = torch.randint(0, n, (n,), generator=generator).tolist()
            particles = [list(particles[a]) for a in ancestors]
    return checked


async def test_nested_and_shared_contexts_cost_their_distinct_new_tokens(lm, plain):
    sequence = random_ids(30, 36)
    prefixes = [sequence[:n] for n in range(1, 37)]
    prompt = random_ids(31, 40)
    particles = [prompt + random_ids(32 + i, 2) for i in range(4)]
    spy = Spy(lm)
    try:
        scored = await lm.batch_next_token_logprobs(prefixes)  # every prefix: one row
        shared = await lm.batch_next_token_logprobs(particles)  # the prompt runs once, first
    finally:
        spy.close()
    assert spy.shapes == [(1, 36), (1, 40), (4, 2)]
    for contexts, rows in ((prefixes, scored), (particles, shared)):
        for context, row in zip(contexts, rows, strict=True):
            assert_close(row, mlx_reference(plain, context))


async def test_prefixes_inside_a_cached_prompt_recompute_it_as_a_cold_batch_would(lm, plain):
    # Every prefix of three sequences that extend a 50-token prompt, 30 tokens of it cached:
    # the 29 prefixes ending inside the cached part would cost more as one-token rows of their
    # own than the 30 tokens recomputed (`_ALONE_COST`), so the prompt runs as one 50-token
    # row, as it does cold (one pass padding them to the 20 uncached tokens took 4x cold). The
    # output projection runs once per pass, only at the 139 positions read (prompt[:30]'s
    # result is cached).
    prompt = random_ids(70, 50)
    sequences = [prompt + random_ids(71 + i, 30) for i in range(3)]
    lm.cache_kv(prompt[:30])
    body, head = Spy(lm), Spy(lm, "lm_head")
    try:
        rows = await lm.batch_next_token_logprobs(
            [sequence[:n] for sequence in sequences for n in range(1, 81)]
        )
    finally:
        body.close()
        head.close()
    assert body.shapes == [(1, 50), (3, 30)]
    assert head.shapes == [(49, 128), (90, 128)]
    for i, sequence in enumerate(sequences):
        assert_close(rows[80 * i : 80 * (i + 1)], mlx_reference_rows(plain, sequence))


@pytest.mark.parametrize("family", ["llama", "granite"])
async def test_tied_and_other_output_heads_match_a_plain_forward(lm, family):
    # A Llama with tied embeddings projects the positions read with its input embeddings;
    # granite (scaled logits) has no plain head: it runs whole, its logits gathered after.
    from mlx_lm.models import granite, llama

    sizes = dict(
        model_type=family,
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
    )
    mx.random.seed(2)
    if family == "llama":
        model = llama.Model(llama.ModelArgs(**sizes, tie_word_embeddings=True))
    else:
        args = granite.ModelArgs(
            **sizes,
            logits_scaling=4.0,
            attention_multiplier=0.25,
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            max_position_embeddings=2048,
            attention_bias=False,
            mlp_bias=False,
            rope_theta=10000.0,
        )
        model = granite.Model(args)
    small = AsyncMlxLM(model, lm.tokenizer)
    sequence = random_ids(80, 24)
    small.cache_kv(sequence[:10])
    rows = await small.batch_next_token_logprobs([sequence[:n] for n in range(1, 25)])
    assert_close(rows, mlx_reference_rows(model, sequence))


async def test_resampled_particles_of_different_lengths_match_a_plain_forward(lm, plain):
    assert await run_smc(lm, plain, n=5, steps=7, seed=6) == 35
    assert len(lm.kv_cache) > 0


async def test_lockstep_particles_continue_the_last_batch_at_one_token_each(lm, plain, monkeypatch):
    # The SMC pattern: every step extends each particle by one token. After the first
    # step the batch continues in the last batch's arrays (rows reordered after resampling)
    # instead of gathering prefixes from the tree, and runs one token per distinct particle.
    from genlm.backend.llm.mlx import runtime

    gathers = []
    original = runtime.gather_layers
    monkeypatch.setattr(
        runtime, "gather_layers", lambda *args: gathers.append(1) or original(*args)
    )
    spy = Spy(lm)
    try:
        assert (
            await run_smc(lm, plain, n=4, steps=9, seed=11, resample_every=4, lockstep=True) == 36
        )
    finally:
        spy.close()
    assert len(gathers) == 1
    assert spy.shapes[0] == (1, 16)  # the particles start equal: one row
    assert all(rows <= 4 and new == 1 for rows, new in spy.shapes[1:])


async def test_tiny_budget_evicts_and_stays_exact(tiny_llama_path, plain):
    lm = AsyncMlxLM.from_name(str(tiny_llama_path), kv_cache_bytes=40_000)
    assert await run_smc(lm, plain, n=4, steps=6, seed=7) == 24
    assert lm.kv_cache.peak_nbytes <= 40_000


@pytest.mark.parametrize(
    "bad",
    [[], [VOCAB], [-1], [1.5], "abc", [[1, 2]], list(range(2049))],
    ids=["empty", "too-large", "negative", "float", "str", "nested", "too-long"],
)
async def test_bad_input_raises_value_error_and_spares_the_batch(lm, plain, bad):
    good = random_ids(8, 5)
    with pytest.raises(ValueError):
        await asyncio.gather(lm.next_token_logprobs(good), lm.next_token_logprobs(bad))
    with pytest.raises(ValueError):
        lm.next_token_logprobs_sync(bad)
    assert_close(await lm.next_token_logprobs(good), mlx_reference(plain, good))


async def test_reset_async_queries_cancels_waiting_callers(lm):
    lm.timeout = 10.0
    waiting = asyncio.ensure_future(lm.next_token_logprobs(random_ids(9, 4)))
    await asyncio.sleep(0)  # queued; its batch would run after the next pass of the loop
    lm.reset_async_queries()
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def test_batch_calls_sampling_and_attributes(lm, plain):
    contexts = [random_ids(10, 4), random_ids(11, 9), random_ids(10, 4)]
    lm.batch_size = 3
    assert lm.batch_size == 3
    for rows in (
        await lm.batch_next_token_logprobs(contexts),
        lm.batch_next_token_logprobs_sync(contexts),
    ):
        assert rows.shape == (3, VOCAB)
        for row, context in zip(rows, contexts, strict=True):
            assert_close(row, mlx_reference(plain, context))
    for rows in (await lm.batch_next_token_logprobs([]), lm.batch_next_token_logprobs_sync([])):
        assert rows.shape == (0, VOCAB) and rows.dtype == torch.float32

    prompt = random_ids(12, 5)
    first = await lm.sample(prompt, max_tokens=6, eos_token_ids=[], seed=3)
    assert first == await lm.sample(prompt, max_tokens=6, eos_token_ids=[], seed=3)
    assert len(first) == 6
    batch = await lm.batch_sample([prompt, prompt], max_tokens=4, eos_token_ids=[], seed=3)
    assert batch[0] == first[:4]


async def test_results_belong_to_the_caller(lm, plain):
    context = random_ids(13, 6)
    reference = mlx_reference(plain, context)
    first, twin = await asyncio.gather(
        lm.next_token_logprobs(context), lm.next_token_logprobs(context)
    )
    first.fill_(0.0)
    assert_close(twin, reference)
    again = await lm.next_token_logprobs(context)  # served by the output cache
    again.fill_(1.0)
    lm.next_token_logprobs_sync(context).fill_(2.0)
    assert_close(await lm.next_token_logprobs(context), reference)


def test_two_threads_with_their_own_loops_share_the_model(lm, plain):
    contexts = {t: [random_ids(50 + t * 10 + i, 3 + i) for i in range(4)] for t in (0, 1)}
    outcomes: dict[int, list] = {}
    barrier = threading.Barrier(2)

    def worker(t):
        async def run():
            barrier.wait()
            return await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts[t]))

        outcomes[t] = asyncio.run(run())

    threads = [threading.Thread(target=worker, args=(t,)) for t in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for t in (0, 1):
        for context, result in zip(contexts[t], outcomes[t], strict=True):
            assert_close(result, mlx_reference(plain, context))


def test_half_precision_log_softmax_is_taken_in_float32(tiny_llama_path):
    model, tokenizer = mlx_lm.load(str(tiny_llama_path))
    model.set_dtype(mx.bfloat16)
    lm = AsyncMlxLM(model, tokenizer)
    context = random_ids(14, 8)
    result = lm.next_token_logprobs_sync(context)
    assert result.dtype == torch.float32
    assert abs(float(torch.logsumexp(result.double(), dim=0))) < 1e-5
    # Same bfloat16 weights: the float32 log-softmax of the same logits (measured 0.0).
    assert_close(result, mlx_reference(model, context))
    # Cached bfloat16 key/values (stored as CPU tensors) serve the next step.
    assert lm.kv_cache.nbytes > 0
    step = lm.next_token_logprobs_sync(context + [3])
    assert_close(step, mlx_reference(model, context + [3]), atol=1e-2)


@pytest.fixture(scope="module")
def peft_adapters(tiny_llama_path, tmp_path_factory):
    """Two saved peft adapters and, for each, the merged transformers model (the reference)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    folders, merged = {}, {}
    for name, seed in (("a", 0), ("b", 1)):
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(tiny_llama_path)
        config = LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False
        )
        folders[name] = tmp_path_factory.mktemp(f"lora_{name}")
        get_peft_model(base, config).save_pretrained(folders[name])
        fresh = AutoModelForCausalLM.from_pretrained(tiny_llama_path)
        merged[name] = PeftModel.from_pretrained(fresh, folders[name]).merge_and_unload().eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_path).eval()
    return folders, {**merged, None: base}


@pytest.fixture
def lora_lm(tiny_llama_path, peft_adapters):
    folders, _ = peft_adapters
    lm = AsyncMlxLM.from_name(str(tiny_llama_path), batch_size=100, timeout=0.05)
    lm.add_new_lora(str(folders["a"]), "a")
    lm.add_new_lora(str(folders["b"]), "b")
    return lm


async def test_adapters_and_base_in_one_window_each_match_the_merged_model(peft_adapters, lora_lm):
    _, references = peft_adapters
    prompt = random_ids(40, 10)
    lora_lm.cache_kv(prompt, lora_name="a")
    contexts = [prompt + [5], prompt + [6, 7], random_ids(41, 4)]
    for active in (None, "b"):  # what lora_name=None means follows set_lora
        if active is not None:
            lora_lm.set_lora(lora_name=active)
        calls = [(c, name) for c in contexts for name in ("a", "b", None)]
        results = await asyncio.gather(
            *(lora_lm.next_token_logprobs(c, lora_name=name) for c, name in calls)
        )
        for (context, name), result in zip(calls, results, strict=True):
            reference = references[active if name is None else name]
            assert_close(result, hf_reference(reference, context))
    assert not torch.allclose(
        hf_reference(references["a"], contexts[0]),
        hf_reference(references[None], contexts[0]),
        atol=1e-3,
    )
    sampled = await lora_lm.sample(prompt, 5, [], seed=3, lora_name="a")
    lora_lm.set_lora(lora_name="a")
    assert sampled == await lora_lm.sample(prompt, 5, [], seed=3)


async def test_per_call_adapter_reuses_its_own_prefix_only(lora_lm):
    prompt = random_ids(42, 16)
    lora_lm.cache_kv(prompt, lora_name="a")
    spy = Spy(lora_lm)
    try:
        await lora_lm.next_token_logprobs(prompt + [9], lora_name="a")
        await lora_lm.next_token_logprobs(prompt + [9], lora_name="b")
    finally:
        spy.close()
    assert spy.shapes == [(1, 1), (1, len(prompt) + 1)]


async def test_replacing_and_removing_adapters(peft_adapters, lora_lm, plain):
    folders, references = peft_adapters
    context = random_ids(44, 7)
    old = await lora_lm.next_token_logprobs(context, lora_name="a")
    assert_close(old, hf_reference(references["a"], context))
    lora_lm.add_new_lora(str(folders["b"]), "a")  # "a" now holds b's weights
    assert_close(
        await lora_lm.next_token_logprobs(context, lora_name="a"),
        hf_reference(references["b"], context),
    )
    before = lora_lm.kv_cache.nbytes
    lora_lm.set_lora(lora_name="a")
    lora_lm.remove_lora("a")
    assert lora_lm.loras.names == ["b"] and lora_lm.loras.active is None
    assert lora_lm.kv_cache.nbytes < before
    with pytest.raises(ValueError, match=r"no LoRA adapter named 'a'; registered adapters: 'b'"):
        await lora_lm.next_token_logprobs(context, lora_name="a")
    with pytest.raises(ValueError, match="registered adapters: 'b'"):
        lora_lm.remove_lora("a")
    lora_lm.remove_lora("b")
    with pytest.raises(ValueError, match="registered adapters: none"):
        lora_lm.next_token_logprobs_sync(context, lora_name="b")
    assert_close(await lora_lm.next_token_logprobs(context), mlx_reference(plain, context))


@pytest.mark.parametrize("kept", [("b",), ()], ids=["one-of-two", "the-last"])
async def test_removing_an_adapter_while_its_query_waits_fails_only_that_query(
    peft_adapters, lora_lm, kept
):
    # MLX's LoRA layers run the base weights for a name they no longer hold: without the
    # check the removed adapter's query would get the base model's row, silently.
    _, references = peft_adapters
    if not kept:
        lora_lm.remove_lora("b")
    contexts = [random_ids(45, 6), random_ids(46, 5), random_ids(47, 4)]
    calls = [(contexts[0], "a"), (contexts[1], None)] + [(contexts[2], name) for name in kept]

    async def remove_after_one_turn():
        await asyncio.sleep(0)
        lora_lm.remove_lora("a")

    results = await asyncio.gather(
        *(lora_lm.next_token_logprobs(c, lora_name=name) for c, name in calls),
        remove_after_one_turn(),
        return_exceptions=True,
    )
    assert isinstance(results[0], ValueError)
    assert "LoRA adapter 'a' was removed while this query waited" in str(results[0])
    for (context, name), result in zip(calls[1:], results[1:], strict=False):
        assert_close(result, hf_reference(references[name], context))


def test_mlx_lm_adapter_matches_mlx_lm_own_lora(tiny_llama_path, tmp_path, plain):
    # An adapter in mlx-lm's own format (as `mlx_lm.lora` writes it), checked against the
    # model `mlx_lm.load(..., adapter_path=...)` builds with mlx-lm's LoRA layers.
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = mlx_lm.load(str(tiny_llama_path))
    model.freeze()
    parameters = {
        "rank": 4,
        "scale": 3.0,
        "dropout": 0.0,
        "keys": ["self_attn.q_proj", "mlp.up_proj"],
    }
    linear_to_lora_layers(model, 2, parameters)
    mx.random.seed(0)
    weights = {
        name: mx.random.normal(value.shape) * 0.05
        for name, value in tree_flatten(model.trainable_parameters())
    }
    mx.save_safetensors(str(tmp_path / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": parameters}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    reference, _ = mlx_lm.load(str(tiny_llama_path), adapter_path=str(tmp_path))

    lm = AsyncMlxLM.from_name(str(tiny_llama_path))
    lm.set_lora(str(tmp_path), "mine")
    context = random_ids(45, 9)
    assert_close(lm.next_token_logprobs_sync(context), mlx_reference(reference, context))
    assert not torch.allclose(
        mlx_reference(reference, context), mlx_reference(plain, context), atol=1e-3
    )

    config["fine_tune_type"] = "dora"
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="not a LoRA"):
        lm.add_new_lora(str(tmp_path), "dora")
    assert lm.loras.names == ["mine"]


async def test_smollm2_agrees_with_transformers(smollm2_path, float64_reference):
    """SmolLM2 in MLX (a cached prompt, then two continuations) against a float64
    transformers copy of the same weights.

    MLX and transformers round float32 differently (other kernels, and MLX runs the cached
    prompt and the new tokens in passes of other lengths), by amounts that depend on the
    CPU: on an AMD EPYC, MLX's rows differ from transformers' float32 ones by up to 6.1e-5,
    and transformers' own rows for these contexts by up to 3.4e-5 between one pass and a
    split before the last token (4.6e-5: one token at a time); SmolLM2's float32 rows varied
    by 1.46e-3 with the pass length on an Intel Xeon with AMX, more than this test's old 1e-4.
    So the reference is the float64 model, whose own rounding is negligible, and the
    tolerance is measured in the test: `error`, the float32 transformers model's largest
    difference from it over these contexts, in one pass and split before the last token
    (4.0e-5 on the AMD EPYC), is how far float32 rounding takes these rows on this machine;
    other kernels for the same arithmetic round by about as much (MLX's rows: 4.8e-5 there).
    We allow 3x that plus 2e-5 (a few float32 ulps of log-probabilities down to -40): 1.4e-4
    on the AMD EPYC. MLX's own error is left out of the tolerance: a mistake in MLX's model
    (a wrong RoPE base: ~4 nats) must not widen it.
    """
    # The SmolLM2 folder's config is in transformers 5's format (`rope_parameters`), which
    # mlx-lm alone reads with the wrong RoPE base (off by ~4 nats); from_name translates it.
    lm = load_model_by_name(str(smollm2_path), backend="mlx")
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    prompt = lm.tokenizer.encode("The capital of France is")
    lm.cache_kv(prompt)
    contexts = [prompt + lm.tokenizer.encode(" Paris"), prompt + lm.tokenizer.encode(" a city")]
    results = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
    contexts = [prompt, *contexts]
    results = [lm.next_token_logprobs_sync(prompt), *results]
    references, tolerance = float64_reference(hf, contexts)
    for result, reference in zip(results, references, strict=True):
        assert result.dtype == torch.float32 and result.shape == reference.shape
        torch.testing.assert_close(result.double(), reference, rtol=0, atol=tolerance)
    assert lm.str_vocab[int(lm.next_token_logprobs_sync(prompt).argmax())] == " Paris"


async def test_sliding_window_layers_see_only_their_window(lm, tiny_llama_path):
    # A random Llama whose first layer attends to the last 4 positions only: cached,
    # ragged and padded rows must apply that window at every row's true positions.
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
    )
    mx.random.seed(1)
    model = llama.Model(args)
    windowed = AsyncMlxLM(model, lm.tokenizer)
    prompt = random_ids(60, 10)
    windowed.cache_kv(prompt)
    contexts = [prompt + [1], prompt + [2, 3], prompt[:6] + [4], random_ids(61, 3)]
    results = await asyncio.gather(*(windowed.next_token_logprobs(c) for c in contexts))
    for context, result in zip(contexts, results, strict=True):
        assert_close(result, mlx_reference(model, context))


def test_models_that_are_not_attention_only_are_refused():
    from mlx_lm.models import mamba

    args = mamba.ModelArgs(
        model_type="mamba",
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        state_size=4,
        num_hidden_layers=1,
        conv_kernel=2,
        use_bias=False,
        use_conv_bias=True,
        time_step_rank=2,
    )
    with pytest.raises(ValueError, match="attention-only"):
        AsyncMlxLM(mamba.Model(args), None)
