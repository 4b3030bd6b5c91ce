"""Which forward passes answer a batch of contexts at the cost of its distinct new tokens.

The transformers and MLX backends evaluate a batch of distinct contexts (one
adapter) in the passes `plan_passes` returns, so that a batch costs the tokens
of the tree its contexts spell that the key/value cache does not hold, not the
sum of the contexts' lengths:

- **Chains.** A context that is a prefix of another one of the batch is not run
  as a row of its own: its next-token row is read from the longer context's
  row, at its own position (all prefixes of a sequence, as a scorer or a
  critic asks for them, are one row). Unless the cache holds the longer
  context past it: then it runs alone, one token from its cached prefix, or
  (where an engine says what a row of its own costs, `alone_cost`) the longer
  row recomputes from it, whichever costs less.
- **Trunks.** A prefix that several rows share and the cache does not hold
  (a prompt no earlier batch evaluated, say) runs once, in an earlier pass,
  and its key/values go into the cache, where the rows that extend it find
  them. A trunk earns its pass only when it spares at least `min_saved`
  tokens; shorter shared stretches are recomputed by every row through them.

Rows of one pass are independent; a row of pass `k` extends trunks of passes
before `k` only. A pass then runs in the sub-batches `sub_batches` splits it
into, so that padding rows to a batch's longest at most about doubles its work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

MIN_SAVED_TOKENS = 32  # tokens a trunk must spare to get a pass of its own


@dataclass
class Row:
    """One row of a forward pass.

    Attributes:
        context: The tokens the row spells (its cached past and its new tokens).
        reads: Lengths of the prefixes of `context` whose next-token rows are
            read from this row, ascending (empty for a trunk nobody asked for).
        queries: For each read, the index of the context (in the planned list)
            it answers.
    """

    context: tuple[int, ...]
    reads: list[int] = field(default_factory=list)
    queries: list[int] = field(default_factory=list)


def plan_passes(
    contexts: Sequence[tuple[int, ...]],
    cached_length: Callable[[tuple[int, ...]], int],
    min_saved: int = MIN_SAVED_TOKENS,
    alone_cost: float | None = None,
) -> list[list[Row]]:
    """Plan the forward passes that answer every context.

    Args:
        contexts: Distinct, non-empty contexts.
        cached_length: Number of leading tokens of a context whose key/values
            the cache holds now.
        min_saved: A shared uncached prefix runs as a trunk of its own only when
            that spares at least this many tokens.
        alone_cost: What a context that ends inside the cached part of its
            row costs run alone, in tokens of a longer row (its one token and
            the setup of a row of its own). `None`: such contexts always run
            alone. Otherwise the row recomputes from the earliest of them
            whenever the tokens it recomputes cost less than running them alone
            (all prefixes of a cached prompt, say).

    Returns:
        The passes, in the order they must run; every context is read exactly
        once, from the row of one pass.
    """
    order = sorted(range(len(contexts)), key=contexts.__getitem__)
    # A context is a prefix of another one iff it is a prefix of the next in sorted order;
    # walking backwards gives each the longest context it is a prefix of (its "owner").
    maximal: list[Row] = []
    owner_row: Row | None = None
    for position in reversed(range(len(order))):
        context = contexts[order[position]]
        if owner_row is None or not _is_prefix(context, owner_row.context):
            owner_row = Row(context)
            maximal.append(owner_row)
        owner_row.reads.append(len(context))
        owner_row.queries.append(order[position])
    maximal.reverse()  # sorted order again
    for row in maximal:
        row.reads.reverse()
        row.queries.reverse()
    cached = [cached_length(row.context) for row in maximal]
    # A read inside the cached part of its row would make the row recompute from there:
    # it runs alone instead, from its own cached prefix (one token), unless recomputing
    # costs less.
    alone: list[Row] = []
    for row, length in zip(maximal, cached, strict=True):
        inside = sum(1 for read in row.reads if read <= length)
        count = _reads_alone(row.reads[:inside], length, alone_cost)
        alone += [
            Row(row.context[:read], [read], [query])
            for read, query in zip(row.reads[:count], row.queries[:count], strict=True)
        ]
        del row.reads[:count], row.queries[:count]
    # A row left with no read is cached whole: nothing to run. A row still reading inside
    # its cached part runs from just before that read.
    cached = [
        min(length, row.reads[0] - 1)
        for row, length in zip(maximal, cached, strict=True)
        if row.reads
    ]
    maximal = [row for row in maximal if row.reads]
    trunks = _trunks(maximal, cached, min_saved)
    passes = _passes(maximal, trunks) if trunks else [maximal]
    passes[0] = alone + passes[0]
    return passes


def _reads_alone(inside: list[int], cached: int, alone_cost: float | None) -> int:
    """How many of a row's first reads, those inside its cached part, run alone.

    Running the first `j` alone costs `j * alone_cost`; the row then recomputes
    its cached tokens from just before its next read on.
    """
    if alone_cost is None:
        return len(inside)
    costs = [
        j * alone_cost + (cached - inside[j] + 1 if j < len(inside) else 0)
        for j in range(len(inside) + 1)
    ]
    return min(range(len(costs)), key=costs.__getitem__)


def sub_batches(
    rows: Sequence[Row],
    past_lengths: Sequence[int],
    aligned_pasts: bool = False,
    fits: Callable[[int, int, int, int], bool] | None = None,
    padding: float = 1.0,
) -> list[list[int]]:
    """Split the rows of a pass into sub-batches in which padding at most about doubles the work.

    A batch pads every row to its most new tokens, and its key/values to its
    longest past. Rows are taken by decreasing new tokens (then past); a row
    joins the current sub-batch while the padded new tokens stay within the
    real ones plus `padding` times them plus 8, and the padded key/value slots
    (past and new) within twice the real ones plus 64 per row; otherwise it
    starts the next one.

    Args:
        rows: The rows of a pass.
        past_lengths: Tokens of each row's cached prefix (the row runs the rest).
        aligned_pasts: Rows with different past lengths never share a sub-batch.
        fits: Whether a sub-batch of `(rows, most new tokens, longest past,
            reads)` may run (a working-memory bound, say); `None`: any may.
        padding: Padding new tokens allowed per real one (beyond 8 a sub-batch
            may always pad): 1 lets padding about double the work; an engine
            that computes padding at full cost in every layer wants less.

    Returns:
        The sub-batches, as indices into `rows`, each by decreasing new tokens.
    """
    sizes = [(len(row.context) - past, past) for row, past in zip(rows, past_lengths, strict=True)]
    groups: list[list[int]] = []
    max_past = real_new = real_all = reads = 0  # of the last group
    for g in sorted(range(len(sizes)), key=sizes.__getitem__, reverse=True):
        new, past = sizes[g]
        if groups:
            group = groups[-1]
            n_rows, max_new = len(group) + 1, sizes[group[0]][0]  # its first has the most new
            grown_past = max(past, max_past)
            if (
                n_rows * max_new <= (1 + padding) * (real_new + new) + 8
                and n_rows * (max_new + grown_past) <= 2 * (real_all + new + past) + 64 * n_rows
                and not (aligned_pasts and past != sizes[group[0]][1])
                and (fits is None or fits(n_rows, max_new, grown_past, reads + len(rows[g].reads)))
            ):
                group.append(g)
                max_past, real_new, real_all = grown_past, real_new + new, real_all + new + past
                reads += len(rows[g].reads)
                continue
        groups.append([g])
        max_past, real_new, real_all, reads = past, new, new + past, len(rows[g].reads)
    return groups


@dataclass
class _Trunk:
    depth: int  # length of the shared prefix
    lo: int  # first and last maximal row (sorted) that share it
    hi: int
    level: int = 0  # trunks above it
    row: Row | None = None


def _trunks(maximal: list[Row], cached: list[int], min_saved: int) -> list[_Trunk]:
    """The shared uncached prefixes that get passes of their own, outermost first."""
    if len(maximal) < 2:
        return []
    lcps = [
        _common_length(maximal[j - 1].context, maximal[j].context) for j in range(1, len(maximal))
    ]
    # The internal nodes of the trie of the sorted rows: intervals of rows with a common
    # prefix longer than their neighbours share (a stack over the adjacent common lengths).
    nodes: list[_Trunk] = []
    stack: list[tuple[int, int]] = [(0, 0)]  # (depth, first row)
    for j in range(1, len(maximal) + 1):
        depth = lcps[j - 1] if j < len(maximal) else 0
        lo = j - 1
        while stack[-1][0] > depth:
            node_depth, lo = stack.pop()
            nodes.append(_Trunk(node_depth, lo, j - 1))
        if stack[-1][0] < depth:
            stack.append((depth, lo))
    nodes.sort(key=lambda node: (node.lo, -node.hi))  # every node after the nodes above it
    chosen: list[_Trunk] = []
    above: list[_Trunk] = []  # chosen trunks enclosing the current node
    for node in nodes:
        while above and above[-1].hi < node.lo:
            above.pop()
        start = max(above[-1].depth if above else 0, min(cached[node.lo], node.depth))
        if (node.hi - node.lo) * (node.depth - start) >= min_saved:
            node.level = len(above)
            chosen.append(node)
            above.append(node)
    return chosen


def _passes(maximal: list[Row], trunks: list[_Trunk]) -> list[list[Row]]:
    """Rows by pass: each trunk after the trunks above it, each row after its trunks."""
    passes: list[list[Row]] = [[] for _ in range(max(t.level for t in trunks) + 2)]
    for trunk in trunks:
        trunk.row = Row(maximal[trunk.lo].context[: trunk.depth])
        passes[trunk.level].append(trunk.row)
    pending = iter(trunks)  # sorted by first row, outermost first
    upcoming = next(pending, None)
    path: list[_Trunk] = []  # the trunks above the current row, outermost first
    for index, row in enumerate(maximal):
        while path and path[-1].hi < index:
            path.pop()
        while upcoming is not None and upcoming.lo == index:
            path.append(upcoming)
            upcoming = next(pending, None)
        # Each read goes to the first segment of the row's path that reaches it.
        segments = [trunk.row for trunk in path] + [row]
        ends = [trunk.depth for trunk in path] + [len(row.context)]
        reads, queries = row.reads, row.queries
        row.reads, row.queries = [], []
        segment = 0
        for length, query in zip(reads, queries, strict=True):
            while length > ends[segment]:
                segment += 1
            segments[segment].reads.append(length)
            segments[segment].queries.append(query)
        passes[len(path)].append(row)
    return [rows for rows in passes if rows]


def _is_prefix(short: tuple[int, ...], long: tuple[int, ...]) -> bool:
    return len(short) < len(long) and long[: len(short)] == short


def _common_length(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low
