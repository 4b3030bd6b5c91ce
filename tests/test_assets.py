"""The asset cache: atomic, locked, and clear about what is missing."""

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
