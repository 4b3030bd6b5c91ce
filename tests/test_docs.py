"""The Python code blocks of the README and the documentation run as written.

Each page's ```python blocks run in order in one namespace (later blocks use
what earlier ones defined), offline, in a temporary working directory. A block
may be marked by an HTML comment on the line before its fence:

- `<!-- docs-test: requires MODULE -->`: skipped when MODULE is not installed
  (e.g. `vllm`, which CI installs, or a client library);
- `<!-- docs-test: gpu -->`: skipped unless a CUDA device is present.

Shell blocks (install and set-up commands) are not run here.
"""

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(
    r"^(?:<!-- docs-test: (?P<mark>[^>]*?) -->\n)?```python\n(?P<code>.*?)^```$",
    re.MULTILINE | re.DOTALL,
)


@dataclass
class Block:
    """One Python code block of a page."""

    line: int
    code: str
    mark: str | None

    def skip_reason(self) -> str | None:
        """Why this block cannot run here, or None."""
        if self.mark is None:
            return None
        if self.mark == "gpu":
            return None if torch.cuda.is_available() else "needs a CUDA device"
        kind, _, module = self.mark.partition(" ")
        if kind == "requires" and module:
            installed = importlib.util.find_spec(module.split(".")[0]) is not None
            if installed and "." in module:
                installed = importlib.util.find_spec(module) is not None
            return None if installed else f"needs {module}, not installed"
        raise ValueError(f"unknown docs-test mark {self.mark!r}")


def blocks(page: Path) -> list[Block]:
    """The Python blocks of `page`, with the line each starts on."""
    text = page.read_text()
    return [
        Block(text.count("\n", 0, m.start("code")) + 1, m.group("code"), m.group("mark"))
        for m in FENCE.finditer(text)
    ]


def test_marks_are_known_and_blocks_are_found():
    found = {page.name: blocks(page) for page in PAGES}
    assert found["README.md"] and found["smc.md"] and found["lora.md"]
    for page_blocks in found.values():
        for block in page_blocks:
            block.skip_reason()  # raises on an unknown mark


CASES = [(page, i) for page in PAGES for i in range(len(blocks(page)))]
_namespaces: dict[Path, dict] = {}


@pytest.mark.slow
@pytest.mark.parametrize(
    "page, index", CASES, ids=[f"{p.relative_to(ROOT)}:{blocks(p)[i].line}" for p, i in CASES]
)
def test_block_runs(page, index, tmp_path_factory, monkeypatch):
    page_blocks = blocks(page)
    block = page_blocks[index]
    if page not in _namespaces:
        _namespaces[page] = {
            "__name__": f"docs_{page.stem}",
            "__cwd__": tmp_path_factory.mktemp(page.stem),
        }
    namespace = _namespaces[page]
    try:
        reason = block.skip_reason()
        if reason is not None:
            pytest.skip(f"{page.relative_to(ROOT)}:{block.line}: {reason}")
        monkeypatch.chdir(namespace["__cwd__"])
        exec(compile(block.code, f"{page.relative_to(ROOT)}:{block.line}", "exec"), namespace)
    finally:
        if index == len(page_blocks) - 1:
            del _namespaces[page]  # free the page's models
