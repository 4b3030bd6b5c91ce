"""Language-model backends behind one asynchronous interface."""

from genlm.backend.errors import EngineDeadError
from genlm.backend.llm.base import AsyncLM, MockAsyncLM
from genlm.backend.llm.hf import AsyncTransformer
from genlm.backend.llm.loading import load_model_by_name
from genlm.backend.llm.mlx import AsyncMlxLM
from genlm.backend.llm.rows import temper
from genlm.backend.llm.sgl import AsyncSGLTransformer
from genlm.backend.llm.vllm import AsyncVirtualLM

__all__ = [
    "AsyncLM",
    "AsyncMlxLM",
    "AsyncSGLTransformer",
    "AsyncTransformer",
    "AsyncVirtualLM",
    "EngineDeadError",
    "MockAsyncLM",
    "load_model_by_name",
    "temper",
]
