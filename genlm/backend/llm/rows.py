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
