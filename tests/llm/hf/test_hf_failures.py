"""AsyncTransformer when a query cannot run as asked: long chains past the working-memory
bound, contexts too long for it, adapters removed while their queries wait, and forward
passes that run out of memory. Every row that comes back is checked against one plain
forward pass over the whole sequence (or `next_token_logprobs_uncached`), with the
tolerances of `test_hf.py` (float32 on the CPU: 1.9e-6 measured, 1e-5 allowed); SmolLM2's
rows against plain passes over the same segments (see its test for why).
"""

import asyncio
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from genlm.backend.llm.hf import AsyncTransformer

ATOL = 1e-5  # the CPU tolerance of tests/llm/hf/test_hf.py (TINY_ATOL)


def random_ids(seed, n, vocab=49152):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def plain_rows(model, sequence):
    """Next-token log-probabilities after every prefix of `sequence`: one plain forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_exact(lm, contexts, rows):
    for context, row in zip(contexts, rows, strict=True):
        reference = lm.next_token_logprobs_uncached(context)
        torch.testing.assert_close(row, reference, rtol=0, atol=ATOL)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def model_and_tokenizer(request, tiny_gpt2_path, tiny_llama_path):
    path = tiny_gpt2_path if request.param == "gpt2" else tiny_llama_path
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


class Passes:
    """Records each forward pass's input shape; makes chosen passes run out of memory.

    The error is raised by the output layer, after every attention layer has
    written its key/values into the batch buffer: what a real failure late in a
    pass leaves behind.

    Args:
        lm: The backend.
        failing: Numbers of the passes (from 1) that fail.
        when: Also fail every pass whose new tokens satisfy this predicate.
        error: Makes the exception raised.
    """

    def __init__(self, lm, failing=(), when=None, error=None):
        self.shapes, self.failed, self.count = [], [], 0
        self._inputs = None
        self._failing, self._when = set(failing), when
        self._error = error or (lambda: torch.OutOfMemoryError("CUDA out of memory (injected)"))
        self._handles = [
            lm.model.get_input_embeddings().register_forward_hook(self._record),
            lm.model.get_output_embeddings().register_forward_hook(self._maybe_fail),
        ]

    def _record(self, module, args, output):
        self.count += 1
        self._inputs = args[0]
        self.shapes.append(tuple(args[0].shape))

    def _maybe_fail(self, module, args, output):
        if self.count in self._failing or (self._when is not None and self._when(self._inputs)):
            self.failed.append(self.count)
            raise self._error()

    def close(self):
        for handle in self._handles:
            handle.remove()


def test_all_prefixes_of_a_long_context_run_in_segments_within_the_bound(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    sequence = random_ids(1, 40)
    lm = AsyncTransformer(model, tokenizer, max_batch_bytes=8 * 2**20)
    # One pass cannot hold the row.
    assert lm._passes.memory.working_set(1, 40, 40, 40) > lm.max_batch_bytes // 2
    passes = Passes(lm)
    try:
        rows = lm.batch_next_token_logprobs_sync([sequence[:n] for n in range(1, 41)])
    finally:
        passes.close()
    torch.testing.assert_close(rows, plain_rows(model, sequence), rtol=0, atol=ATOL)
    # Consecutive segments of the one row, each new token run once.
    assert len(passes.shapes) > 1 and all(rows == 1 for rows, _ in passes.shapes)
    assert sum(tokens for _, tokens in passes.shapes) == 40
    for _, tokens in passes.shapes:
        assert lm._passes.memory.working_set(1, 40, tokens, tokens) <= lm.max_batch_bytes // 2


@pytest.mark.slow
def test_smollm2_scores_every_prefix_in_segments_like_one_forward_pass(smollm2_path, segment_rows):
    """SmolLM2 (30 layers, logits O(10)) scores all 300 prefixes of a sequence in segments.

    The reference runs the plain model over the same segments (boundaries recorded from the
    backend's passes), each continuing a `DynamicCache`, not one pass over all 300 tokens:
    float32 kernels round differently for passes of other lengths, by an amount that depends
    on the CPU. On this sequence the plain model's own rows vary with the pass length by up
    to 5.7e-5 on an AMD EPYC (one pass of 300 tokens against segments 124+109+67, 150+150,
    100*3 or 200+100) and by 1.46e-3 at row 1 on an Intel Xeon with AMX (the first 67 to
    124 tokens against 200 or 300); the float32 rows' own rounding error is 3.1e-3 at row 1
    (against a float64 copy, AMD). Passes over the same segments run the same kernels on the
    same shapes: the backend's rows equal the reference's exactly (0.0 on the AMD EPYC; the
    first segment 0.0 on the Intel Xeon). 1e-4 (the issue's bound for SmolLM2) leaves room
    for an incidental difference in how the two attend to their key/values; a wrong
    position or token moves rows by 0.1 or more (2.1 and 6.2 measured).
    """
    lm = AsyncTransformer.from_name(str(smollm2_path), hf_opts={"dtype": torch.float32})
    sequence = random_ids(60, 300)
    lm.max_batch_bytes = 2 * lm._passes.memory.working_set(1, 300, 100, 100)
    passes = Passes(lm)
    try:
        rows = lm.batch_next_token_logprobs_sync([sequence[:n] for n in range(1, 301)])
    finally:
        passes.close()
    segments = [tokens for _, tokens in passes.shapes]
    assert len(segments) >= 3 and sum(segments) == 300
    reference = segment_rows(lm.model, sequence, segments)
    torch.testing.assert_close(rows.cpu(), reference.cpu(), rtol=0, atol=1e-4)


async def test_a_long_chain_in_a_batch_of_particles_keeps_every_row(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    lm = AsyncTransformer(model, tokenizer, max_batch_bytes=8 * 2**20)
    prompt = random_ids(2, 12)
    lm.cache_kv(prompt)
    particles = [prompt + random_ids(3 + i, 2) for i in range(5)]
    document = random_ids(9, 45)
    contexts = particles + [document[:n] for n in range(1, 46)]
    rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
    torch.testing.assert_close(
        torch.stack(rows[5:]), plain_rows(model, document), atol=ATOL, rtol=0
    )
    assert_exact(lm, particles, rows[:5])
    # The segments joined the tree: one more token runs one token.
    passes = Passes(lm)
    try:
        assert_exact(lm, [document + [7]], [lm.next_token_logprobs_sync(document + [7])])
    finally:
        passes.close()
    assert passes.shapes[0] == (1, 1)


async def test_a_context_too_long_for_the_bound_fails_only_its_caller(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    probe = AsyncTransformer(model, tokenizer)
    bound = 2 * probe._passes.memory.working_set(1, 200, 1, 1)  # 200-token contexts fit, 700 do not
    lm = AsyncTransformer(model, tokenizer, max_batch_bytes=bound)
    contexts = [[1, 2, 3], [4, 5, 6, 7], random_ids(4, 700)]
    results = await asyncio.gather(
        *(lm.next_token_logprobs(c) for c in contexts), return_exceptions=True
    )
    assert isinstance(results[2], ValueError)
    assert "a context of 700 tokens" in str(results[2]) and "raise max_batch_bytes" in str(
        results[2]
    )
    assert_exact(lm, contexts[:2], results[:2])
    # A long context that fits in segments runs, beside short ones, exactly.
    contexts[2] = random_ids(5, 150)
    assert_exact(lm, contexts, await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts)))


async def test_a_bound_that_shrinks_after_submission_fails_only_the_long_query(
    model_and_tokenizer, monkeypatch
):
    # On an accelerator a batch may use at most the memory free when it runs.
    model, tokenizer = model_and_tokenizer
    lm = AsyncTransformer(model, tokenizer)
    contexts = [[1, 2, 3], [4, 5, 6, 7], random_ids(6, 700)]
    # The short ones fit, one token after 700 does not.
    limit = lm._passes.memory.working_set(1, 700, 1, 1) - 1
    monkeypatch.setattr(lm._passes.memory, "batch_limit", lambda: limit)
    results = await asyncio.gather(
        *(lm.next_token_logprobs(c) for c in contexts), return_exceptions=True
    )
    assert isinstance(results[2], ValueError) and "a context of 700 tokens" in str(results[2])
    assert (None, tuple(contexts[2])) not in lm.output_cache
    assert_exact(lm, contexts[:2], results[:2])


@pytest.fixture(scope="module")
def two_adapters(tiny_llama_path, tmp_path_factory):
    """Folders of adapters "a" and "b" of the tiny Llama, and the merged reference models."""
    from peft import LoraConfig, get_peft_model

    folders, merged = {}, {}
    for seed, name in enumerate("ab"):
        torch.manual_seed(50 + seed)
        base = AutoModelForCausalLM.from_pretrained(tiny_llama_path)
        config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        peft_model = get_peft_model(base, config)
        folders[name] = tmp_path_factory.mktemp(f"adapter_{name}")
        peft_model.save_pretrained(folders[name])
        merged[name] = peft_model.merge_and_unload().eval()
    return folders, merged


def adapter_lm(tiny_llama_path, folders, names):
    lm = AsyncTransformer(
        AutoModelForCausalLM.from_pretrained(tiny_llama_path),
        AutoTokenizer.from_pretrained(tiny_llama_path),
    )
    for name in names:
        lm.add_new_lora(str(folders[name]), name)
    return lm


@pytest.mark.parametrize("names", [("a", "b"), ("a",)], ids=["one-of-two", "the-last"])
async def test_removing_an_adapter_while_its_query_waits_fails_only_that_query(
    tiny_llama_path, two_adapters, names
):
    folders, merged = two_adapters
    lm = adapter_lm(tiny_llama_path, folders, names)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_path).eval()
    contexts = [random_ids(7, 6), random_ids(8, 5), random_ids(9, 4)]

    async def remove_after_one_turn():
        await asyncio.sleep(0)
        lm.remove_lora("a")

    calls = [(contexts[0], "a"), (contexts[1], None)]
    if "b" in names:
        calls.append((contexts[2], "b"))
    results = await asyncio.gather(
        *(lm.next_token_logprobs(c, lora_name=name) for c, name in calls),
        remove_after_one_turn(),
        return_exceptions=True,
    )
    assert isinstance(results[0], ValueError)
    assert "LoRA adapter 'a' was removed while this query waited" in str(results[0])
    references = {None: base, **merged}
    for (context, name), result in zip(calls[1:], results[1:], strict=False):
        torch.testing.assert_close(
            result, plain_rows(references[name], context)[-1], rtol=0, atol=ATOL
        )


@pytest.fixture
def lm(model_and_tokenizer):
    return AsyncTransformer(*model_and_tokenizer)


def assert_cache_holds_only_exact_rows(lm):
    keys = list(lm.output_cache._entries)
    assert keys
    for key in keys:
        reference = lm.next_token_logprobs_uncached(key[1], lora_name=key[0])
        torch.testing.assert_close(lm.output_cache.get(key), reference, rtol=0, atol=ATOL)


async def test_out_of_memory_in_the_first_pass_is_retried_in_halves(lm, caplog):
    prompt = random_ids(10, 12)
    lm.cache_kv(prompt)
    contexts = [prompt + random_ids(11 + i, 3) for i in range(6)]
    # The first pass continues the prompt's batch (`cache_kv` keeps it); out of memory,
    # it reruns from the tree, and out of memory again, in halves.
    passes = Passes(lm, failing={1, 2})
    try:
        with caplog.at_level(logging.WARNING, logger="genlm.backend.llm.hf.memory"):
            rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
    finally:
        passes.close()
    assert passes.failed == [1, 2] and passes.shapes == [(6, 3), (6, 3), (3, 3), (3, 3)]
    assert_exact(lm, contexts, rows)
    warnings = [r for r in caplog.records if "ran out of memory" in r.getMessage()]
    assert len(warnings) == 1 and "max_batch_bytes=" in warnings[0].getMessage()
    assert_cache_holds_only_exact_rows(lm)


async def test_out_of_memory_in_a_second_sub_batch(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    probe = AsyncTransformer(model, tokenizer)
    bound = 2 * probe._passes.memory.working_set(3, 30, 30, 3)
    lm = AsyncTransformer(model, tokenizer, max_batch_bytes=bound)
    contexts = [random_ids(20 + i, 30) for i in range(8)]
    passes = Passes(lm, failing={2})
    try:
        rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
    finally:
        passes.close()
    assert passes.failed == [2] and len(passes.shapes) > 3
    assert_exact(lm, contexts, rows)
    assert_cache_holds_only_exact_rows(lm)


async def test_out_of_memory_in_a_continued_sampler_step(lm):
    prompt = random_ids(30, 10)
    particles = [prompt + [i] for i in range(4)]
    await asyncio.gather(*(lm.next_token_logprobs(p) for p in particles))
    for step, failing in enumerate(({1}, {1, 2}, set())):
        # Resampled: rows copied inside the buffer before the pass fails (step 1).
        ancestors = [0, 1, 2, 3] if step != 1 else [1, 1, 0, 2]
        particles = [particles[a] + [10 * step + i] for i, a in enumerate(ancestors)]
        passes = Passes(lm, failing=failing)
        try:
            rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in particles))
        finally:
            passes.close()
        assert passes.failed == sorted(failing)
        assert_exact(lm, particles, rows)
    assert_cache_holds_only_exact_rows(lm)


async def test_out_of_memory_in_a_trunk_pass_and_in_a_chain(lm):
    prompt = random_ids(40, 40)  # uncached and shared by every row: a pass of its own
    contexts = [prompt + random_ids(41 + i, 2) for i in range(4)]
    contexts += [contexts[0][:n] for n in range(41, 42)]  # a prefix read from a row
    passes = Passes(lm, failing={1, 2})
    try:
        rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
    finally:
        passes.close()
    assert passes.shapes[:2] == [(1, 40), (1, 20)]  # the trunk, then its first half
    assert_exact(lm, contexts, rows)
    sequence = random_ids(42, 24)
    passes = Passes(lm, failing={1})
    try:
        rows = lm.batch_next_token_logprobs_sync([sequence[:n] for n in range(1, 25)])
    finally:
        passes.close()
    assert passes.shapes == [(1, 24), (1, 12), (1, 12)]
    torch.testing.assert_close(rows, plain_rows(lm.model, sequence), rtol=0, atol=ATOL)
    assert_cache_holds_only_exact_rows(lm)


@pytest.mark.parametrize(
    "error",
    [
        lambda: torch.OutOfMemoryError("CUDA out of memory (injected)"),
        lambda: MemoryError(),
        lambda: RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to ..."),
    ],
    ids=["cuda", "python", "cpu-allocator"],
)
async def test_a_row_that_cannot_run_fails_only_its_callers(lm, error):
    poison = 77
    contexts = [random_ids(50 + i, 5) for i in range(5)]
    contexts[3] = contexts[3] + [poison]
    passes = Passes(lm, when=lambda ids: bool((ids == poison).any()), error=error)
    try:
        results = await asyncio.gather(
            *(lm.next_token_logprobs(c) for c in contexts),
            lm.next_token_logprobs(contexts[3]),  # a second caller of the same query
            return_exceptions=True,
        )
    finally:
        passes.close()
    expected = type(error())
    assert isinstance(results[3], expected) and isinstance(results[5], expected)
    assert (None, tuple(contexts[3])) not in lm.output_cache
    survivors = [0, 1, 2, 4]
    assert_exact(lm, [contexts[i] for i in survivors], [results[i] for i in survivors])
    assert_cache_holds_only_exact_rows(lm)
    assert_exact(lm, [contexts[3]], [await lm.next_token_logprobs(contexts[3])])


def test_other_errors_still_reach_the_whole_batch(lm):
    passes = Passes(lm, failing={1}, error=lambda: RuntimeError("device lost"))
    try:
        with pytest.raises(RuntimeError, match="device lost"):
            lm.batch_next_token_logprobs_sync([[1, 2], [3, 4, 5]])
    finally:
        passes.close()
    assert passes.shapes == [(2, 3)] and len(lm.output_cache) == 0
