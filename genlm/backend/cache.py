"""Caches: `OutputCache` (results by token ids) and the KV prefix cache."""

from __future__ import annotations

import heapq
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass

import torch

from genlm.backend.row_pool import RowPool, gather_rows


class OutputCache:
    """A least-recently-used map from token-id tuples to tensors.

    Entries are private: storing keeps a copy of the tensor and reading
    returns a new copy, so a caller that changes a tensor in place changes
    nothing in the cache. Entries of one shape share one growing tensor (a
    slot each), so a batch's results (`store_rows`) are stored in one copy
    into memory that earlier entries used. Thread-safe.

    Args:
        maxsize: Most entries kept; the least recently used is evicted first.
            `0` keeps nothing.
        move_to_cpu: Store entries on the CPU and return them on the device
            they were stored from (saves accelerator memory).
        max_bytes: Most bytes of stored rows kept (`None`: no bound but
            `maxsize`); the least recently used entries are evicted first.

    Attributes:
        nbytes: Bytes of the entries stored now.

    Raises:
        ValueError: If `maxsize` or `max_bytes` is negative.
    """

    def __init__(self, maxsize: int, move_to_cpu: bool = False, max_bytes: int | None = None):
        if maxsize < 0:
            raise ValueError(f"maxsize must be non-negative, got {maxsize}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be non-negative or None, got {max_bytes}")
        self.maxsize = maxsize
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.move_to_cpu = move_to_cpu
        self._entries: OrderedDict[Hashable, tuple[RowPool, int, torch.device]] = OrderedDict()
        self._pools: dict[tuple, RowPool] = {}
        self._lock = threading.Lock()  # callers in several threads (each with its loop)

    def __getitem__(self, key: Hashable) -> torch.Tensor:
        value = self.get(key)
        if value is None:
            raise KeyError(key)
        return value

    def __setitem__(self, key: Hashable, value: torch.Tensor) -> None:
        self.store_rows([key], value.unsqueeze(0))

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> torch.Tensor | None:
        """Return the entry for `key` (marking it recently used), or `None`."""
        if key not in self._entries:  # a miss needs no lock (a lookup is atomic)
            return None
        with self._lock:  # the slot must not be reused while it is copied
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            pool, slot, device = entry
            return pool.rows[slot].to(device, copy=True)

    def touch(self, keys: Sequence[Hashable]) -> list[int]:
        """Mark the entries of `keys` recently used, without reading them.

        Returns:
            The indices of the keys not found.
        """
        with self._lock:
            missing = []
            for i, key in enumerate(keys):
                if key in self._entries:
                    self._entries.move_to_end(key)
                else:
                    missing.append(i)
            return missing

    def get_rows(self, keys: Sequence[Hashable]) -> tuple[torch.Tensor | None, list[int]]:
        """Copy the entries of `keys` into one new tensor, row `i` for `keys[i]`.

        Found entries are marked recently used. Entries are assumed to share one
        shape and dtype (the rows of one model).

        Returns:
            The tensor (`None` when no key is found) and the indices of the keys
            not found, whose rows of the tensor are left uninitialised.
        """
        with self._lock:  # slots must not be reused while they are copied
            entries = [self._entries.get(key) for key in keys]
            missing = [i for i, entry in enumerate(entries) if entry is None]
            if len(missing) == len(keys):
                return None, missing
            first = next(entry for entry in entries if entry is not None)
            rows = first[0].rows.new_empty((len(keys), *first[0].rows.shape[1:]), device=first[2])
            found: dict[int, tuple[RowPool, list[int], list[int]]] = {}  # positions, slots
            for i, (key, entry) in enumerate(zip(keys, entries, strict=True)):
                if entry is not None:
                    self._entries.move_to_end(key)
                    pool_found = found.setdefault(id(entry[0]), (entry[0], [], []))
                    pool_found[1].append(i)
                    pool_found[2].append(entry[1])
            for pool, positions, slots in found.values():
                gather_rows(rows, pool.rows, positions, slots)
            return rows, missing

    def store_rows(
        self, keys: Sequence[Hashable], values: torch.Tensor | Sequence[torch.Tensor]
    ) -> None:
        """Store `values[i]` under `keys[i]` for every `i`, in one copy.

        Args:
            keys: One key per row; later rows count as more recently used (a
                repeated key keeps its last row).
            values: The rows: a tensor with `len(keys)` entries along dimension
                0, or `len(keys)` tensors of one shape, dtype and device (e.g.
                views of several steps' results), gathered as they are copied.
        """
        if self.maxsize == 0 or len(keys) == 0:
            return
        limit = self._row_limit(values[0].numel() * values[0].element_size())
        index_of = {key: index for index, key in enumerate(keys)}  # a key's last row
        start = max(len(index_of) - limit, 0)
        kept = list(index_of)[start:]
        if kept:
            with self._lock:
                self._store(kept, list(index_of.values())[start:], values, limit)

    def _row_limit(self, row_nbytes: int) -> int:
        """Most rows of `row_nbytes` bytes the bounds allow."""
        if self.max_bytes is None:
            return self.maxsize
        return min(self.maxsize, self.max_bytes // max(row_nbytes, 1))

    def _store(
        self,
        kept: list[Hashable],
        indices: list[int],
        values: torch.Tensor | Sequence[torch.Tensor],
        limit: int,
    ) -> None:
        for key in kept:
            self._drop(key)
        row_nbytes = values[0].numel() * values[0].element_size()
        max_bytes = math.inf if self.max_bytes is None else self.max_bytes
        while self._entries and (
            len(self._entries) + len(kept) > self.maxsize
            or self.nbytes + len(kept) * row_nbytes > max_bytes
        ):
            pool, slot, _ = self._entries.popitem(last=False)[1]
            pool.free.add(slot)
            self.nbytes -= pool.row_nbytes
        if isinstance(values, torch.Tensor):
            if indices != list(range(values.shape[0])):
                values = values[indices]
            like = values
        else:
            values = [values[i] for i in indices]
            like = values[0].unsqueeze(0)
        device = like.device
        if self.move_to_cpu and device.type != "cpu":  # one copy to the host
            values = like = (
                values if isinstance(values, torch.Tensor) else torch.stack(values)
            ).cpu()
        pool_key = (like.shape[1:], like.dtype, like.device)
        pool = self._pools.get(pool_key)
        if pool is None:
            pool = self._pools[pool_key] = RowPool(like, len(kept), limit)
        for key, slot in zip(kept, pool.put(values, limit), strict=True):
            self._entries[key] = (pool, slot, device)
        self.nbytes += len(kept) * pool.row_nbytes

    def clear(self) -> None:
        """Remove every entry.

        The memory of the stored rows is kept for the next entries (it holds
        at most `maxsize` rows per row shape): memory used for the first time
        costs a page fault per page, about as much as the copy itself.
        """
        with self._lock:
            for pool, slot, _ in self._entries.values():
                pool.free.add(slot)
            self._entries.clear()
            self.nbytes = 0

    def remove_if(self, predicate: Callable[[Hashable], bool]) -> int:
        """Remove the entries whose key satisfies `predicate`.

        Args:
            predicate: Called with each key.

        Returns:
            Number of entries removed.
        """
        with self._lock:
            doomed = [key for key in self._entries if predicate(key)]
            for key in doomed:
                self._drop(key)
        return len(doomed)

    def _drop(self, key: Hashable) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            entry[0].free.add(entry[1])
            self.nbytes -= entry[0].row_nbytes


class _Block:
    """One allocated KV tensor; the nodes whose segments view it keep it alive."""

    __slots__ = ("nbytes", "users")

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.users = 1


class PrefixNode:
    """A node of `KVPrefixCache`: an edge of one or more tokens and their key/values.

    Attributes:
        tokens: The token ids on the edge from the parent to this node.
        children: Child nodes by the first token of their edge.
        parent: The parent node (`None` at a root).
        last_access: Value of the cache's clock when the node was last used.
        lock_count: Number of running users; a locked node is never evicted.
    """

    __slots__ = ("tokens", "children", "parent", "_kv", "_block", "last_access", "lock_count")

    def __init__(
        self,
        tokens: tuple[int, ...],
        parent: PrefixNode | None,
        kv: torch.Tensor | None,
        block: _Block | None,
        clock: int,
    ):
        self.tokens = tokens
        self.children: dict[int, PrefixNode] = {}
        self.parent = parent
        self._kv = kv  # a view whose token dimension (-2) may extend past the edge (capacity)
        self._block = block
        self.last_access = clock
        self.lock_count = 0

    @property
    def past_key_values(self) -> torch.Tensor | None:
        """The key/values of this edge's tokens (token dimension -2), `None` at a root."""
        return None if self._kv is None else self._kv.narrow(-2, 0, len(self.tokens))

    @property
    def capacity(self) -> int:
        """Tokens this node's tensor can hold before it must be reallocated."""
        return 0 if self._kv is None else self._kv.shape[-2]


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of a token sequence, as found by `KVPrefixCache.match`.

    Attributes:
        node: The deepest node reached; when the match ends inside its edge,
            only the first `node_tokens` tokens of the edge belong to the match.
        length: Number of tokens matched.
        node_tokens: Tokens of `node`'s edge that are part of the match.
        segments: Key/values of the matched tokens, in order, as views of the
            cached tensors (no copies); they stay valid after eviction.
    """

    node: PrefixNode
    length: int
    node_tokens: int
    segments: tuple[torch.Tensor, ...]

    def key_values(self) -> torch.Tensor | None:
        """The matched key/values concatenated along the token dimension (a copy)."""
        return torch.cat(self.segments, dim=-2) if self.segments else None


class KVPrefixCache:
    """A radix tree of key/value tensors for token prefixes, bounded in bytes.

    Every stored sequence can serve any later sequence that extends one of its
    prefixes. A node holds the key/values of the tokens on its edge in one
    tensor whose token dimension is -2 (e.g. `[layers, 2, kv_heads, tokens,
    head_dim]`); a path from a root spells a cached prefix. Separate roots keep
    namespaces (e.g. LoRA adapters) apart. Three verbs: `match` the longest
    cached prefix, `insert` new key/values after it, `evict` least-recently-used
    unlocked leaves. A leaf that keeps growing (one sampler particle) is
    extended in place with geometric over-allocation, so paths stay short;
    splitting an edge creates views of the same tensor, so it copies nothing.

    Memory is accounted exactly: `nbytes` is the size of every tensor the cache
    keeps alive (spare capacity included), and it never exceeds `max_bytes`.

    Args:
        max_bytes: Memory budget in bytes.

    Raises:
        ValueError: If `max_bytes` is negative.
    """

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be non-negative, got {max_bytes}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.peak_nbytes = 0
        self._roots: dict[Hashable, PrefixNode] = {}
        self._clock = 0

    def root(self, namespace: Hashable = None) -> PrefixNode:
        """The root node of `namespace` (created when missing)."""
        node = self._roots.get(namespace)
        if node is None:
            node = self._roots[namespace] = PrefixNode((), None, None, None, self._clock)
        return node

    def match(
        self, token_ids: Sequence[int], namespace: Hashable = None, max_length: int | None = None
    ) -> PrefixMatch:
        """Find the longest cached prefix of `token_ids` and mark it recently used.

        Args:
            token_ids: The sequence to look up.
            namespace: The tree to search.
            max_length: Match at most this many tokens.

        Returns:
            The match (length 0 at the root when nothing is cached).
        """
        path = self._walk(tuple(token_ids), namespace, max_length)
        segments = tuple(node._kv.narrow(-2, 0, used) for node, used in path)
        if not path:
            return PrefixMatch(self.root(namespace), 0, 0, ())
        return PrefixMatch(path[-1][0], sum(used for _, used in path), path[-1][1], segments)

    def _walk(
        self, token_ids: tuple[int, ...], namespace: Hashable, max_length: int | None = None
    ) -> list[tuple[PrefixNode, int]]:
        """The nodes of the longest cached prefix, with the tokens of each edge it uses."""
        self._clock += 1
        limit = len(token_ids) if max_length is None else min(max_length, len(token_ids))
        node, matched, path = self.root(namespace), 0, []
        while matched < limit:
            child = node.children.get(token_ids[matched])
            if child is None:
                break
            used = _common_length(child.tokens, token_ids, matched, limit)
            child.last_access = self._clock
            path.append((child, used))
            matched += used
            node = child
            if used < len(child.tokens):
                break
        return path

    def insert(
        self,
        token_ids: Sequence[int],
        start: int,
        key_values: torch.Tensor,
        namespace: Hashable = None,
    ) -> int:
        """Store the key/values of `token_ids[start:]`.

        Tokens already cached are skipped. Nothing is stored when `token_ids[:start]`
        is not cached (there is nothing to attach to) or when the budget cannot
        make room after evicting every unlocked leaf.

        Args:
            token_ids: The whole sequence.
            start: Index of the first token `key_values` belongs to.
            key_values: Key/values of `token_ids[start:]` along dimension -2.
            namespace: The tree to store into.

        Returns:
            Number of tokens newly stored.
        """
        token_ids = tuple(token_ids)
        path = self._walk(token_ids, namespace)
        length = sum(used for _, used in path)
        if length < start or length == len(token_ids):
            return 0
        node = path[-1][0] if path else self.root(namespace)
        if path and path[-1][1] < len(node.tokens):
            node = self._split(node, path[-1][1])
        tokens = token_ids[length:]
        new_kv = key_values.narrow(-2, length - start, len(tokens))
        self.lock(node)
        try:
            if node.parent is not None and not node.children and self._extend(node, tokens, new_kv):
                return len(tokens)
            return len(tokens) if self._add_child(node, tokens, new_kv) else 0
        finally:
            self.unlock(node)

    def lock(self, node: PrefixNode) -> None:
        """Protect `node` and its ancestors from eviction until `unlock(node)`."""
        while node is not None:
            node.lock_count += 1
            node = node.parent

    def unlock(self, node: PrefixNode) -> None:
        """Undo one `lock(node)`."""
        while node is not None:
            node.lock_count -= 1
            node = node.parent

    def evict(self, nbytes: int) -> int:
        """Evict least-recently-used unlocked leaves until `nbytes` bytes are freed.

        Args:
            nbytes: Bytes to free.

        Returns:
            Bytes actually freed (less when everything left is locked).
        """
        heap = [(n.last_access, id(n), n) for n in self._nodes() if self._evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < nbytes:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            freed += self._remove(node)
            if self._evictable(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def clear(self) -> None:
        """Drop every cached tensor."""
        self._roots.clear()
        self.nbytes = 0

    def drop(self, namespace: Hashable) -> int:
        """Drop the tree of `namespace` and every tensor only it kept alive.

        Args:
            namespace: The tree to drop (nothing happens when it does not exist).

        Returns:
            Bytes freed.
        """
        root = self._roots.pop(namespace, None)
        if root is None:
            return 0
        freed, stack = 0, list(root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            freed += self._release(node._block)
        return freed

    def __len__(self) -> int:
        """Number of nodes holding key/values."""
        return sum(1 for node in self._nodes() if node.parent is not None)

    def _nodes(self) -> Iterator[PrefixNode]:
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    @staticmethod
    def _evictable(node: PrefixNode) -> bool:
        return node.parent is not None and not node.children and node.lock_count <= 0

    def _remove(self, node: PrefixNode) -> int:
        del node.parent.children[node.tokens[0]]
        node.parent = None
        return self._release(node._block)

    def _release(self, block: _Block) -> int:
        block.users -= 1
        if block.users > 0:
            return 0
        self.nbytes -= block.nbytes
        return block.nbytes

    def _allocate(self, like: torch.Tensor, n_tokens: int) -> tuple[torch.Tensor, _Block] | None:
        shape = (*like.shape[:-2], n_tokens, like.shape[-1])
        nbytes = math.prod(shape) * like.element_size()
        if self.nbytes + nbytes > self.max_bytes:
            # Evicting a little ahead (1/64 of the budget) spares a tree scan per insertion.
            self.evict(max(self.nbytes + nbytes - self.max_bytes, self.max_bytes // 64))
            if self.nbytes + nbytes > self.max_bytes:
                return None
        self.nbytes += nbytes
        self.peak_nbytes = max(self.peak_nbytes, self.nbytes)
        return like.new_empty(shape), _Block(nbytes)

    def _split(self, node: PrefixNode, at: int) -> PrefixNode:
        """Cut `node`'s edge after `at` tokens; return the new node holding the first part."""
        head = PrefixNode(
            node.tokens[:at], node.parent, node._kv.narrow(-2, 0, at), node._block, node.last_access
        )
        head.lock_count = node.lock_count
        node._block.users += 1
        node.parent.children[node.tokens[0]] = head
        head.children[node.tokens[at]] = node
        node.parent = head
        node._kv = node._kv.narrow(-2, at, node.capacity - at)
        node.tokens = node.tokens[at:]
        return head

    def _extend(self, node: PrefixNode, tokens: tuple[int, ...], kv: torch.Tensor) -> bool:
        old, new = len(node.tokens), len(node.tokens) + len(tokens)
        if new > node.capacity:
            allocated = self._allocate(kv, new + new // 2 + 4)
            if allocated is None:
                return False
            storage, block = allocated
            storage.narrow(-2, 0, old).copy_(node.past_key_values)
            self._release(node._block)
            node._kv, node._block = storage, block
        node._kv.narrow(-2, old, len(tokens)).copy_(kv)
        node.tokens = node.tokens + tokens
        node.last_access = self._clock
        return True

    def _add_child(self, parent: PrefixNode, tokens: tuple[int, ...], kv: torch.Tensor) -> bool:
        allocated = self._allocate(kv, len(tokens))
        if allocated is None:
            return False
        storage, block = allocated
        storage.copy_(kv)
        parent.children[tokens[0]] = PrefixNode(tokens, parent, storage, block, self._clock)
        return True


def _common_length(edge: tuple[int, ...], ids: tuple[int, ...], start: int, limit: int) -> int:
    """Length of the common prefix of `edge` and `ids[start:limit]`."""
    n = min(len(edge), limit - start)
    if edge[:n] == ids[start : start + n]:
        return n
    i = 1  # the first token matched already (children are keyed by it)
    while i < n and edge[i] == ids[start + i]:
        i += 1
    return i
