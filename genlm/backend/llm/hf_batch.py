"""The key/value buffer of one batch of the transformers backend (`AsyncTransformer`).

A batch's cached prefixes are laid out in one buffer `[layers, 2, rows,
kv_heads, slots, head_dim]`, right-padded to the longest prefix, followed by
slots for the new tokens, which the model writes in place (`BatchLayer`, a
transformers cache layer). `KVWorkspace` keeps the memory between batches and
lets a batch that extends the previous one start from its buffer.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

_SPARE_SLOTS = 32  # token slots a batch buffer keeps free, so following steps append in place


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
        previous: The last batch's storage and, for each row, the row of it
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
        if len(sources) <= old.shape[2] and old.shape[-2] >= shape[-2]:
            # In place: the new tokens go into spare slots, and only rows whose source is
            # another row are copied. Sources are sorted, so rows reading a later row go
            # first, in increasing order, then rows reading an earlier one, in decreasing
            # order: no row is overwritten before every row reading it has.
            moved = [row for row, source in enumerate(sources) if source > row]
            moved += [row for row, source in reversed(list(enumerate(sources))) if source < row]
            if moved:  # the last batch's rows change: a retry after a failure must not use them
                self.workspace.forget()
            for row in moved:
                old[:, :, row, :, : self.past_length].copy_(
                    old[:, :, sources[row], :, : self.past_length]
                )
            return old.narrow(2, 0, len(sources))
        storage = self.workspace.take(shape, like)
        for row, source in enumerate(sources):
            storage[:, :, row, :, : self.past_length].copy_(
                old[:, :, source, :, : self.past_length]
            )
        return storage

    def _gather(self, buffer: torch.Tensor) -> None:
        """Copy every row's cached segments into its slots; zero the padding."""
        # Consecutive rows that share a cached segment (the prompt, say) get it in one copy.
        runs: dict[tuple[int, int, int], list] = {}  # (slot, address, length) -> [rows, segment]
        for row, segments in enumerate(self.segments):
            offset = 0
            for segment in segments:
                length = segment.shape[-2]
                key = (offset, segment.data_ptr(), length)
                run = runs.get(key)
                if run is not None and run[0].stop == row:
                    run[0] = range(run[0].start, row + 1)
                else:
                    if run is not None:
                        self._fill(buffer, key[0], *run)
                    runs[key] = [range(row, row + 1), segment]
                offset += length
            # Masked slots must still hold finite numbers: attention multiplies them by 0.
            if offset < self.past_length:  # an empty fill is still one dispatched operation
                buffer[:, :, row, :, offset : self.past_length].zero_()
        for (offset, _, _), run in runs.items():
            self._fill(buffer, offset, *run)

    @staticmethod
    def _fill(buffer: torch.Tensor, offset: int, rows: range, segment: torch.Tensor) -> None:
        target = buffer[:, :, rows.start : rows.stop, :, offset : offset + segment.shape[-2]]
        target.copy_(segment.unsqueeze(2).expand_as(target))


class KVWorkspace:
    """Memory that successive batches reuse for their key/value buffers.

    A fresh buffer per batch would be mapped and page-faulted anew at every
    step, which costs about as much as filling it. Two storages are kept (each
    the largest so far, with spare slots) and batches alternate between them,
    so that a batch can be built from the last one's buffer: `remember` keeps
    the last unpadded batch's storage and contexts; `extension` and `recall`
    tell the next batch which of its rows hold the whole prefix of each new
    row. The transformers backend inserts a remembered batch's rows into its
    tree only once a batch does not continue them; the MLX backend has
    inserted them already.
    """

    def __init__(self) -> None:
        self._flats: list[torch.Tensor | None] = [None, None]
        self._current = 0
        self._last: tuple[Hashable, dict[tuple[int, ...], int], int, Any] | None = None

    def take(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A storage for a buffer of `shape` with spare slots (dimension -2).

        Never the remembered batch's memory (which the new buffer may be built from).
        """
        held = self._flat_holding_last()
        self._current = 1 - (self._current if held is None else held)
        per_slot = math.prod(shape) // shape[-2]
        flat = self._flats[self._current]
        if (
            flat is None
            or flat.numel() < math.prod(shape)
            or (flat.dtype, flat.device) != (like.dtype, like.device)
        ):
            self._flats[self._current] = None  # free the old storage before allocating anew
            slots = self.storage_slots(shape[-2])
            flat = self._flats[self._current] = like.new_empty(per_slot * slots)
        slots = flat.numel() // per_slot
        return flat[: per_slot * slots].view(*shape[:-2], slots, shape[-1])

    @staticmethod
    def storage_slots(slots: int) -> int:
        """Token slots of a new storage for a buffer of `slots`: room for the next steps."""
        return slots + slots // 4 + _SPARE_SLOTS

    def remember(
        self, adapter: Hashable, contexts: list[tuple[int, ...]], storage: torch.Tensor
    ) -> None:
        """Keep `storage` of a batch without padding, whose rows hold all of `contexts`."""
        rows = {context: row for row, context in enumerate(contexts)}
        self._last = (adapter, rows, len(contexts[0]), storage)

    @property
    def last(self) -> tuple[Hashable, dict[tuple[int, ...], int], int, Any] | None:
        """The remembered batch: adapter, row of each context, context length, storage."""
        return self._last

    def extension(
        self, adapter: Hashable, contexts: list[tuple[int, ...]]
    ) -> tuple[Any, list[int], int] | None:
        """The last storage, the row of it each context extends, and that row's length.

        `None` unless every context is a context of the last batch (of the same
        adapter) followed by at least one token. Nothing is forgotten.
        """
        last = self._last
        if last is None or last[0] != adapter:
            return None
        _, rows, length, storage = last
        sources = [
            rows.get(context[:length]) if len(context) > length else None for context in contexts
        ]
        return None if None in sources else (storage, sources, length)

    def recall(
        self, adapter: Hashable, contexts: list[tuple[int, ...]], past_lengths: list[int]
    ) -> tuple[Any, list[int]] | None:
        """The last storage and, per context, its row holding the context's past.

        `None` unless every context's past is exactly a context of the last batch
        (of the same adapter). The last batch is forgotten either way: the new
        batch may overwrite its storage.
        """
        found = self.extension(adapter, contexts)
        self._last = None
        if found is None or any(past != found[2] for past in past_lengths):
            return None
        return found[0], found[1]

    def _flat_holding_last(self) -> int | None:
        """Which of the two storages holds the remembered batch (`None`: neither)."""
        if self._last is None or not isinstance(self._last[3], torch.Tensor):
            return None
        address = self._last[3].untyped_storage().data_ptr()
        for index, flat in enumerate(self._flats):
            if flat is not None and flat.untyped_storage().data_ptr() == address:
                return index
        return None

    def forget(self) -> None:
        """Drop the last batch's record (its storage stays for reuse)."""
        self._last = None

    def release(self) -> None:
        """Free both storages."""
        self._flats = [None, None]
        self._last = None


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
