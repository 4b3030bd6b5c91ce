"""`ParallelTokenCharacterTrie`: the trie's reductions on a torch device, in a few kernels.

The trie and its node ids are those of `TokenCharacterTrie` (see
`genlm.backend.trie.base`). For a device, the class builds once, at
construction, the items below every node as a sparse matrix in compressed
sparse row (CSR) form, on the device: row `n` lists the positions in `decode`
of the items below node `n`, in increasing order. In the base class's sorted
trie the items below a node are a contiguous range of the sorted items, so the
matrix comes from those ranges in a few vectorised numpy passes (for qwen2's
vocabulary: 1,283,066 (node, item) pairs over 485,592 nodes, 16.5 MiB with
32-bit indices, about 80 ms on one CPU core).

A batch of weight rows is then reduced by a fixed number of kernels, whatever
the depth of the trie:

- sums: one sparse-dense product, the CSR matrix (float64 ones) times the
  transposed float64 weights (cuSPARSE on CUDA), and one transposing copy into
  the `(batch, nodes)` result;
- maxima: the weights of every (node, item) pair are gathered as `(rows,
  pairs)`, and `torch.segment_reduce` takes the max along the pairs, in chunks
  of rows whose gathered weights stay under `_GATHER_BYTES`. Torch's CUDA
  kernel loops over a segment in one thread, and the root's segment holds
  every item, so segments are pieces of at most `_PIECE` pairs: one segmented
  max over the pieces, a second over each node's pieces (when a node has
  several).

The results, a new float64 numpy array per call, reach the host through a pinned
staging buffer (`_to_host`): a batch's results are large, and fresh host memory
filled by a plain `.cpu()` costs more than the reduction itself.

Every node has at least one item below it, so no segment is empty (an empty
vocabulary goes to the base class). Maxima are exact; sums add the same terms
as the base class in another order, so they agree to rounding.

On the CPU the class runs the sequential class's numpy path and builds no
matrix: torch's CPU gathers, sparse product and segmented reduction are several
times slower than numpy on this job (docs/tries.md has the figures). The tests
force the device path onto the CPU by overriding `_on_cpu`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from genlm.backend.trie.base import TokenCharacterTrie
from genlm.backend.trie.plan import _SortedTrie

# Most bytes the gathered (row, pair) weights of `weight_max` take at once on the device.
_GATHER_BYTES = 256 * 2**20
# Most bytes of a pinned staging buffer for copying results to the host (see `_to_host`).
_STAGE_BYTES = 32 * 2**20
# Longest run of pairs one segmented-max segment covers: longer ones (the root has every
# item) are cut into pieces, then the pieces' maxima are reduced per node.
_PIECE = 1024


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available; use 'cpu'")
    return resolved


def _to_host(rows: torch.Tensor) -> np.ndarray:
    """`rows` (2-D) as a new numpy array the caller owns.

    From a GPU the rows go through a pinned staging buffer (torch's host allocator
    keeps it for the next call) in blocks of `_STAGE_BYTES`, then into a fresh numpy
    array with torch's multithreaded copy. A batch of results is large (32 rows of
    qwen2's trie: 119 MiB), and its fresh host memory is paid in page faults: a plain
    `.cpu()` measured 70 to 80 ms for those rows on an H200 host, this 7.5 ms.
    """
    if rows.device.type == "cpu":
        return rows.numpy()
    result = np.empty(tuple(rows.shape), dtype=np.float64)
    target = torch.from_numpy(result)
    block = max(1, _STAGE_BYTES // max(1, rows[:1].nbytes))
    stage = torch.empty((min(block, len(rows)), *rows.shape[1:]), dtype=rows.dtype, pin_memory=True)
    for start in range(0, len(rows), block):
        chunk = rows[start : start + block]
        piece = stage[: len(chunk)]
        piece.copy_(chunk)
        target[start : start + len(chunk)].copy_(piece)
    return result


def _node_item_pairs(
    trie: _SortedTrie, position: np.ndarray, num_items: int
) -> tuple[np.ndarray, np.ndarray]:
    """CSR arrays of the items below every node: `crow` (by node id) and `col`.

    The items below node id `n` are `col[crow[n] : crow[n + 1]]`, increasing
    positions in `decode`.
    """
    num_nodes = len(position)
    first, stop = np.empty(num_nodes, dtype=np.int64), np.empty(num_nodes, dtype=np.int64)
    first[position], stop[position] = trie.rank, trie.hi  # sorted ranks first .. stop - 1
    counts = stop - first
    crow = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(counts, out=crow[1:])
    ranks = np.arange(crow[-1]) + np.repeat(first - crow[:-1], counts)
    # Sort each row's items by position (CSR wants increasing columns): sort the keys
    # row * num_items + item, which keeps the rows in order.
    row_keys = np.repeat(np.arange(num_nodes, dtype=np.int64) * num_items, counts)
    col = row_keys + trie.order[ranks]
    col.sort()
    col -= row_keys
    return crow, col


class _NodeItems:
    """The items below every node as a CSR matrix on a device, and the reductions over it."""

    def __init__(self, crow: np.ndarray, col: np.ndarray, num_items: int, device: torch.device):
        # 32-bit indices below 2**31 pairs (every real vocabulary): half the
        # memory, and no conversion per call where the sparse library wants them.
        index = torch.int32 if len(col) < 2**31 else torch.int64
        self.crow = torch.from_numpy(crow).to(device, index)
        self.col = torch.from_numpy(col).to(device, index)
        ones = torch.ones(len(col), dtype=torch.float64, device=device)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta")
            warnings.filterwarnings("ignore", "Sparse invariant checks are implicitly disabled")
            self.matrix = torch.sparse_csr_tensor(
                self.crow, self.col, ones, size=(len(crow) - 1, num_items), check_invariants=False
            )
        self.num_nodes = len(crow) - 1
        self.rows_per_gather = max(1, _GATHER_BYTES // (8 * max(1, len(col))))
        pieces = (np.diff(crow) + _PIECE - 1) // _PIECE  # every node has an item: >= 1
        piece_offsets = np.zeros(len(pieces) + 1, dtype=np.int64)
        np.cumsum(pieces, out=piece_offsets[1:])
        starts = np.repeat(crow[:-1], pieces) + _PIECE * (
            np.arange(piece_offsets[-1]) - np.repeat(piece_offsets[:-1], pieces)
        )
        # Pair offsets of the pieces, and, when some node has several, piece offsets of the nodes.
        self.pieces = torch.from_numpy(np.append(starts, len(col))).to(device, index)
        self.nodes = None
        if piece_offsets[-1] > self.num_nodes:
            self.nodes = torch.from_numpy(piece_offsets).to(device, index)

    def nbytes(self) -> int:
        """Bytes of the index and value tensors."""
        tensors = [self.crow, self.col, self.matrix.values(), self.pieces]
        tensors += [] if self.nodes is None else [self.nodes]
        return sum(t.numel() * t.element_size() for t in tensors)

    def sums(self, weights: torch.Tensor) -> torch.Tensor:
        """Every node's sum for each row of `weights` (float64, `(batch, num_items)`)."""
        return (self.matrix @ weights.T).T.contiguous()

    def maxima(self, weights: torch.Tensor) -> torch.Tensor:
        """Every node's max for each row of `weights` (float64, `(batch, num_items)`).

        Each (row, segment) of a segmented max may be one thread's sequential loop
        (torch's CUDA kernel for 2-D data), so no segment covers more than
        `_PIECE` pairs: the pieces' maxima, then the nodes' maxima over their pieces.
        """
        chunks = []
        for rows in weights.split(self.rows_per_gather):
            values = rows.index_select(1, self.col)
            for offsets in (self.pieces, self.nodes):
                if offsets is not None:
                    offsets = offsets.expand(len(rows), -1)
                    values = torch.segment_reduce(values, "max", offsets=offsets, axis=1)
            chunks.append(values)
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


