"""`TokenCharacterTrie`: a vocabulary's byte strings as a trie, and reductions over it.

The trie is built as arrays, items sorted by their symbol strings, and reduced
by a plan of a few vectorised steps per level (see `genlm.backend.trie.plan`,
which describes the layout, the node ids and the plan). This module holds the
public class: the attributes built from those arrays (`children`, `word2leaf`,
`leaf2word`, `node2prefix`), the checks of weight vectors, and the reductions,
which run the plan with numpy one weight row at a time (a batch's rows are
shared among one thread per core, up to 8).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Hashable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from operator import itemgetter
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from genlm.backend.trie.plan import (
    _plan,
    _run_plan,
    _sort_trie,
    _SortedTrie,
    _symbol_keys,
    _SymbolCodes,
    _workspace_size,
)

if TYPE_CHECKING:
    import graphviz

_MAX_ROW_THREADS = 8


def _row_thread_count() -> int:
    """How many threads share a batch's rows.

    One per core this process may run on, at most `_MAX_ROW_THREADS`: the work is
    bound by memory traffic, and each thread keeps a workspace.
    """
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    return min(cores, _MAX_ROW_THREADS)


_ROW_POOLS: dict[int, ThreadPoolExecutor] = {}


def _row_pool() -> ThreadPoolExecutor:
    """Threads that reduce a batch's rows beside the calling thread.

    One pool per process id, so that a forked child never waits on its parent's threads.
    """
    pool = _ROW_POOLS.get(os.getpid())
    if pool is None:
        pool = ThreadPoolExecutor(max(1, _row_thread_count() - 1), thread_name_prefix="genlm-trie")
        pool = _ROW_POOLS.setdefault(os.getpid(), pool)
    return pool


_TRIE_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def _in_package(filename: str) -> bool:
    return os.path.dirname(os.path.abspath(filename)) == _TRIE_PACKAGE


def _outside_caller_stacklevel() -> int:
    """The `stacklevel` of `warnings.warn` that names the first caller outside this package.

    For a warning raised by a function of this package that calls this one, so that the
    warning points at the user's code whichever class or factory (`from_vocab`) built the
    trie (and the default filters, which show a `DeprecationWarning` in `__main__`, apply).
    """
    frame, level = sys._getframe(1), 1
    while frame is not None and _in_package(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


def _warn_plain_bytes(decode: list, plain_bytes: list[int]) -> None:
    """Warn once that items are plain byte strings rather than `Token`s."""
    first = plain_bytes[0]
    warnings.warn(
        "Passing plain bytes to TokenCharacterTrie is deprecated: pass Token items instead, "
        "e.g. the byte_vocab of decode_vocab(tokenizer) or Token(token_id, byte_string) "
        f"({len(plain_bytes)} of the {len(decode)} items are plain bytes, the first is "
        f"decode[{first}] = {bytes(decode[first])!r})",
        DeprecationWarning,
        stacklevel=_outside_caller_stacklevel(),
    )


# --------------------------------------------------------------------------- public class


class _PrefixMap(Mapping):
    """Read-only map node id -> the symbols on the path from the root, computed on access.

    A prefix is `bytes` when all its symbols are byte values, else a tuple of symbols.
    """

    def __init__(
        self,
        sorted_keys: list[bytes],
        width: int,
        codes: _SymbolCodes | None,
        rank: np.ndarray,
        length: np.ndarray,
    ):
        self._keys = sorted_keys
        self._width = width
        self._codes = codes
        self._rank = rank
        self._length = length

    def __getitem__(self, node: int) -> bytes | tuple:
        if isinstance(node, bool) or not isinstance(node, int | np.integer):
            raise KeyError(node)
        if not 0 <= node < len(self._rank):
            raise KeyError(node)
        if not self._keys:
            return b""
        key = self._keys[self._rank[node]][: self._length[node] * self._width]
        if self._width == 1:
            return key
        codes = np.frombuffer(key, dtype=">u4")
        if codes.size == 0 or codes.max() < 256:
            return bytes(codes.astype(np.uint8))
        return tuple(self._codes.symbol(int(code)) for code in codes)

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self._rank)))

    def __len__(self) -> int:
        return len(self._rank)


def _symbol_label(symbol: Hashable) -> str:
    if isinstance(symbol, int) and 0 <= symbol < 256:
        char = chr(symbol)
        if char.isprintable() and char.isascii() and char not in "\\\"' ":
            return char
        return {32: "␣"}.get(symbol, f"0x{symbol:02X}")
    return repr(symbol).replace("\\", "\\\\")


def _as_numpy(ws: Any) -> Any:
    """A torch tensor (any device) as a numpy array; anything else unchanged.

    Dtype conversion is left to numpy: a torch conversion would start torch's
    thread pool for a job one core does fast.
    """
    if not isinstance(ws, torch.Tensor):
        return ws
    tensor = ws.detach().cpu()
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16
        tensor = tensor.float()
    return tensor.numpy()


class TokenCharacterTrie:
    """A trie over the symbol strings of a vocabulary, with weight reductions per node.

    Every item of `decode` (a `Token`, plain `bytes`, or any iterable of
    hashable symbols, such as an end-of-sequence object) is a path of symbols
    from the root, ending in a leaf of its own. Position `i` of a weight vector
    belongs to `decode[i]`. Plain byte strings (`bytes`, `bytearray`,
    `memoryview`) still work but are deprecated: pass `Token`s, e.g. the
    `byte_vocab` of `decode_vocab`.

    Attributes:
        decode: The vocabulary, as given.
        root: Node id of the empty prefix (0).
        children: List indexed by node id of dicts `symbol -> child node id`; the
            item `decode[i]` ends in its own leaf, reached by the edge `(None, i)`.
            Byte symbols are ints.
        word2leaf: Item key -> leaf id; the key is `(byte_string, token_id)` for a
            `Token` and the item itself otherwise (a tuple of its symbols if the
            item is unhashable).
        leaf2word: Leaf id -> item key (the inverse of `word2leaf`).
        node2prefix: Read-only mapping node id -> the symbols on the path from the
            root: `bytes` when they are all byte values, else a tuple of symbols.
            A leaf's prefix is its item's symbols.

    Node ids are chosen for the reductions: the root is 0, the leaves follow in the
    order of their items' symbols, then the branching nodes, then the nodes with a
    single child. The reductions are vectorised (see the module docstring) and
    return float64 arrays. A batch's rows are shared among one thread per core, up
    to 8 (numpy releases the GIL in the gathers and element-wise passes that do the
    work). Each computing thread uses a float64 workspace kept by the trie between
    calls (about 5 MB for qwen2's vocabulary). The trie also keeps a reference to
    each result it returns and writes a later result of the same shape into that
    memory once the caller has dropped it and every view of it: a result is never
    changed while anything refers to it, and a caller that drops each result
    before the next call (as a sampler does) does not pay for fresh memory
    (124 MB for a batch of 32 on qwen2's vocabulary).

    Args:
        decode: The vocabulary items.

    Raises:
        ValueError: If two items have the same key (duplicates); the message
            starts "Duplicate word in vocabulary" and names the item and both
            positions.
        TypeError: If an item is not bytes or an iterable of hashable symbols.

    Warns:
        DeprecationWarning: Once per trie, if any item is a plain byte string
            rather than a `Token` ("Passing plain bytes to TokenCharacterTrie is
            deprecated ..."). The warning points at the code that built the
            trie, also through `ParallelTokenCharacterTrie` and
            `AsyncTokenCharacterTrie.from_vocab`.
    """

    def __init__(self, decode: Sequence):
        self.decode = list(decode)
        keys, width, codes, word_keys, plain_bytes = _symbol_keys(self.decode)
        if plain_bytes:
            _warn_plain_bytes(self.decode, plain_bytes)
        self._check_duplicates(word_keys)
        trie = _sort_trie(keys, width)
        self._plan, position = _plan(trie, len(self.decode))
        self._spare_workspaces: list[np.ndarray] = []
        self._latest_outputs: list[np.ndarray] = []
        self.root = 0
        self.children = self._children(trie, position, width, codes)
        leaf_of_item = np.empty(len(self.decode), dtype=np.int64)
        leaf_of_item[trie.order] = position[trie.leaf_of_rank]
        leaf_ids = leaf_of_item.tolist()
        self.word2leaf = dict(zip(word_keys, leaf_ids, strict=True))
        self.leaf2word = dict(zip(leaf_ids, word_keys, strict=True))
        rank, prefix_length = np.empty_like(trie.rank), np.empty_like(trie.depth)
        rank[position] = trie.rank
        prefix_length[position] = trie.depth - trie.is_leaf
        self.node2prefix = _PrefixMap(trie.keys, width, codes, rank, prefix_length)
        self._index_trie(trie, position)

    def _index_trie(self, trie: _SortedTrie, position: np.ndarray) -> None:
        """Hook for subclasses that index the trie further (nothing here).

        Called at the end of `__init__` with the sorted trie and `position`, the node
        id of each of its nodes (pre-order of the sorted trie).
        """

    @staticmethod
    def _check_duplicates(word_keys: list[Hashable]) -> None:
        first_position: dict[Hashable, int] = {}
        for position, key in enumerate(word_keys):
            earlier = first_position.setdefault(key, position)
            if earlier != position:
                raise ValueError(
                    f"Duplicate word in vocabulary: {key!r} is both decode[{earlier}] and "
                    f"decode[{position}]; every item must be distinct"
                )

    @staticmethod
    def _children(
        trie: _SortedTrie, position: np.ndarray, width: int, codes: _SymbolCodes | None
    ) -> list[dict]:
        """The `children` dicts, indexed by node id (`position` of each pre-order node)."""
        children: list[dict] = [{} for _ in range(len(trie.parent))]
        inner = np.flatnonzero(~trie.is_leaf)[1:]
        code_at = trie.key_starts[trie.rank[inner]] + trie.depth[inner] - 1
        symbols = trie.codes[code_at].tolist()
        if width != 1:
            symbols = [code if code < 256 else codes.symbol(code) for code in symbols]
        leaves = trie.leaf_of_rank
        leaf_edges = [(None, i) for i in trie.order.tolist()]
        for nodes, keys in ((inner, symbols), (leaves, leaf_edges)):
            if len(nodes):
                parents = itemgetter(*position[trie.parent[nodes]].tolist())(children)
                if len(nodes) == 1:
                    parents = (parents,)
                for parent, key, node in zip(parents, keys, position[nodes].tolist(), strict=True):
                    parent[key] = node
        return children

    # ------------------------------------------------------------------ weights

    def _vector(self, ws: Any) -> np.ndarray:
        """`ws` as a 1-D numpy array of floats of the vocabulary's length.

        Float arrays are kept as they are (no copy); `_run_plan` converts each row
        to float64 in its workspace.
        """
        array = np.asarray(_as_numpy(ws))
        if array.dtype.kind != "f":
            array = array.astype(np.float64)
        if array.shape != (len(self.decode),):
            raise ValueError(
                f"expected a weight vector of shape ({len(self.decode)},) (one weight per "
                f"vocabulary item), got shape {array.shape}"
            )
        return array

    def _matrix(self, ws: Any) -> np.ndarray | list[np.ndarray]:
        """A batch of weight vectors: a 2-D numpy array of floats, or a list of vectors.

        A list stays a list of validated vectors (`_run_plan` reads one row at a
        time), so that a batch gathered from separate vectors is not copied.
        """
        ws = _as_numpy(ws)
        if not isinstance(ws, np.ndarray):
            return [self._vector(row) for row in ws]
        array = ws if ws.dtype.kind == "f" else ws.astype(np.float64)
        if array.ndim != 2 or array.shape[1] != len(self.decode):
            raise ValueError(
                f"expected a batch of weight vectors of shape (batch, {len(self.decode)}), "
                f"got shape {array.shape}"
            )
        return array

    def _reduce(self, weights: Sequence[np.ndarray], op: np.ufunc, empty: float) -> np.ndarray:
        """Every node's value for each row; a batch's rows are split across the cores.

        The calling thread reduces the first share of the rows and `_row_pool`'s
        threads the others (numpy releases the GIL in the plan's gathers and
        element-wise passes), each share in a workspace of its own.
        """
        if not self.decode:
            return np.full((len(weights), 1), empty)
        out = self._output(len(weights))
        threads = min(len(weights), _row_thread_count())
        bounds = np.linspace(0, len(weights), threads + 1).astype(int)
        shares = [slice(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
        futures = [
            _row_pool().submit(self._reduce_rows, weights[rows], op, out[rows])
            for rows in shares[1:]
        ]
        try:
            if shares:
                self._reduce_rows(weights[shares[0]], op, out[shares[0]])
        finally:
            wait(futures)
        for future in futures:
            future.result()
        return out

    def _output(self, rows: int) -> np.ndarray:
        """A `(rows, nodes)` float64 array for a result: fresh, or a released earlier one.

        Fresh memory costs a page fault per page on first write (a batch of 32 rows
        of qwen2's vocabulary is 124 MB), so the trie keeps a reference to each result
        it returns, and writes a later result of the same shape into it once nothing
        else refers to it (its caller has dropped it and every view of it). One
        such result per thread that calls at the same time is kept.
        """
        try:
            latest = self._latest_outputs.pop()
        except IndexError:
            latest = None
        # Two references when released: `latest` and `getrefcount`'s argument.
        if latest is not None and latest.shape[0] == rows and sys.getrefcount(latest) == 2:
            out = latest
        else:
            out = np.empty((rows, self._plan.num_nodes))
        self._latest_outputs.append(out)
        return out

    def _reduce_rows(self, weights: Sequence[np.ndarray], op: np.ufunc, out: np.ndarray) -> None:
        # Workspaces are kept between calls (fresh memory costs page faults): a call
        # takes a spare one, or allocates one when all are in use, and puts it back.
        try:
            workspace = self._spare_workspaces.pop()
        except IndexError:
            workspace = np.empty(_workspace_size(self._plan))
        try:
            _run_plan(self._plan, weights, op, workspace, out)
        finally:
            self._spare_workspaces.append(workspace)

    def weight_sum(self, ws: Any) -> np.ndarray:
        """For every node, the sum of the weights of the items below it.

        Args:
            ws: One weight per item (numpy array or torch tensor on any device).

        Returns:
            A float64 array with one value per node (computed in float64).

        Raises:
            ValueError: If `ws` does not hold one weight per item.
        """
        return self._reduce(self._vector(ws)[None], np.add, 0.0)[0]

    def weight_max(self, ws: Any) -> np.ndarray:
        """For every node, the max of the weights of the items below it.

        Exact for any real weights, including negative values and `-inf`.

        Args:
            ws: One weight per item (numpy array or torch tensor on any device).

        Returns:
            A float64 array with one value per node.

        Raises:
            ValueError: If `ws` does not hold one weight per item.
        """
        return self._reduce(self._vector(ws)[None], np.maximum, -np.inf)[0]

    def batch_weight_sum(self, ws: Any) -> np.ndarray:
        """`weight_sum` of every row of a batch.

        Args:
            ws: A 2-D array or tensor, or a list of weight vectors.

        Returns:
            A float64 array of shape `(batch, number of nodes)`.

        Raises:
            ValueError: If a row does not hold one weight per item.
        """
        return self._reduce(self._matrix(ws), np.add, 0.0)

    def batch_weight_max(self, ws: Any) -> np.ndarray:
        """`weight_max` of every row of a batch.

        Args:
            ws: A 2-D array or tensor, or a list of weight vectors.

        Returns:
            A float64 array of shape `(batch, number of nodes)`.

        Raises:
            ValueError: If a row does not hold one weight per item.
        """
        return self._reduce(self._matrix(ws), np.maximum, -np.inf)

    # ------------------------------------------------------------------ display

    def visualize(self, ws: Any = None) -> graphviz.Digraph:
        """Draw the trie with graphviz.

        Args:
            ws: Optional weights, one per trie node (indexed by node id), shown
                at each node: e.g. the output of `weight_sum` or `weight_max`.
                A list, numpy array or tensor (any device).

        Returns:
            A `graphviz.Digraph` (render it with `.render()` or display it in a notebook).

        Raises:
            ValueError: If `ws` does not hold one weight per trie node.
        """
        import graphviz

        masses = None
        if ws is not None:
            masses = np.asarray(_as_numpy(ws), dtype=np.float64).reshape(-1)
            if masses.shape[0] != len(self.children):
                raise ValueError(
                    f"visualize needs one weight per trie node ({len(self.children)} nodes, "
                    f"e.g. the output of weight_sum), got {masses.shape[0]}"
                )
        graph = graphviz.Digraph(graph_attr={"rankdir": "LR"}, node_attr={"fontsize": "10"})
        for node, edges in enumerate(self.children):
            is_leaf = node in self.leaf2word
            label = repr(self.leaf2word[node]).replace("\\", "\\\\") if is_leaf else ""
            if masses is not None:
                label = f"{label}\\n{masses[node]:.3g}" if label else f"{masses[node]:.3g}"
            graph.node(str(node), label=label or " ", shape="box" if is_leaf else "circle")
            for symbol, child in edges.items():
                is_end = isinstance(symbol, tuple) and len(symbol) == 2 and symbol[0] is None
                edge_label = "end" if is_end else _symbol_label(symbol)
                graph.edge(
                    str(node), str(child), label=edge_label, style="dashed" if is_end else "solid"
                )
        return graph
