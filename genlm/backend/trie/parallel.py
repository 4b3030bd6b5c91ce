"""`ParallelTokenCharacterTrie`: the trie's reductions as torch operations on a device.

The trie and its reduction plan are those of `TokenCharacterTrie` (see
`genlm.backend.trie.base`); here the plan's index arrays live on the device as
tensors, built once, and a whole batch goes through each step of the plan at
once (gathers, element-wise doubling tables, one final gather), so the work
spreads over CPU threads or GPU cores.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from genlm.backend.trie.base import TokenCharacterTrie, _ReductionPlan


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


class _TorchPlan:
    """A `_ReductionPlan` with its index arrays as tensors on a device."""

    def __init__(self, plan: _ReductionPlan, device: torch.device):
        def tensor(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device)

        self.num_items = plan.num_items
        self.num_groups = plan.num_groups
        self.perm = tensor(plan.perm)
        self.node_slot = tensor(plan.node_slot)
        self.levels = [
            (
                None if level.row is None else tensor(level.row),
                level.start,
                level.stop,
                [tuple(tensor(array) for array in term) for term in level.bits],
            )
            for level in plan.levels
        ]
        self._workspace = torch.empty(0, dtype=torch.float64, device=device)
        self._lock = threading.Lock()

    def _buffer(self, numel: int) -> torch.Tensor:
        """Scratch memory kept between calls (fresh memory costs page faults on every call)."""
        if self._workspace.numel() < numel:
            self._workspace = torch.empty(numel, dtype=torch.float64, device=self._workspace.device)
        return self._workspace[:numel]

    def nbytes(self) -> int:
        tensors = [self.perm, self.node_slot]
        for row, _, _, bits in self.levels:
            tensors += ([] if row is None else [row]) + [t for term in bits for t in term]
        return sum(t.numel() * t.element_size() for t in tensors)

    def run(self, weights: torch.Tensor, op) -> torch.Tensor:
        """Every node's value for each row of `weights` (float64, `(batch, num_items)`).

        Works item-major (one row of `values` per item or group, one column per
        batch row; a single vector stays 1-D), so that every gather moves whole
        rows; returns a `(batch, nodes)` view of a node-major tensor.
        """
        with self._lock:
            return self._run(weights, op)

    def _run(self, weights: torch.Tensor, op) -> torch.Tensor:
        size, single = self.num_items, len(weights) == 1
        columns = () if single else (len(weights),)
        width = 1 if single else len(weights)
        num_values = (size + self.num_groups) * width
        buffer = self._buffer(num_values + 2 * size * width)
        values = buffer[:num_values].view(size + self.num_groups, *columns)
        scratch = buffer[num_values:].view(2, size * width)
        sorted_weights = weights.index_select(1, self.perm)
        values[:size] = sorted_weights[0] if single else sorted_weights.T
        for row, start, stop, bits in self.levels:
            table = values[:size] if row is None else values.index_select(0, row)
            block = values[size + start : size + stop]
            for b, (opens, open_at, adds, add_at) in enumerate(bits):
                if b:
                    half = 1 << (b - 1)
                    length = table.shape[0] - half
                    next_table = scratch[b % 2, : length * width].view(length, *columns)
                    table = op(table[:-half], table[half:], out=next_table)
                if len(opens):
                    block.index_copy_(0, opens, table.index_select(0, open_at))
                if len(adds):
                    combined = op(block.index_select(0, adds), table.index_select(0, add_at))
                    block.index_copy_(0, adds, combined)
        nodes = values.index_select(0, self.node_slot)
        return nodes[None] if single else nodes.T


class ParallelTokenCharacterTrie(TokenCharacterTrie):
    """`TokenCharacterTrie` with its reductions vectorised in torch on a device.

    Same attributes, methods and results as `TokenCharacterTrie` (results are
    float64 numpy arrays); the reduction plan's index tensors are built once on
    `device`, and weight vectors are moved there. Calls reuse one float64
    workspace on the device, grown to the largest batch seen (about
    `(number of items * 3 + branching nodes) * batch` values: 133 MB for a batch
    of 32 over qwen2's vocabulary), because fresh memory costs page faults on
    every call; calls from several threads take turns.

    Args:
        decode: The vocabulary items (see `TokenCharacterTrie`).
        device: `"cpu"` or `"cuda"` (or `"cuda:N"`); default CUDA when available, else CPU.

    Raises:
        ValueError: If `device` is not a CPU or CUDA device, or CUDA is requested but
            not available; or if `decode` has duplicate items.
    """

    def __init__(self, decode: Sequence, device: str | torch.device | None = None):
        self.device = _resolve_device(device)
        super().__init__(decode)
        self._torch_plan = _TorchPlan(self._plan, self.device)

    def _tensor(self, ws: Any) -> torch.Tensor:
        if isinstance(ws, torch.Tensor):
            return ws.detach().to(self.device, torch.float64)
        return torch.as_tensor(np.asarray(ws, dtype=np.float64), device=self.device)

    def _vector(self, ws: Any) -> torch.Tensor:
        vector = self._tensor(ws)
        if tuple(vector.shape) != (len(self.decode),):
            raise ValueError(
                f"expected a weight vector of shape ({len(self.decode)},) (one weight per "
                f"vocabulary item), got shape {tuple(vector.shape)}"
            )
        return vector

    def _matrix(self, ws: Any) -> torch.Tensor:
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

    def _reduce(self, weights: torch.Tensor, op: np.ufunc, empty: float) -> np.ndarray:
        if not self.decode:
            return np.full((len(weights), 1), empty)
        torch_op = torch.add if op is np.add else torch.maximum
        return self._torch_plan.run(weights, torch_op).cpu().numpy()
