"""Shared fixtures: real assets materialised by `python -m genlm.backend.assets`."""

import copy
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from genlm.backend import assets  # noqa: E402 - the environment above must be set first

# vLLM on CUDA takes 90% of the GPU per engine unless told otherwise, so a second engine in
# one process fails to start. Tests' engines take 15% each: the three a vLLM module holds at
# once (45%) fit beside SGLang's test engine (30%) and the transformers models.
VLLM_GPU_MEMORY_UTILIZATION = 0.15


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct, float32 Hugging Face folder."""
    return assets.smollm2(fetch=False)


@pytest.fixture(scope="session")
def tiny_gpt2_path() -> Path:
    """A 2-layer random GPT-2 over the GPT-2 tokenizer."""
    return assets.tiny_model("gpt2", fetch=False)


@pytest.fixture(scope="session")
def tiny_llama_path() -> Path:
    """A 2-layer random Llama (4 heads, 2 KV heads) over SmolLM2's tokenizer."""
    return assets.tiny_model("llama", fetch=False)


@pytest.fixture(scope="session")
def tiny_llama_reference(tiny_llama_path: Path) -> Callable[[Sequence[int]], torch.Tensor]:
    """`reference(token_ids)`: the tiny Llama's next-token row from an uncached float32
    transformers pass (on the CPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from genlm.backend.llm.hf import AsyncTransformer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    hf_lm = AsyncTransformer(model, AutoTokenizer.from_pretrained(tiny_llama_path))
    return lambda token_ids: hf_lm.next_token_logprobs_uncached(list(token_ids)).float().cpu()


@pytest.fixture(scope="session")
def tokenizer_path() -> Callable[[str], Path]:
    """Factory: tokenizer family name (see `assets.TOKENIZERS`) to its folder."""

    def folder(name: str) -> Path:
        return assets.tokenizer(name, fetch=False)

    return folder


@pytest.fixture(scope="session")
def vllm_engine_opts() -> Callable[[dict], dict]:
    """Factory: `engine_opts` for a test's vLLM engine, with a GPU share on CUDA.

    On CUDA it adds `gpu_memory_utilization` (unless given), so that several engines share
    one GPU; elsewhere it returns the options unchanged (on the CPU build that key would
    replace `from_name`'s own key/value memory size).
    """

    def opts(engine_opts: dict) -> dict:
        if torch.cuda.is_available():
            return {"gpu_memory_utilization": VLLM_GPU_MEMORY_UTILIZATION, **engine_opts}
        return dict(engine_opts)

    return opts


@pytest.fixture
def engine_rounds(monkeypatch) -> Callable:
    """Factory: spies on an `AsyncVirtualLM`'s engine; returns its list of admission rounds.

    A round is the contexts of the requests added to the engine between two of its steps
    (a live request resumed: its whole context): requests of one round share the engine's
    next step.
    """

    def spy_on(lm) -> list[list[tuple[int, ...]]]:
        engine = lm.llm_engine.llm_engine
        add_request, step = engine.add_request, engine.step
        live = lm._engine._live
        rounds: list[list[tuple[int, ...]]] = []
        arrived: list[tuple[int, ...]] = []

        def spied_add_request(request_id, prompt, *args, **kwargs):
            arrived.append(tuple(prompt["prompt_token_ids"]))
            return add_request(request_id, prompt, *args, **kwargs)

        if live is not None:
            add_live = live.add

            def spied_add_live(token_ids, *args, **kwargs):
                arrived.append(tuple(token_ids))
                return add_live(token_ids, *args, **kwargs)

            monkeypatch.setattr(live, "add", spied_add_live)

        def spied_step():
            if arrived:
                rounds.append(list(arrived))
                arrived.clear()
            return step()

        monkeypatch.setattr(engine, "add_request", spied_add_request)
        monkeypatch.setattr(engine, "step", spied_step)
        return rounds

    return spy_on


def _segment_rows(model, ids: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """A transformers model's next-token log-probabilities after every position of `ids`,
    from plain passes over consecutive segments of `lengths` tokens, each continuing the
    key/values of the ones before (a `DynamicCache`); normalised in float32 (float64 for a
    float64 model), on the CPU."""
    from transformers import DynamicCache

    cache, rows, start = DynamicCache(), [], 0
    with torch.no_grad():
        for n in lengths:
            piece = torch.tensor([list(ids[start : start + n])], device=model.device)
            logits = model(piece, past_key_values=cache, use_cache=True).logits[0]
            rows.append(
                torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
            )
            start += n
    assert start == len(ids)
    return torch.cat(rows).cpu()


@pytest.fixture(scope="session")
def segment_rows() -> Callable[..., torch.Tensor]:
    """`segment_rows(model, ids, lengths)`: plain rows after every position of `ids`, from
    passes over consecutive segments of `lengths` tokens."""
    return _segment_rows


@pytest.fixture(scope="session")
def float64_reference() -> Callable[..., tuple[list[torch.Tensor], float]]:
    """`float64_reference(model, contexts)`: each context's next-token row from a float64
    copy of the float32 `model`, and a tolerance for float32 rows of them on this machine.

    The tolerance is 3x `error` plus 2e-5 (a few float32 ulps of log-probabilities down to
    -40), where `error` is the float32 model's largest difference from the float64 rows over
    these contexts, in one pass and split before the last token: how far float32 rounding
    takes them with this CPU's kernels.
    """

    def reference(model, contexts: Sequence[Sequence[int]]) -> tuple[list[torch.Tensor], float]:
        exact = copy.deepcopy(model).double()
        rows = [_segment_rows(exact, ids, [len(ids)])[-1] for ids in contexts]
        error = max(
            (_segment_rows(model, ids, lengths)[-1].double() - row).abs().max().item()
            for ids, row in zip(contexts, rows, strict=True)
            for lengths in ([len(ids)], [len(ids) - 1, 1])
        )
        return rows, 3 * error + 2e-5

    return reference
