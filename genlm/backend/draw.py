"""Draws from log-weight rows, reduced together for every particle of a step.

An SMC step draws one token per particle from its row. Drawn one at a time,
that is N passes over N rows and, on a GPU, N reads back to the host. Here
the asks that particles make concurrently meet in the window of
`genlm.backend.batching.join_batch` and are reduced together per group of
like rows (same kind of ask, array library, device, dtype and width): one
stacked reduction and one read to the host per group.

```python
index, logw, logp = await draw_from(row)  # a token in proportion to exp(row)
index, logw, logp = await draw_from(proposal, target=target)  # an importance draw
log_z = await logsumexp_from(row)
value = await logp_at(row, index)
```

Rows are 1-D torch tensors (any device, any float dtype) or numpy arrays of
log-weights, unnormalised or not; a row is read when its group is reduced,
before the ask returns, so it must not change while the ask waits. Results
are Python numbers, read at the row's precision (float64 rows to float64;
float16 and bfloat16 rows are reduced in float32). Randomness comes from torch's global generator
(`torch.manual_seed` makes draws repeat) for numpy rows too;
`logsumexp_from` and `logp_at` consume none.

Pickers (`DRAW_METHODS`), chosen process-wide by `set_draw_method`; all draw
index `i` with probability `exp(row[i] - logsumexp(row))`:

- `"gumbel_max"`: the argmax of the row plus Gumbel noise; one random number
  per column. The default on accelerators (CUDA, MPS), whose generators make
  the noise in parallel.
- `"multinomial"`: `torch.multinomial` of the normalised row.
- `"inverse_cdf"`: the cumulative sum of the normalised row searched at one
  uniform number per row. The default on the CPU, where the noise of
  `"gumbel_max"` costs more than the draws it replaces (32 SmolLM2 rows of
  49,152 columns: 1.6 million random numbers, against 32).
"""

from __future__ import annotations

import math
import numbers
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from genlm.backend.batching import join_batch

DRAW_METHODS = ("gumbel_max", "multinomial", "inverse_cdf")

_method: str | None = None  # None: the default of the rows' device
_method_lock = threading.Lock()


def set_draw_method(name: str | None) -> None:
    """Choose the picker every later draw of this process uses.

    Args:
        name: One of `DRAW_METHODS`, or `None` for the default of the rows'
            device (`"inverse_cdf"` on the CPU, `"gumbel_max"` elsewhere).

    Raises:
        ValueError: If `name` is not one of `DRAW_METHODS` or `None`.
    """
    global _method
    if name is not None and name not in DRAW_METHODS:
        raise ValueError(f"unknown draw method {name!r}; choose one of {DRAW_METHODS} or None")
    with _method_lock:
        _method = name


def draw_method(device: torch.device | str = "cpu") -> str:
    """The picker that draws from rows on `device` now (see `set_draw_method`)."""
    if _method is not None:
        return _method
    return "inverse_cdf" if torch.device(device).type == "cpu" else "gumbel_max"


@dataclass(frozen=True)
class _Ask:
    weights: torch.Tensor
    target: torch.Tensor | None = None
    index: int = 0


def _as_row(weights: Any, name: str) -> tuple[torch.Tensor, str]:
    """`weights` as a 1-D float torch tensor (numpy arrays shared, not copied), and its library."""
    if isinstance(weights, torch.Tensor):
        row, library = weights.detach(), "torch"
    elif isinstance(weights, np.ndarray):
        row, library = torch.from_numpy(np.ascontiguousarray(weights)), "numpy"
    else:
        raise TypeError(
            f"{name} must be a torch tensor or a numpy array of log-weights, "
            f"got {type(weights).__name__}"
        )
    if row.ndim != 1 or row.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 1-D row, got shape {tuple(row.shape)}")
    if not row.dtype.is_floating_point:
        raise TypeError(f"{name} must hold floats, got {row.dtype}")
    return row, library


def _group(row: torch.Tensor, library: str) -> tuple:
    """What asks must share to be reduced together: array library, device, dtype, width."""
    return (library, row.device, row.dtype, row.numel())


