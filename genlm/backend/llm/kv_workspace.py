"""Memory that successive batches reuse for their key/value buffers, shared by the
transformers and MLX backends: `KVWorkspace` keeps two storages between batches
and remembers recent unpadded batches, so that a batch that extends one of them
starts from its buffer (`RememberedBatch`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

_SPARE_SLOTS = 32  # token slots a batch buffer keeps free, so following steps append in place


@dataclass(eq=False)
class RememberedBatch:
    """A batch without padding whose buffer is kept, so that a following batch may continue it.

    Attributes:
        adapter: The adapter its rows were computed under.
        rows: The row of the buffer holding each context.
        length: The length of every context.
        storage: The buffer's storage (for the MLX backend: its layer caches).
        in_tree: Every row's key/values are in the prefix tree too.
    """

    adapter: Hashable
    rows: dict[tuple[int, ...], int]
    length: int
    storage: Any
    in_tree: bool = False


class KVWorkspace:
    """Memory that successive batches reuse for their key/value buffers.

    A fresh buffer per batch would be mapped and page-faulted anew at every
    step, which costs about as much as filling it. Two storages are kept (each
    the largest so far, with spare slots) and batches take turns in them, so
    that a batch can be built from an earlier one's buffer: `remember` keeps an
    unpadded batch's storage and contexts (up to `batches` of them, the most
    recent, each in its own storage); `extension` and `recall` tell the next
    batch which of a remembered batch's rows holds the whole prefix of each of
    its rows. With `batches=2` a sampler's batch and a critic's, which
    alternate, both continue in place.

    The transformers backend inserts a remembered batch's rows into its tree
    only once no batch continues them: `spill` is called with a remembered
    batch before its memory is reused or it is dropped to make room for a
    newer one. The MLX backend has inserted them already.

    Args:
        batches: Most batches remembered at once (at most 2: one per storage,
            unless the storages are not the workspace's, as MLX's).
        spill: Called with a remembered batch before it is forgotten for want
            of room (not when `forget` or `release` is called).
    """

    def __init__(
        self, batches: int = 1, spill: Callable[[RememberedBatch], None] | None = None
    ) -> None:
        self._flats: list[torch.Tensor | None] = [None, None]
        self._taken = 1  # the storage taken last
        self._batches = batches
        self._spill = spill
        self.remembered: list[RememberedBatch] = []  # oldest first

    def take(
        self, shape: tuple[int, ...], like: torch.Tensor, avoid: torch.Tensor | None = None
    ) -> torch.Tensor:
        """A storage for a buffer of `shape` with spare slots (dimension -2).

        Never the memory of `avoid` (the buffer the new one is built from). The
        storage holding no remembered batch is preferred, then the one not
        taken last; a remembered batch in the storage taken is spilled first.
        """

        def rank(index: int) -> tuple[int, bool]:
            held = [
                k for k, batch in enumerate(self.remembered) if self._holds(index, batch.storage)
            ]
            return (held[-1] + 1 if held else 0), index == self._taken

        index = min((i for i in (0, 1) if avoid is None or not self._holds(i, avoid)), key=rank)
        for batch in [batch for batch in self.remembered if self._holds(index, batch.storage)]:
            self._drop(batch)
        self._taken = index
        per_slot = math.prod(shape) // shape[-2]
        flat = self._flats[index]
        if (
            flat is None
            or flat.numel() < math.prod(shape)
            or (flat.dtype, flat.device) != (like.dtype, like.device)
        ):
            self._flats[index] = None  # free the old storage before allocating anew
            slots = self.storage_slots(shape[-2])
            flat = self._flats[index] = like.new_empty(per_slot * slots)
        slots = flat.numel() // per_slot
        return flat[: per_slot * slots].view(*shape[:-2], slots, shape[-1])

    @staticmethod
    def storage_slots(slots: int) -> int:
        """Token slots of a new storage for a buffer of `slots`: room for the next steps."""
        return slots + slots // 4 + _SPARE_SLOTS

    def remember(self, adapter: Hashable, contexts: list[tuple[int, ...]], storage: Any) -> None:
        """Keep `storage` of a batch without padding, whose rows hold all of `contexts`.

        A remembered batch whose memory `storage` shares is forgotten (the new
        batch overwrote it), and the oldest is spilled when more than `batches` are kept.
        """
        rows = {context: row for row, context in enumerate(contexts)}
        self.remembered = [
            batch for batch in self.remembered if not _same_memory(batch.storage, storage)
        ]
        self.remembered.append(RememberedBatch(adapter, rows, len(contexts[0]), storage))
        while len(self.remembered) > self._batches:
            self._drop(self.remembered[0])

    def extension(
        self, adapter: Hashable, contexts: list[tuple[int, ...]]
    ) -> tuple[RememberedBatch, list[int]] | None:
        """A remembered batch and the row of it each context extends.

        `None` unless every context is a context of one remembered batch (of
        the same adapter) followed by at least one token; the most recent such
        batch is returned. Nothing is forgotten.
        """
        for batch in reversed(self.remembered):
            if batch.adapter != adapter:
                continue
            sources = [
                batch.rows.get(context[: batch.length]) if len(context) > batch.length else None
                for context in contexts
            ]
            if None not in sources:
                return batch, sources
        return None

    def recall(
        self, adapter: Hashable, contexts: list[tuple[int, ...]], past_lengths: list[int]
    ) -> tuple[Any, list[int]] | None:
        """A remembered storage and, per context, its row holding the context's past.

        `None` unless every context's past is exactly a context of a remembered
        batch (of the same adapter). Every batch is forgotten either way: the new
        batch may overwrite their storages.
        """
        found = self.extension(adapter, contexts)
        self.remembered = []
        if found is None or any(past != found[0].length for past in past_lengths):
            return None
        return found[0].storage, found[1]

    def forget(self, storage: Any = None) -> None:
        """Drop the record of the batch remembered in `storage` (`None`: of every batch).

        The memory stays for reuse; the rows are not spilled.
        """
        self.remembered = [
            batch
            for batch in self.remembered
            if storage is not None and batch.storage is not storage
        ]

    def release(self) -> None:
        """Free both storages and forget every batch."""
        self._flats = [None, None]
        self.remembered = []

    def _holds(self, index: int, storage: Any) -> bool:
        """Whether storage `index` holds `storage` (a view of it)."""
        return _same_memory(self._flats[index], storage)

    def _drop(self, batch: RememberedBatch) -> None:
        self.remembered.remove(batch)
        if self._spill is not None:
            self._spill(batch)


def _same_memory(a: Any, b: Any) -> bool:
    """Whether `a` and `b` are tensors viewing the same memory."""
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    )
