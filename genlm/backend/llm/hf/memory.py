"""The working-memory bound of the transformers backend's batches: `WorkingMemory`.

It estimates what a batch needs (its key/value buffer, activations and
logits), says how much one sub-batch may use now (`max_batch_bytes`, and on an
accelerator the memory free there) and how long a row's segment fits it;
`is_out_of_memory` tells the allocation failures a pass is retried after.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any

import torch

from genlm.backend.llm.kv_workspace import KVWorkspace

_log = logging.getLogger(__name__)


class WorkingMemory:
    """The bound on a model's batch working memory, and the estimates it is checked against.

    Args:
        model: A `transformers` causal LM (its config and input embeddings give the sizes).
        max_batch_bytes: Bound on the working memory of batches, in bytes.

    Raises:
        ValueError: If `max_batch_bytes` cannot hold a batch of one one-token context.
        TypeError: If `max_batch_bytes` is not an int.
    """

    def __init__(self, model: Any, max_batch_bytes: int):
        config = model.config.get_text_config(decoder=True)
        embeddings = model.get_input_embeddings()
        self._vocab_size: int = embeddings.num_embeddings
        self._device = embeddings.weight.device
        self._heads, self._token_kv_bytes, self._token_activation_bytes = token_sizes(
            config, config.num_hidden_layers, embeddings.weight.element_size()
        )
        self.max_batch_bytes = max_batch_bytes
        self._warned_out_of_memory = False

    @property
    def max_batch_bytes(self) -> int:
        """The working-memory bound, in bytes.

        Raises:
            ValueError: On assignment, if it cannot hold a batch of one one-token context.
            TypeError: On assignment, if it is not an int.
        """
        return self._max_batch_bytes

    @max_batch_bytes.setter
    def max_batch_bytes(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"max_batch_bytes must be an int, got {value!r}")
        smallest = 2 * self.working_set(1, 1, 1, 1)
        if value < smallest:
            raise ValueError(
                f"max_batch_bytes={value} cannot hold a batch of one one-token "
                f"context of this model (about {smallest} bytes, two buffers)"
            )
        self._max_batch_bytes = value

    def check_fits(self, token_ids: tuple[int, ...]) -> None:
        """Raise `ValueError` if the bound cannot hold even one new token of this context.

        That is the least a context needs: its key/value buffer, one new token
        and one row read.
        """
        needed = self.working_set(1, len(token_ids), 1, 1)
        if needed > self.max_batch_bytes // 2:
            raise ValueError(
                f"a context of {len(token_ids)} tokens needs about {needed / 2**20:.0f} MiB of "
                f"batch working memory (its key/values and one new token), more than the "
                f"{self.max_batch_bytes // 2**21} MiB a batch may use (half of max_batch_bytes="
                f"{self.max_batch_bytes}): raise max_batch_bytes"
            )

    def measure_kv(self, storage: torch.Tensor) -> None:
        """Take the key/value bytes per token from a batch buffer's `storage`.

        The config's estimate is replaced by the model's own key/value shape and
        dtype, as measured at every pass that wrote key/values.
        """
        self._token_kv_bytes = storage[:, :, 0, :, 0].numel() * storage.element_size()

    def working_set(self, n_rows: int, slots: int, n_new: int, n_reads: int) -> int:
        """Bytes a batch of `n_rows` rows of `slots` tokens, `n_new` of them new, may use:
        its key/value buffer (with spare slots), activations and logits (an estimate)."""
        buffer_slots = KVWorkspace.storage_slots(slots)
        per_row = buffer_slots * self._token_kv_bytes + n_new * (
            self._token_activation_bytes + 4 * self._heads * slots
        )
        return n_rows * per_row + n_reads * self._vocab_size * 8  # logits, and float32 rows

    def batch_limit(self) -> int:
        """Working memory one sub-batch may use: half the budget (two buffers are kept),
        and on an accelerator at most what is free there now."""
        limit = self.max_batch_bytes // 2
        if self._device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self._device)
            # Memory torch's allocator holds but does not use is free for the batch too.
            idle = torch.cuda.memory_reserved(self._device) - torch.cuda.memory_allocated(
                self._device
            )
            limit = min(limit, free + idle)
        return limit

    def longest_fitting(self, reads: list[int], start: int, stop: int, limit: int) -> int:
        """The longest prefix of a row (at most `stop` tokens, with `start` computed) whose
        new tokens and reads fit within `limit` bytes; `start` if not even one does.

        Args:
            reads: The lengths of the row's prefixes whose next-token rows are read, ascending.
            start: Tokens of the row whose key/values are at hand.
            stop: The longest prefix considered.
            limit: The working memory the segment may use (e.g. `batch_limit()`).

        Returns:
            The prefix's length, between `start` and `stop`.
        """

        def fits(end: int) -> bool:
            n_reads = bisect.bisect_right(reads, end)
            return self.working_set(1, end, end - start, n_reads) <= limit

        if fits(stop):
            return stop
        low, high = start, stop  # fits(low) or low == start; not fits(high)
        while high - low > 1:
            middle = (low + high) // 2
            if fits(middle):
                low = middle
            else:
                high = middle
        return low

    def warn_out_of_memory(self, error: BaseException, needed: int) -> None:
        """Log, once per backend, that a pass ran out of memory and what bound avoids it.

        Args:
            error: The allocation failure (see `is_out_of_memory`).
            needed: The pass's estimated working memory, in bytes.
        """
        if self._warned_out_of_memory:
            return
        self._warned_out_of_memory = True
        _log.warning(
            "a forward pass ran out of memory (%s); it is retried in halves. Its working "
            "memory was estimated at %.0f MiB: max_batch_bytes=%d (passes of at most half "
            "of it) or less would have avoided it.",
            str(error).splitlines()[0] if str(error) else type(error).__name__,
            needed / 2**20,
            needed,
        )


def token_sizes(config: Any, n_layers: int, element_size: int) -> tuple[int, int, int]:
    """Attention heads, and bytes per token of a model's key/values and of its activations.

    Estimates from the config (the key/value size is measured at the first
    batch): grouped-query heads and `head_dim` where the config has them.
    """
    hidden = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    kv_bytes = 2 * n_layers * kv_heads * head_dim * element_size
    # The residual stream, attention projections and the MLP's inputs and outputs of one
    # layer alive at once (no gradients are kept).
    activation_bytes = (8 * hidden + 3 * intermediate) * element_size
    return heads, kv_bytes, activation_bytes


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocation failure: torch's out-of-memory error (CUDA),
    Python's `MemoryError`, or the CPU allocator's `RuntimeError`."""
    if isinstance(error, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)
