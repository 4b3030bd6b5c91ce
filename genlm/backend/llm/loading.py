"""`load_model_by_name`: one entry point to every language-model backend."""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from genlm.backend.llm.base import AsyncLM

BACKENDS = ("hf", "vllm", "sgl", "mlx", "mock")


def default_backend() -> str:
    """The backend `load_model_by_name` uses when none is named.

    Returns:
        `"vllm"` when CUDA is available and vLLM is installed, else `"hf"`.
    """
    if torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None:
        return "vllm"
    return "hf"


def load_model_by_name(
    name: str, backend: str | None = None, llm_opts: dict[str, Any] | None = None
) -> AsyncLM:
    """Load a language model by hub name or local folder.

    Args:
        name: The model, passed to the backend's `from_name`.
        backend: `"hf"` (transformers), `"vllm"`, `"sgl"` (SGLang), `"mlx"`
            or `"mock"` (tokenizer only); `None` picks `default_backend()`.
        llm_opts: Keyword arguments for the backend's `from_name`.

    Returns:
        The loaded `AsyncLM`.

    Raises:
        ValueError: If `backend` is not one of the names above.
    """
    if backend is None:
        backend = default_backend()
    if backend not in BACKENDS:
        raise ValueError(
            f"unknown backend {backend!r}; valid backends: {', '.join(map(repr, BACKENDS))}"
        )
    opts = dict(llm_opts or {})
    if backend == "hf":
        from genlm.backend.llm.hf import AsyncTransformer

        return AsyncTransformer.from_name(name, **opts)
    if backend == "vllm":
        from genlm.backend.llm.vllm import AsyncVirtualLM

        return AsyncVirtualLM.from_name(name, **opts)
    if backend == "sgl":
        from genlm.backend.llm.sgl import AsyncSGLTransformer

        return AsyncSGLTransformer.from_name(name, **opts)
    if backend == "mlx":
        from genlm.backend.llm.mlx import AsyncMlxLM

        return AsyncMlxLM.from_name(name, **opts)
    from genlm.backend.llm.base import MockAsyncLM

    return MockAsyncLM.from_name(name, **opts)
