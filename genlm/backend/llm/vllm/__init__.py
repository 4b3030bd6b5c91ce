"""The vLLM backend (`AsyncVirtualLM`) and the parts only it uses; importable without vLLM."""

from genlm.backend.llm.vllm.backend import AsyncVirtualLM
from genlm.backend.llm.vllm.capture import GlobalLogprobsCapture, LogprobsWorkerExtension

__all__ = ["AsyncVirtualLM", "GlobalLogprobsCapture", "LogprobsWorkerExtension"]
