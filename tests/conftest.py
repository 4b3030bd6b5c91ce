"""Shared fixtures: real assets materialised by `python -m genlm.backend.assets`."""

import os
from collections.abc import Callable
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from genlm.backend import assets  # noqa: E402 - the environment above must be set first


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
def tokenizer_path() -> Callable[[str], Path]:
    """Factory: tokenizer family name (see `assets.TOKENIZERS`) to its folder."""

    def folder(name: str) -> Path:
        return assets.tokenizer(name, fetch=False)

    return folder
