"""How `AsyncVirtualLM.from_name` sizes the CPU build's key/value memory.

The engine is replaced by a stand-in that records its options, so these run in
a second each; the real engine starting with the chosen size is covered by the
documentation test (`tests/test_docs.py`).
"""

import psutil
import pytest

pytest.importorskip("vllm")

import vllm  # noqa: E402 - only after the skip above
from vllm.platforms import current_platform  # noqa: E402

from genlm.backend import AsyncVirtualLM  # noqa: E402

pytestmark = pytest.mark.skipif(not current_platform.is_cpu(), reason="vLLM's CPU build only")


class EngineOptions(Exception):
    """Raised by the stand-in engine, carrying the options it was given."""


def recorded_options(monkeypatch: pytest.MonkeyPatch, engine_opts: dict | None) -> dict:
    def stand_in(**options):
        raise EngineOptions(options)

    monkeypatch.setattr(vllm, "LLM", stand_in)
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_V2_MODEL_RUNNER"):
        monkeypatch.setenv(name, "0")
    with pytest.raises(EngineOptions) as raised:
        AsyncVirtualLM.from_name("model", engine_opts=engine_opts)
    return raised.value.args[0]


def test_unset_space_gives_a_quarter_of_available_memory_at_most_2_gib(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    before = psutil.virtual_memory().available
    size = recorded_options(monkeypatch, {"max_model_len": 128})["kv_cache_memory_bytes"]
    after = psutil.virtual_memory().available
    low, high = sorted((min(2 << 30, before // 4), min(2 << 30, after // 4)))
    assert low - (64 << 20) <= size <= high + (64 << 20)


@pytest.mark.parametrize(
    "env, engine_opts",
    [
        ("1", None),
        ("", {"kv_cache_memory_bytes": 123 << 20}),
        ("", {"gpu_memory_utilization": 0.5}),
    ],
)
def test_explicit_sizes_win(monkeypatch, env, engine_opts):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", env)
    options = recorded_options(monkeypatch, engine_opts)
    assert options.get("kv_cache_memory_bytes") == (engine_opts or {}).get("kv_cache_memory_bytes")
    assert options["block_size"] == 32 and options["model"] == "model"
