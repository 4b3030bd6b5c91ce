"""`Query`: what `AsyncTransformer` queues and its batch evaluation (`forward`) answers."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from genlm.backend.cache import PrefixMatch


class Query:
    """A queued request for the next-token log-probabilities of one context.

    Args:
        token_ids: The whole context.
        adapter: Name of the LoRA adapter it is evaluated under (`None`: the base model).
        past: A cached prefix of `token_ids` (as returned by `walk_cache`) whose
            key/values the evaluation may reuse; the cache is consulted too.

    Attributes:
        token_ids: The context, a tuple of ints.
        adapter: The adapter name or `None`.
        past: The prefix handed in, or `None`.
    """

    __slots__ = ("token_ids", "adapter", "past")

    def __init__(
        self,
        token_ids: Sequence[int],
        adapter: str | None = None,
        past: PrefixMatch | None = None,
    ):
        # Kept as it is when a tuple: a checked context (`TokenIds`) keeps its hash.
        self.token_ids = token_ids if isinstance(token_ids, tuple) else tuple(token_ids)
        self.adapter = adapter
        self.past = past

    @property
    def key(self) -> Hashable:
        """Queries with equal keys have the same result."""
        return (self.adapter, self.token_ids)

    def __repr__(self) -> str:
        return f"Query({len(self.token_ids)} tokens, adapter={self.adapter!r})"
