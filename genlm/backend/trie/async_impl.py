"""`AsyncTokenCharacterTrie`: concurrent trie reductions served by batched calls."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from genlm.backend.batching import AutoBatcher
from genlm.backend.trie.base import TokenCharacterTrie
from genlm.backend.trie.parallel import ParallelTokenCharacterTrie

_BACKENDS = {"sequential": TokenCharacterTrie, "parallel": ParallelTokenCharacterTrie}


class AsyncTokenCharacterTrie:
    """Awaitable `weight_sum` / `weight_max` whose concurrent calls share one batched call.

    Each operation has its own `AutoBatcher`: requests made together (for
    example by many `asyncio.gather`-ed samplers) are evaluated by one
    `batch_weight_sum` / `batch_weight_max` call on the underlying trie, run
    inline in the event loop once the loop has run every task that was ready
    (see `genlm.backend.batching` for the full rule, with `batch_size` and
    `timeout` as bounds). Weight vectors are validated when submitted, so a
    wrong-length vector fails only its own caller; an exception raised by a
    batched call reaches every caller of that batch, and later calls still
    work. A caller that cancels its await does not disturb the others. A
    weight vector is read when its batch runs (it is not copied): do not
    modify it before the await returns.

    It may be created outside a running event loop and used inside one, and by
    successive `asyncio.run` calls.

    Args:
        trie: The trie whose reductions are batched.
        batch_size: Number of waiting requests that starts a batch without
            waiting for the event loop to go quiet.
        timeout: Seconds after the first waiting request that start a batch at
            the latest.

    Attributes:
        trie: The underlying trie.
    """

    def __init__(self, trie: TokenCharacterTrie, batch_size: int = 64, timeout: float = 0.02):
        self.trie = trie
        # The batchers call the trie's own methods, not this object's: a bound method of this
        # object would make a cycle, and a trie dropped by its users would wait for the
        # garbage collector's full passes to be freed.
        self._sum = AutoBatcher(
            partial(_listed, trie.batch_weight_sum), batch_size=batch_size, timeout=timeout
        )
        self._max = AutoBatcher(
            partial(_listed, trie.batch_weight_max), batch_size=batch_size, timeout=timeout
        )

    @classmethod
    def from_vocab(
        cls, vocab: Sequence, backend: str = "parallel", **kwargs: Any
    ) -> AsyncTokenCharacterTrie:
        """Build the trie of a vocabulary and wrap it.

        Args:
            vocab: The vocabulary items (see `TokenCharacterTrie`).
            backend: `"parallel"` (`ParallelTokenCharacterTrie`) or `"sequential"`
                (`TokenCharacterTrie`).
            **kwargs: Passed to the trie's constructor (e.g. `device` for `"parallel"`).

        Returns:
            The asynchronous trie.

        Raises:
            ValueError: If `backend` is not one of the two, or `vocab` has duplicate
                items ("Duplicate word in vocabulary ...").

        Warns:
            DeprecationWarning: Once, if items are plain bytes rather than `Token`s
                (see `TokenCharacterTrie`).
        """
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {sorted(_BACKENDS)}, got {backend!r}")
        return cls(_BACKENDS[backend](vocab, **kwargs))

    def start(self) -> None:
        """Nothing to do: batching starts lazily with the first request in a running loop.

        Kept so that code written for a background-task design can call it.
        """

    async def weight_sum(self, ws: Any) -> np.ndarray:
        """For every node, the sum of the weights of the items below it (batched).

        Args:
            ws: One weight per item (numpy array or torch tensor).

        Returns:
            A float64 array with one value per node.

        Raises:
            ValueError: If `ws` does not hold one weight per item.
        """
        return await self._sum.submit(self.trie._vector(ws))

    async def mass_sum(self, ws: Any) -> np.ndarray:
        """An older name of `weight_sum`."""
        return await self.weight_sum(ws)

    async def weight_max(self, ws: Any) -> np.ndarray:
        """For every node, the max of the weights of the items below it (batched).

        Args:
            ws: One weight per item (numpy array or torch tensor).

        Returns:
            A float64 array with one value per node.

        Raises:
            ValueError: If `ws` does not hold one weight per item.
        """
        return await self._max.submit(self.trie._vector(ws))

    async def cleanup(self) -> None:
        """Cancel every waiting request (their callers get `CancelledError`)."""
        for batcher in (self._sum, self._max):
            await batcher.aclose()

    def shutdown(self) -> None:
        """Cancel every waiting request, without awaiting (callable outside a loop)."""
        for batcher in (self._sum, self._max):
            batcher.reset()

    async def __aenter__(self) -> AsyncTokenCharacterTrie:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.cleanup()


def _listed(reduce: Callable[[list], Any], rows: list) -> list[np.ndarray]:
    """`reduce(rows)`'s results as a list, one per row."""
    return list(reduce(rows))
