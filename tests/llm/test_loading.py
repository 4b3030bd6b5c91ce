"""Tests of `load_model_by_name`: backend dispatch, the default backend, unknown names."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from genlm.backend import load_model_by_name
from genlm.backend.llm import loading
from genlm.backend.llm.base import MockAsyncLM
from genlm.backend.llm.hf import AsyncTransformer
from genlm.backend.llm.sgl import AsyncSGLTransformer
from genlm.backend.llm.vllm import AsyncVirtualLM

BACKEND_CLASSES = {"hf": AsyncTransformer, "vllm": AsyncVirtualLM, "sgl": AsyncSGLTransformer}


@pytest.fixture
def calls(monkeypatch):
    """Replace each engine backend's `from_name` with a recorder (engines stay unloaded)."""
    recorded = []
    for backend, cls in BACKEND_CLASSES.items():

        def from_name(name, _backend=backend, **kwargs):
            recorded.append((_backend, name, kwargs))
            return _backend

        monkeypatch.setattr(cls, "from_name", from_name, raising=False)
    return recorded


@pytest.mark.parametrize("backend", ["hf", "vllm", "sgl"])
def test_named_backend_gets_the_name_and_llm_opts(calls, backend):
    assert load_model_by_name("some/model", backend, {"a": 1}) == backend
    assert calls == [(backend, "some/model", {"a": 1})]


def test_llm_opts_default_to_none(calls):
    load_model_by_name("m", backend="hf")
    assert calls == [("hf", "m", {})]


def test_mock_backend_loads_a_tokenizer_only(tokenizer_path):
    lm = load_model_by_name(str(tokenizer_path("gpt-2")), backend="mock")
    assert isinstance(lm, MockAsyncLM)
    assert lm.vocab_size == 50257
    row = lm.next_token_logprobs_sync([1, 2])
    assert abs(torch.logsumexp(row, dim=0).item()) < 1e-5


def test_unknown_backend_names_the_valid_ones(calls):
    with pytest.raises(ValueError) as info:
        load_model_by_name("m", backend="tensorrt")
    for name in ("hf", "vllm", "sgl", "mlx", "mock", "tensorrt"):
        assert repr(name) in str(info.value)
    assert calls == []


@pytest.mark.parametrize(
    ("cuda", "vllm_installed", "expected"),
    [(True, True, "vllm"), (True, False, "hf"), (False, True, "hf"), (False, False, "hf")],
)
def test_default_backend_is_vllm_only_with_cuda_and_vllm(
    calls, monkeypatch, cuda, vllm_installed, expected
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "vllm":
            return real_find_spec("json") if vllm_installed else None
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert loading.default_backend() == expected
    assert load_model_by_name("m") == expected
    assert calls == [(expected, "m", {})]


def test_mlx_backend_imports_without_mlx_and_names_the_extra_when_used(monkeypatch):
    import sys

    import genlm.backend
    from genlm.backend.llm import AsyncMlxLM
    from genlm.backend.llm.mlx import AsyncMlxLM as defined

    assert genlm.backend.AsyncMlxLM is AsyncMlxLM is defined
    assert issubclass(AsyncMlxLM, genlm.backend.AsyncLM)
    # MLX is imported only through this module: without MLX its import fails.
    monkeypatch.setitem(sys.modules, "genlm.backend.llm.mlx.runtime", None)
    for use in (
        lambda: AsyncMlxLM.from_name("some/model"),
        lambda: AsyncMlxLM(None, None),
        lambda: load_model_by_name("some/model", backend="mlx"),
    ):
        with pytest.raises(ImportError, match=r"genlm-backend\[mlx\]"):
            use()
