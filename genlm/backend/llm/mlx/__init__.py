"""The MLX backend (`AsyncMlxLM`); importable without MLX installed."""

from genlm.backend.llm.mlx.backend import AsyncMlxLM

__all__ = ["AsyncMlxLM"]
