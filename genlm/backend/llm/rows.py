"""Operations on next-token rows that every backend's callers share."""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
import torch


def temper(row: Any, temperature: float) -> Any:
    """A row of log-probabilities at another temperature.

    Args:
        row: Log-probabilities (or logits), a torch tensor or numpy array; the
            last axis is the vocabulary.
        temperature: A positive finite number; below 1 sharpens, above 1 flattens.

    Returns:
        `row` itself at temperature 1 (no copy); else a new
        `log_softmax(row / temperature)` over the last axis, of `row`'s type.

    Raises:
        ValueError: If `temperature` is not a positive finite number.
    """
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, numbers.Real)
        or not 0 < temperature < math.inf
    ):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    if temperature == 1:
        return row
    if isinstance(row, np.ndarray):
        scaled = row / temperature
        peak = np.max(scaled, axis=-1, keepdims=True)
        peak = np.where(np.isfinite(peak), peak, 0.0)
        with np.errstate(divide="ignore"):
            log_z = np.log(np.sum(np.exp(scaled - peak), axis=-1, keepdims=True)) + peak
        return scaled - log_z
    return torch.log_softmax(row / temperature, dim=-1)


def fit_width(rows: torch.Tensor, width: int) -> torch.Tensor:
    """Rows over a model's output layer as rows over the tokenizer's `width` ids.

    Columns past `width` (a padded output layer's ids, which no token has)
    are cut; columns the output layer lacks (tokens added past it) are
    `-inf`, as the model can never produce them.

    Args:
        rows: Log-probabilities over the output layer, the last axis its ids.
        width: The tokenizer's length.

    Returns:
        `rows` itself when it has `width` columns, else a new tensor that does.
    """
    have = rows.shape[-1]
    if have == width:
        return rows
    if have > width:
        return rows[..., :width].contiguous()
    fitted = rows.new_full((*rows.shape[:-1], width), -math.inf)
    fitted[..., :have] = rows
    return fitted
