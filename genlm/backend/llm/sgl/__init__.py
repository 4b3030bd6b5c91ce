"""The SGLang backend (`AsyncSGLTransformer`); importable without SGLang installed."""

from genlm.backend.llm.sgl.backend import AsyncSGLTransformer

__all__ = ["AsyncSGLTransformer"]
