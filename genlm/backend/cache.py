"""Caches: `OutputCache` (results by token ids) and the KV prefix cache."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

import torch


class OutputCache:
    """A least-recently-used map from token-id tuples to tensors.

    Args:
        maxsize: Most entries kept; the least recently used is evicted first.
            `0` keeps nothing.
        move_to_cpu: Store entries on the CPU and return them on the device
            they were stored from (saves accelerator memory).

    Raises:
        ValueError: If `maxsize` is negative.
    """

    def __init__(self, maxsize: int, move_to_cpu: bool = False):
        if maxsize < 0:
            raise ValueError(f"maxsize must be non-negative, got {maxsize}")
        self.maxsize = maxsize
        self.move_to_cpu = move_to_cpu
        self._entries: OrderedDict[Hashable, tuple[torch.Tensor, torch.device]] = OrderedDict()

    def __getitem__(self, key: Hashable) -> torch.Tensor:
        value, device = self._entries[key]
        self._entries.move_to_end(key)
        return value.to(device) if value.device != device else value

    def __setitem__(self, key: Hashable, value: torch.Tensor) -> None:
        if self.maxsize == 0:
            return
        device = value.device
        if self.move_to_cpu:
            value = value.to("cpu")
        self._entries[key] = (value, device)
        self._entries.move_to_end(key)
        while len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> torch.Tensor | None:
        """Return the entry for `key` (marking it recently used), or `None`."""
        return self[key] if key in self._entries else None

    def clear(self) -> None:
        """Remove every entry."""
        self._entries.clear()