async def draw_from(weights: Any, target: Any = None) -> tuple[int, float, float]:
    """Draw an index in proportion to `exp(weights)`.

    Args:
        weights: A 1-D row of log-weights (torch tensor or numpy array).
        target: A row of the same width: makes this an importance draw, with
            `weights` the proposal and the draw weighed under `target`.

    Returns:
        `(index, logw, logp)`: the index drawn; `logp`, its log-probability
        under the normalised row (`weights[index] - logsumexp(weights)`);
        `logw`, the row's log-normaliser `logsumexp(weights)`, or
        `target[index] - logp` with a `target`. A row with no support (all
        `-inf`) gives some index with `logw = logp = -inf`.

    Raises:
        TypeError: If a row is not a float torch tensor or numpy array.
        ValueError: If a row is not a non-empty 1-D row, `target` has another
            width, or `weights` holds NaN or `+inf`.
    """
    row, library = _as_row(weights, "weights")
    target_row = None
    if target is not None:
        target_row, _ = _as_row(target, "target")
        if target_row.numel() != row.numel():
            raise ValueError(f"target has {target_row.numel()} entries; weights has {row.numel()}")
    return await join_batch("draw", _Ask(row, target_row), _draws, _group(row, library))


async def logsumexp_from(weights: Any) -> float:
    """The log-normaliser `log(sum(exp(weights)))` of a row (`-inf` for no support).

    Args:
        weights: A 1-D row of log-weights (torch tensor or numpy array).

    Returns:
        The log-normaliser, read at the row's precision.

    Raises:
        TypeError: If `weights` is not a float torch tensor or numpy array.
        ValueError: If `weights` is not a non-empty 1-D row, or holds NaN.
    """
    row, library = _as_row(weights, "weights")
    return await join_batch("logsumexp", _Ask(row), _log_normalisers, _group(row, library))


async def logp_at(weights: Any, index: int) -> float:
    """The value of a row at `index`, read together with other concurrent reads.

    Args:
        weights: A 1-D row (torch tensor or numpy array).
        index: A position in the row, an int in `[0, len(weights))`.

    Returns:
        `weights[index]` as a Python float.

    Raises:
        TypeError: If `weights` is not a float torch tensor or numpy array, or
            `index` is not an integer.
        ValueError: If `weights` is not a non-empty 1-D row or `index` is out of range.
    """
    row, library = _as_row(weights, "weights")
    if isinstance(index, torch.Tensor | np.ndarray) and index.ndim == 0:
        index = index.item()
    if isinstance(index, bool) or not isinstance(index, numbers.Integral):
        raise TypeError(f"index must be an int, got {type(index).__name__}")
    if not 0 <= index < row.numel():
        raise ValueError(f"index {index} is outside the row [0, {row.numel()})")
    return await join_batch("at", _Ask(row, index=int(index)), _values_at, _group(row, library))


def _stacked(asks: list[_Ask]) -> torch.Tensor:
    """The group's rows as one matrix, in float32 at least (half precisions are widened)."""
    rows = torch.stack([ask.weights for ask in asks])
    return rows if rows.dtype in (torch.float32, torch.float64) else rows.float()


def _read(*columns: torch.Tensor) -> list[list[float]]:
    """Columns of per-row values read to the host in one transfer, as float64 lists."""
    return torch.stack([c.to(torch.float64) for c in columns], dim=1).tolist()


def _bad_row(value: float, what: str) -> ValueError:
    return ValueError(f"cannot {what} a row whose log-normaliser is {value} (NaN or +inf entries)")


def _draws(asks: list[_Ask]) -> list[Any]:
    rows = _stacked(asks)
    index, log_z = _PICKERS[draw_method(rows.device)](rows)
    logp = rows.gather(1, index.unsqueeze(1)).squeeze(1) - log_z
    with_target = [i for i, ask in enumerate(asks) if ask.target is not None]
    target_values = torch.zeros_like(logp)
    if with_target:
        targets = torch.stack([asks[i].target.to(rows.device, rows.dtype) for i in with_target])
        positions = torch.tensor(with_target, device=rows.device)
        picked = targets.gather(1, index[positions].unsqueeze(1)).squeeze(1)
        target_values[positions] = picked.to(target_values.dtype)
    results = []
    for ask, (i, z, p, t) in zip(asks, _read(index, log_z, logp, target_values), strict=True):
        if math.isnan(z) or z == math.inf:
            results.append(_bad_row(z, "draw from"))
        elif z == -math.inf:
            results.append((int(i), -math.inf, -math.inf))
        else:
            results.append((int(i), (t - p) if ask.target is not None else z, p))
    return results


