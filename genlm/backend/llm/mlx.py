"""The MLX backend's entry point: `AsyncMlxLM`.

Released clients (llamppl, genlm-control) import `AsyncMlxLM` from
`genlm.backend.llm` whether or not they use it, so this module imports without
MLX. The engine glue itself is not written yet: every way of building an
`AsyncMlxLM` raises, an `ImportError` naming the extra when MLX is missing.
"""

from __future__ import annotations

from typing import Any

from genlm.backend.llm.base import AsyncLM

_INSTALL_HINT = "the MLX backend needs MLX and mlx-lm: pip install 'genlm-backend[mlx]'"


def _require_mlx() -> None:
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401
    except ImportError as exc:
        raise ImportError(_INSTALL_HINT) from exc
    raise NotImplementedError("AsyncMlxLM is not available in this release of genlm-backend")


class AsyncMlxLM(AsyncLM):
    """A language model served by MLX (Apple silicon, or MLX's Linux CPU build).

    Not available in this release: constructing one raises.

    Raises:
        ImportError: If MLX or mlx-lm is not installed (the message names the
            extra `genlm-backend[mlx]`).
        NotImplementedError: Otherwise.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> AsyncMlxLM:
        _require_mlx()

    @classmethod
    def from_name(cls, model_name: str, **kwargs: Any) -> AsyncMlxLM:
        """Load `model_name` with mlx-lm (not available in this release).

        Args:
            model_name: A hub name or a local folder.
            **kwargs: Backend options.

        Raises:
            ImportError: If MLX or mlx-lm is not installed.
            NotImplementedError: Otherwise.
        """
        _require_mlx()