class ParallelTokenCharacterTrie(TokenCharacterTrie):
    """`TokenCharacterTrie` with its reductions run on a torch device in a few kernels.

    Same attributes, methods, node ids and results as `TokenCharacterTrie`
    (float64 numpy arrays; `weight_max` equal bit for bit, `weight_sum` to
    rounding, as the terms are added in another order). On CUDA the items below
    every node are built once on the device as a sparse CSR matrix, weight
    vectors are moved there, and a batch is reduced by a fixed number of
    kernels whatever the depth of the trie: one sparse-dense product for the
    sums, one gather and two segmented maxima (per chunk of rows) for the maxima
    (see the module docstring). On the CPU the reductions run the sequential
    class's numpy path, which is faster there, and no matrix is built.

    Args:
        decode: The vocabulary items (see `TokenCharacterTrie`).
        device: `"cpu"` or `"cuda"` (or `"cuda:N"`); default CUDA when available, else CPU.

    Raises:
        ValueError: If `device` is not a CPU or CUDA device, or CUDA is requested but
            not available; or if `decode` has duplicate items ("Duplicate word in
            vocabulary ...").

    Warns:
        DeprecationWarning: Once, if items are plain bytes rather than `Token`s (see
            `TokenCharacterTrie`).
    """

    def __init__(self, decode: Sequence, device: str | torch.device | None = None):
        self.device = _resolve_device(device)
        super().__init__(decode)

    def _index_trie(self, trie: _SortedTrie, position: np.ndarray) -> None:
        self._node_items = None
        if not self._on_cpu():
            crow, col = _node_item_pairs(trie, position, len(self.decode))
            self._node_items = _NodeItems(crow, col, len(self.decode), self.device)

    def _on_cpu(self) -> bool:
        return self.device.type == "cpu"

    def _tensor(self, ws: Any) -> torch.Tensor:
        if isinstance(ws, torch.Tensor):
            return ws.detach().to(self.device, torch.float64)
        return torch.as_tensor(np.asarray(ws, dtype=np.float64), device=self.device)

    def _vector(self, ws: Any) -> np.ndarray | torch.Tensor:
        if self._on_cpu():
            return super()._vector(ws)
        vector = self._tensor(ws)
        if tuple(vector.shape) != (len(self.decode),):
            raise ValueError(
                f"expected a weight vector of shape ({len(self.decode)},) (one weight per "
                f"vocabulary item), got shape {tuple(vector.shape)}"
            )
        return vector

    def _matrix(self, ws: Any) -> np.ndarray | torch.Tensor:
        if self._on_cpu():
            return super()._matrix(ws)
        if isinstance(ws, torch.Tensor | np.ndarray):
            matrix = self._tensor(ws)
        else:
            rows = [self._vector(row) for row in ws]
            empty = torch.empty((0, len(self.decode)), dtype=torch.float64, device=self.device)
            matrix = torch.stack(rows) if rows else empty
        if matrix.ndim != 2 or matrix.shape[1] != len(self.decode):
            raise ValueError(
                f"expected a batch of weight vectors of shape (batch, {len(self.decode)}), "
                f"got shape {tuple(matrix.shape)}"
            )
        return matrix.contiguous()

    def _reduce(self, weights: np.ndarray | torch.Tensor, op: np.ufunc, empty: float) -> np.ndarray:
        if self._on_cpu() or not self.decode:
            return super()._reduce(weights, op, empty)
        if not len(weights):
            return np.empty((0, self._node_items.num_nodes))
        reduce = self._node_items.sums if op is np.add else self._node_items.maxima
        return _to_host(reduce(weights))