# Each picker maps a matrix of rows to one index per row and the rows' log-normalisers. A row
# with no support (all -inf), NaN or +inf gets some index in range; its results are replaced.


def _gumbel_max(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    noise = torch.rand(rows.shape, dtype=rows.dtype, device=rows.device)
    # -log(-log(u)) is Gumbel noise: argmax(rows + noise) = argmax(rows - log(-log(u))).
    noise.clamp_(min=torch.finfo(noise.dtype).tiny).log_().neg_().log_()
    index = torch.sub(rows, noise, out=noise).argmax(dim=1)
    return index, torch.logsumexp(rows, dim=1)


def _masses(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`exp(rows - peak)` per row, and the peak (0 where it is not finite)."""
    peak = rows.amax(dim=1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, 0.0)
    return torch.sub(rows, peak).exp_(), peak.squeeze(1)


def _multinomial(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    masses, peak = _masses(rows)
    totals = masses.sum(dim=1, dtype=torch.float64)
    drawable = (torch.isfinite(totals) & (totals > 0)).unsqueeze(1)
    index = torch.multinomial(torch.where(drawable, masses, 1.0), 1).squeeze(1)
    return index, peak + totals.log()


# Columns per block of the inverse CDF: the block is found in the rows' block sums, the column
# in that block's own cumulative sum, so no cumulative sum runs over whole rows.
_BLOCK = 256


def _inverse_cdf(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    masses, peak = _masses(rows)
    n, width = masses.shape
    whole = width // _BLOCK * _BLOCK
    # Sums in float64: float32 sums over 10^5 columns would shift the small masses.
    sums = masses[:, :whole].view(n, -1, _BLOCK).sum(dim=2, dtype=torch.float64)
    if whole < width:
        tail = masses[:, whole:].sum(dim=1, keepdim=True, dtype=torch.float64)
        sums = torch.cat([sums, tail], dim=1)
    cumulative = sums.cumsum_(dim=1)
    total = cumulative[:, -1:].contiguous()
    u = torch.rand((n, 1), dtype=torch.float64, device=rows.device) * total
    block = _last_with_mass(cumulative, u, total)
    before = cumulative.gather(1, (block - 1).clamp_(min=0)) * (block > 0)
    columns = block * _BLOCK + torch.arange(_BLOCK, device=rows.device)
    inside = columns < width
    in_block = masses.gather(1, columns.clamp_(max=width - 1)).to(torch.float64) * inside
    in_block = in_block.cumsum_(dim=1)
    column = _last_with_mass(in_block, u - before, in_block[:, -1:].contiguous())
    index = (block * _BLOCK + column).squeeze(1).clamp_(max=width - 1)
    return index, peak + total.squeeze(1).log()


def _last_with_mass(cumulative: torch.Tensor, u: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """The first position whose cumulative sum passes `u`, or where rounding puts `u` at the
    total, the last position with mass (never a zero-mass position after it)."""
    return torch.minimum(
        torch.searchsorted(cumulative, u, right=True), torch.searchsorted(cumulative, total)
    )


_PICKERS = {"gumbel_max": _gumbel_max, "multinomial": _multinomial, "inverse_cdf": _inverse_cdf}


def _log_normalisers(asks: list[_Ask]) -> list[Any]:
    log_z = torch.logsumexp(_stacked(asks), dim=1)
    return [_bad_row(z, "normalise") if math.isnan(z) else z for (z,) in _read(log_z)]


def _values_at(asks: list[_Ask]) -> list[float]:
    rows = torch.stack([ask.weights for ask in asks])
    index = torch.tensor([ask.index for ask in asks], device=rows.device)
    return [v for (v,) in _read(rows.gather(1, index.unsqueeze(1)).squeeze(1))]
