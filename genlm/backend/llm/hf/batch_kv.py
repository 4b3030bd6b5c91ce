"""The key/value buffer of one batch of the transformers backend (`AsyncTransformer`).

A batch's cached prefixes are laid out in one buffer `[layers, 2, rows,
kv_heads, slots, head_dim]`, right-padded to the longest prefix, followed by
slots for the new tokens, which the model writes in place (`BatchLayer`, a
transformers cache layer). The memory comes from a `KVWorkspace`
(`genlm.backend.llm.kv_workspace`), which lets a batch that extends a recent
one start from its buffer.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from genlm.backend.llm.kv_workspace import KVWorkspace


class BatchKV:
    """The key/value buffer of one batch, shaped `[layers, 2, rows, kv_heads, slots, head_dim]`.

    Slots `[0, past_length)` hold each row's cached prefix (right-padded with
    zeros), slots `[past_length, past_length + n_new)` receive the new tokens.
    The buffer is allocated at the first layer's update, when the key/value
    shape and dtype the model produces are known. It is a view of `storage`,
    which has spare slots for the next steps.

    Args:
        segments: Each row's cached prefix, as key/value views of the tree
            (`None` when `previous` is given).
        past_length: Slots reserved for the longest prefix.
        n_new: Slots for the new tokens.
        n_layers: Layers of the model.
        workspace: Where the storage comes from.
        previous: A remembered batch's storage and, for each row, the row of it
            that holds this row's whole prefix (from `KVWorkspace.extension`;
            in increasing order), or `None` to gather the prefixes from `segments`.
    """

    def __init__(
        self,
        segments: list[tuple[torch.Tensor, ...]] | None,
        past_length: int,
        n_new: int,
        n_layers: int,
        workspace: KVWorkspace,
        previous: tuple[torch.Tensor, list[int]] | None,
    ):
        self.segments = segments
        self.workspace = workspace
        self.previous = previous
        self.past_length = past_length
        self.n_new = n_new
        self.n_layers = n_layers
        self.storage: torch.Tensor | None = None
        self.buffer: torch.Tensor | None = None

    def as_cache(self) -> Cache:
        return Cache(layers=[BatchLayer(self, layer) for layer in range(self.n_layers)])

    def allocate(self, key_states: torch.Tensor) -> torch.Tensor:
        if self.buffer is not None:
            return self.buffer
        rows, heads, _, head_dim = key_states.shape
        slots = self.past_length + self.n_new
        shape = (self.n_layers, 2, rows, heads, slots, head_dim)
        storage = self._from_previous(shape, key_states)
        if storage is None:
            storage = self.workspace.take(shape, key_states)
            self._gather(storage)
        self.storage = storage
        self.buffer = storage.narrow(-2, 0, slots)
        return self.buffer

    def _from_previous(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor | None:
        """The storage built from the previous batch's (`None` if it does not fit)."""
        if self.previous is None:
            return None
        old, sources = self.previous
        if (old.shape[3], old.shape[5], old.dtype, old.device) != (
            shape[3],
            shape[5],
            like.dtype,
            like.device,
        ):
            return None
        past = self.past_length
        if len(sources) <= old.shape[2] and old.shape[-2] >= shape[-2]:
            # In place: the new tokens go into spare slots, and only rows whose source is
            # another row are copied. Sources are sorted, so rows reading a later row go
            # first, in increasing order, then rows reading an earlier one, in decreasing
            # order: no row is overwritten before every row reading it has.
            moved = [row for row, source in enumerate(sources) if source > row]
            moved += [row for row, source in reversed(list(enumerate(sources))) if source < row]
            if moved:  # the batch's rows change: a retry after a failure must not use them
                self.workspace.forget(old)
            for row in moved:
                old[:, :, row, :, :past].copy_(old[:, :, sources[row], :, :past])
            return old.narrow(2, 0, len(sources))
        storage = self.workspace.take(shape, like, avoid=old)
        target = storage[:, :, : len(sources), :, :past]
        if sources == list(range(sources[0], sources[0] + len(sources))):
            target.copy_(old[:, :, sources[0] : sources[0] + len(sources), :, :past])
        elif sources == [sources[0]] * len(sources):
            target.copy_(old[:, :, sources[0] : sources[0] + 1, :, :past].expand_as(target))
        else:
            index = torch.tensor(sources, pin_memory=old.is_cuda)
            index = index.to(old.device, non_blocking=True)
            torch.index_select(old[:, :, :, :, :past], 2, index, out=target)
        return storage

    def _gather(self, buffer: torch.Tensor) -> None:
        """Copy every row's cached segments into its slots; zero the padding.

        Consecutive rows with a segment at the same slots and of the same length
        get them in one copy (one operation, whether they share that segment,
        as a prompt, or each has its own).
        """
        runs: dict[tuple[int, int], tuple[int, list]] = {}  # (slot, length) -> first row, segments
        padding: list[list[int]] = []  # [first row, last row, slot]: rows padded from one slot
        for row, segments in enumerate(self.segments):
            offset = 0
            for segment in segments:
                key = (offset, segment.shape[-2])
                run = runs.get(key)
                if run is None or run[0] + len(run[1]) != row:
                    if run is not None:
                        self._fill(buffer, offset, *run)
                    run = runs[key] = (row, [])
                run[1].append(segment)
                offset += segment.shape[-2]
            # Masked slots must still hold finite numbers: attention multiplies them by 0.
            if offset < self.past_length:  # an empty fill is still one dispatched operation
                if padding and padding[-1][1:] == [row - 1, offset]:
                    padding[-1][1] = row
                else:
                    padding.append([row, row, offset])
        for (offset, _), run in runs.items():
            self._fill(buffer, offset, *run)
        for first, last, offset in padding:
            buffer[:, :, first : last + 1, :, offset : self.past_length].zero_()

    @staticmethod
    def _fill(buffer: torch.Tensor, offset: int, first: int, segments: list) -> None:
        """Copy `segments` into consecutive rows from `first`, at slots from `offset`."""
        one = segments[0]
        target = buffer[:, :, first : first + len(segments), :, offset : offset + one.shape[-2]]
        if all(
            segment.data_ptr() == one.data_ptr() and segment.stride() == one.stride()
            for segment in segments
        ):
            target.copy_(one.unsqueeze(2).expand_as(target))
        else:
            torch.stack(segments, dim=2, out=target)


class BatchLayer(DynamicLayer):
    """One layer's view of a `BatchKV`: new key/values are written in place, never concatenated."""

    def __init__(self, batch: BatchKV, layer: int):
        super().__init__()
        self._batch = batch
        self._layer = layer

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        buffer = self._batch.allocate(key_states)
        keys, values = buffer[self._layer, 0], buffer[self._layer, 1]
        start, length = self._batch.past_length, key_states.shape[-2]
        keys[:, :, start : start + length].copy_(key_states)
        values[:, :, start : start + length].copy_(value_states)
        self.keys, self.values, self.is_initialized = keys, values, True
        return keys, values

    def get_seq_length(self) -> int:
        return self._batch.past_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._batch.past_length + query_length, 0
