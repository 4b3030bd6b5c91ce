"""The transformers backend (`AsyncTransformer`) and the parts only it uses."""

from genlm.backend.llm.hf.backend import AsyncTransformer
from genlm.backend.llm.hf.query import Query

__all__ = ["AsyncTransformer", "Query"]
