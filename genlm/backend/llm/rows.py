"""Operations on next-token rows that every backend's callers share."""

from __future__ import annotations

import functools
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


@functools.cache  # checked once, when the first `RowBuffers` is made (not at import)
def _storage_user_count() -> Any:
    """torch's count of the tensors that share a storage (a private function), if this torch has
    it and it counts as `RowBuffers` needs: a view, and an array of a row, hold the memory of a
    tensor gone; once they are gone too, only the storage's own handle does. Else `None`."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    try:
        tensor = torch.empty(2, 2)
        storage, view, array = tensor.untyped_storage(), tensor[1], tensor[0].numpy()
        del tensor
        held_by_both = count(storage._cdata)
        del view
        held_by_array = count(storage._cdata)
        del array
        alone = count(storage._cdata)
    except Exception:  # another signature or meaning: no reuse
        return None
    return count if held_by_both > held_by_array > alone == 1 else None


class RowBuffers:
    """CPU memory for the rows of successive steps, reused once nothing holds an earlier step's.

    A step's rows go to their callers, who own them, so each step needs memory
    of its own; fresh memory is fresh pages, one fault per 4 KiB on its first
    write: 12,289 a step for 256 rows of 49,152 floats, which cost more than
    the log-softmax that filled them (23 against 11 ms on a 2-core EPYC).
    `empty` instead hands out the memory of an earlier step whose rows, views
    and arrays are all gone (no tensor shares its storage any more), and new
    memory only when every kept one is still held.

    Where torch's count of a storage's users is missing or counts otherwise
    (checked once), every step gets new memory, as before.

    Args:
        keep: Most steps' memories kept (held or not); past that the oldest is
            left to its holders. Two suffice when callers let go of a step's
            rows once they have the next's: one is being filled while they
            hold the other.
    """

    def __init__(self, keep: int = 2):
        self._keep = keep
        self._users = _storage_user_count()
        self._storages: list[torch.UntypedStorage] = []  # least recently used first

    def empty(self, rows: int, columns: int) -> torch.Tensor:
        """An uninitialised `rows` x `columns` float32 CPU tensor, on memory no tensor uses.

        Make it outside inference mode if callers may change its rows in place.
        """
        nbytes = rows * columns * 4
        if self._users is not None:
            for index, storage in enumerate(self._storages):
                if storage.nbytes() >= nbytes and self._users(storage._cdata) == 1:
                    self._storages.append(self._storages.pop(index))
                    return torch.empty(0, dtype=torch.float32).set_(storage, 0, (rows, columns))
        tensor = torch.empty(rows, columns, dtype=torch.float32)  # whatever torch's default
        if self._users is not None:
            self._storages.append(tensor.untyped_storage())
            del self._storages[: -self._keep]
        return tensor
