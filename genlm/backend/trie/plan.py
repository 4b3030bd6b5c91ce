"""Internals of `TokenCharacterTrie`: the vocabulary as a sorted trie, and its reduction plan.

Layout. Items are sorted by their symbol strings and the trie is first built in
depth-first (pre-)order of that sorted trie, so the items below any node form
one contiguous range of the sorted items. A node's value (the sum or the max of
the weights of the items below it) is therefore a reduction over a range, and
many nodes share a range: a node with a single child has its child's range.
Only the branching nodes ("groups") need computing; every other node copies the
value of an item or of a group. The public node ids are then chosen for the
reductions (see `_ReductionPlan`): the root is 0, the leaves follow in sorted
order, then the groups, then the single-child nodes.

Reduction plan (`_ReductionPlan`). The root is a reduction of the whole weight
row; the other groups are computed in at most two levels. A level sees a row of
already computed values (level 0: the items in sorted order; level 1: the
largest computed entities, which tile the items) and finishes every remaining
group that spans fewer than `2**bits` of them, from doubling tables
`T_b[i] = reduce(row[i : i + 2**b])`: a span of length `r` is the disjoint
union of windows of the sizes of the set bits of `r`. The first tables are
dense element-wise passes over the previous one (two buffers, ping-pong); a
later table, needed at few positions, holds only those, each from a gathered
pair of entries of the previous table. Right after a table is built, the values
of the windows of its size are gathered into a staging array, and each group's
value is then reduced from its staged windows (the groups are ordered by number
of windows, so the `j`-th windows are one gather and one element-wise pass over
a prefix of the level's groups). A level thus costs a few vectorised operations
whatever the shape of the trie, and the sums stay exact to floating-point
rounding (no prefix-sum differences). The plan is plain index arrays;
`_run_plan` runs it with numpy one weight row at a time, in place in the row of
the result (`TokenCharacterTrie` shares a batch's rows among one thread per
core, up to 8). `ParallelTokenCharacterTrie` runs the same on the CPU; on CUDA
it reduces over the items below each node instead (see
`genlm.backend.trie.parallel`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from genlm.backend.tokenization.token import Token

# Window sizes of the first level: 2**0 .. 2**(_FIRST_LEVEL_BITS - 1) items. Small groups
# (most of them) finish there; the second level finishes the rest over a much shorter row.
# (More capped levels do not pay: groups with many children keep the rows long.)
_FIRST_LEVEL_BITS = 6
_FIRST_FREE_CODE = 256
# Cost of a table entry computed from gathered pairs, in entries of a whole table.
_SPARSE_ENTRY_COST = 3
_BYTES_LIKE = (bytes, bytearray, memoryview)


# --------------------------------------------------------------------------- items


def _item_symbols(item: Any, position: int) -> tuple[Sequence, Hashable]:
    """The symbol sequence of a vocabulary item and its key in `word2leaf`."""
    if isinstance(item, Token):
        byte_string = bytes(item)
        return byte_string, (byte_string, item.token_id)
    if isinstance(item, bytes):
        return item, item
    if isinstance(item, bytearray | memoryview):
        byte_string = bytes(item)
        return byte_string, byte_string
    try:
        symbols = tuple(item)
    except TypeError:
        raise TypeError(
            f"decode[{position}] = {item!r} is not a Token, bytes or an iterable of symbols"
        ) from None
    try:
        hash(item)
        key = item
    except TypeError:
        key = symbols
    return symbols, key


class _SymbolCodes:
    """Maps symbols to integer codes: byte values to themselves, others to 256, 257, ..."""

    def __init__(self) -> None:
        self.code_of: dict[Hashable, int] = {b: b for b in range(256)}
        self.symbol_of: list[Hashable] = list(range(256))

    def encode(self, symbols: Sequence, position: int) -> str:
        """The symbols as a string of code points, one per symbol (sortable, prefix-preserving)."""
        codes = []
        for symbol in symbols:
            try:
                code = self.code_of.get(symbol)
            except TypeError:
                raise TypeError(
                    f"decode[{position}] holds an unhashable symbol {symbol!r}"
                ) from None
            if code is None:
                code = len(self.symbol_of)
                if code >= 0xD800:  # skip the surrogate range, which UTF-32 cannot encode
                    code += 0x800
                self.code_of[symbol] = code
                self.symbol_of.append(symbol)
            codes.append(code)
        return "".join(map(chr, codes))

    def symbol(self, code: int) -> Hashable:
        if code < 0xD800:
            return self.symbol_of[code]
        return self.symbol_of[code - 0x800]


class _ItemKeys(NamedTuple):
    """The items of a vocabulary as trie keys (what `_symbol_keys` returns).

    Attributes:
        keys: Fixed-width big-endian byte keys of every item (one code per `width` bytes).
        width: 1 when every symbol is a byte value, else 4.
        codes: The symbol codes used for width 4 (None for width 1).
        word_keys: The `word2leaf` key of every item.
        plain_bytes: Positions of the items that are byte strings but not `Token`s.
    """

    keys: list[bytes]
    width: int
    codes: _SymbolCodes | None
    word_keys: list[Hashable]
    plain_bytes: list[int]


def _symbol_keys(decode: list) -> _ItemKeys:
    """The trie keys of every item, and which items are plain byte strings."""
    symbol_lists, word_keys, plain_bytes = [], [], []
    for position, item in enumerate(decode):
        symbols, key = _item_symbols(item, position)
        symbol_lists.append(symbols)
        word_keys.append(key)
        if isinstance(item, _BYTES_LIKE) and not isinstance(item, Token):
            plain_bytes.append(position)
    if all(isinstance(symbols, bytes) for symbols in symbol_lists):
        return _ItemKeys(symbol_lists, 1, None, word_keys, plain_bytes)
    codes = _SymbolCodes()
    texts = [
        symbols.decode("latin-1") if isinstance(symbols, bytes) else codes.encode(symbols, position)
        for position, symbols in enumerate(symbol_lists)
    ]
    if len(codes.symbol_of) == _FIRST_FREE_CODE:  # iterables of byte values only
        return _ItemKeys(
            [text.encode("latin-1") for text in texts], 1, None, word_keys, plain_bytes
        )
    keys = [text.encode("utf-32-be") for text in texts]
    return _ItemKeys(keys, 4, codes, word_keys, plain_bytes)


# --------------------------------------------------------------------------- sorted trie


class _MinTable:
    """Sparse table of range minima of an int array, for "next/previous smaller" queries."""

    def __init__(self, values: np.ndarray):
        self.values = values
        self.levels = [values]
        step = 1
        while 2 * step <= len(values):
            previous = self.levels[-1]
            self.levels.append(np.minimum(previous[:-step], previous[step:]))
            step *= 2

    def previous_smaller(self, positions: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
        """For each position p, the largest q < p with values[q] < threshold, or -1."""
        start = positions.copy()  # invariant: values[start:p] >= threshold
        for level in range(len(self.levels) - 1, -1, -1):
            step = 1 << level
            candidate = start - step
            inside = candidate >= 0
            table = self.levels[level]
            move = inside & (table[np.where(inside, candidate, 0)] >= thresholds)
            start = np.where(move, candidate, start)
        return start - 1

    def next_smaller(self, positions: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
        """For each position p, the smallest q >= p with values[q] < threshold, or len(values)."""
        size = len(self.values)
        end = np.minimum(positions, size)  # invariant: values[p:end] >= threshold
        for level in range(len(self.levels) - 1, -1, -1):
            step = 1 << level
            inside = end + step <= size
            table = self.levels[level]
            move = inside & (table[np.where(inside, end, 0)] >= thresholds) if size else inside
            end = np.where(move, end + step, end)
        return end


def _segments(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For segments of the given lengths laid end to end: segment index and offset of each slot."""
    segment = np.repeat(np.arange(len(counts)), counts)
    first = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(counts[:-1], out=first[1:])
    return segment, np.arange(len(segment)) - first[segment]


@dataclass
class _SortedTrie:
    """The trie as arrays, nodes in pre-order of the sorted items.

    Attributes:
        order: `order[r]` is the position in `decode` of the item of sorted rank r.
        keys: The items' keys (see `_symbol_keys`) in sorted order.
        codes: The symbol codes of all sorted keys, end to end; key r starts at `key_starts[r]`.
        parent, depth, is_leaf: Per node (the root's parent is -1; a leaf is one deeper
            than its item has symbols).
        rank: Per node, the rank of the item whose insertion created it: the first item
            below it.
        leaf_of_rank: The leaf of each item, by rank.
        hi: Per node, one past the rank of the last item below it.
    """

    order: np.ndarray
    keys: list[bytes]
    codes: np.ndarray
    key_starts: np.ndarray
    parent: np.ndarray
    depth: np.ndarray
    rank: np.ndarray
    is_leaf: np.ndarray
    leaf_of_rank: np.ndarray
    hi: np.ndarray


def _sort_trie(keys: list[bytes], width: int) -> _SortedTrie:
    size = len(keys)
    order = np.array(sorted(range(size), key=keys.__getitem__), dtype=np.int64)
    sorted_keys = [keys[i] for i in order.tolist()]
    dtype = np.uint8 if width == 1 else np.dtype(">u4")
    codes = np.frombuffer(b"".join(sorted_keys), dtype=dtype).astype(np.int64)
    lengths = np.fromiter(map(len, sorted_keys), dtype=np.int64, count=size) // width
    key_starts = np.zeros(size, dtype=np.int64)
    np.cumsum(lengths[:-1], out=key_starts[1:])

    # Longest common prefix of consecutive sorted keys: first mismatching code.
    lcp = np.zeros(size, dtype=np.int64)
    if size > 1:
        shared = np.minimum(lengths[:-1], lengths[1:])
        pair, offset = _segments(shared)
        mismatch = np.flatnonzero(
            codes[key_starts[:-1][pair] + offset] != codes[key_starts[1:][pair] + offset]
        )
        lcp[1:] = shared
        first = np.ones(len(mismatch), dtype=bool)
        first[1:] = pair[mismatch[1:]] != pair[mismatch[:-1]]
        lcp[1 + pair[mismatch[first]]] = offset[mismatch[first]]

    # Item r creates the nodes at depths lcp[r]+1 .. len[r], then its leaf.
    new_nodes = lengths - lcp
    created = new_nodes + 1
    first_id = np.ones(size, dtype=np.int64)
    np.cumsum(created[:-1], out=first_id[1:])
    first_id[1:] += 1
    num_nodes = 1 + int(created.sum())

    # The node at depth lcp[r] on item r's path was created by the last earlier
    # item that shares fewer than lcp[r] symbols with its predecessor.
    ranks = np.arange(size, dtype=np.int64)
    table = _MinTable(lcp)
    creator = table.previous_smaller(ranks, lcp)
    creator_safe = np.maximum(creator, 0)
    anchor = np.where(lcp == 0, 0, first_id[creator_safe] + lcp - lcp[creator_safe] - 1)

    rank = np.zeros(num_nodes, dtype=np.int64)
    rank[1:] = np.repeat(ranks, created)
    offset = np.arange(num_nodes - 1) - np.repeat(first_id - 1, created)
    is_leaf = np.zeros(num_nodes, dtype=bool)
    is_leaf[1:] = offset == np.repeat(new_nodes, created)
    depth = np.zeros(num_nodes, dtype=np.int64)
    depth[1:] = np.repeat(lcp, created) + 1 + offset
    parent = np.full(num_nodes, -1, dtype=np.int64)
    parent[1:] = np.where(offset == 0, np.repeat(anchor, created), np.arange(num_nodes - 1))
    leaf_of_rank = np.flatnonzero(is_leaf)

    # A node at depth d created by item r covers items r .. up to the next item
    # sharing fewer than d symbols with its predecessor.
    hi = table.next_smaller(rank + 1, depth)
    hi[is_leaf] = rank[is_leaf] + 1
    hi[0] = size
    return _SortedTrie(
        order=order,
        keys=sorted_keys,
        codes=codes,
        key_starts=key_starts,
        parent=parent,
        depth=depth,
        rank=rank,
        is_leaf=is_leaf,
        leaf_of_rank=leaf_of_rank,
        hi=hi,
    )


# --------------------------------------------------------------------------- reduction plan


@dataclass
class _PlanLevel:
    """One level of a reduction plan (see the module docstring).

    Attributes:
        row: Output positions of the values the level reduces over; `None` at
            level 0, which reduces over the sorted items.
        width: Length of the row.
        start, stop: The level writes its group values at output positions
            `start .. stop`.
        dense_tables: Tables `0 .. dense_tables - 1` are whole (table 0 is the row).
        sparse_steps: For each later table `b`, indices `(left, right)` into table
            `b - 1`. Table `b` holds, in order, only the entries that windows of size
            `2**b` or later tables read, `op(table_b_minus_1[left], table_b_minus_1[right])`.
        table_positions: One entry per doubling table: `table_positions[b]` lists where,
            in table `b`, the windows of size `2**b` start; their values are staged one
            after the other (bit by bit).
        windows: `windows[j]` holds, for the first `len(windows[j])` groups of the
            level, the staged position of their `j`-th window; groups are ordered by
            number of windows, most first.
    """

    row: np.ndarray | None
    width: int
    start: int
    stop: int
    dense_tables: int
    sparse_steps: list[tuple[np.ndarray, np.ndarray]]
    table_positions: list[np.ndarray]
    windows: list[np.ndarray]


@dataclass
class _ReductionPlan:
    """Index arrays that compute every node's value from the item weights.

    Node ids follow the plan: the values are computed in place in the output row,
    whose positions are the node ids. Position 0 is the root (a reduction of the
    whole weight row), `1 .. num_items` the items' leaves in sorted order (the
    level-0 row), `1 + num_items .. values_stop` the groups, level by level, and
    the rest the chain nodes (one child), copied from `chain_source`.

    Attributes:
        num_items: Number of items.
        perm: `perm[r]` is the index in `decode` of the item of sorted rank r.
        levels: The levels, in order.
        values_stop: End of the root, item and group values.
        chain_source: For every chain node, in order, the position of the first node
            below it that is not a chain node (its value is that node's).
    """

    num_items: int
    perm: np.ndarray
    levels: list[_PlanLevel]
    values_stop: int
    chain_source: np.ndarray

    @property
    def num_nodes(self) -> int:
        """Number of nodes (positions of an output row)."""
        return self.values_stop + len(self.chain_source)

    @property
    def row_size(self) -> int:
        """Longest row of a level after the first (copied out of the values)."""
        return max((level.width for level in self.levels[1:]), default=0)

    @property
    def table_size(self) -> int:
        """Longest doubling table (levels keep two, ping-pong)."""
        return max((level.width for level in self.levels), default=0)

    @property
    def pair_size(self) -> int:
        """Longest sparse table (one side of its pairs is gathered into scratch)."""
        sizes = [len(left) for level in self.levels for left, _ in level.sparse_steps]
        return max(sizes, default=0)

    @property
    def stage_size(self) -> int:
        """Most windows of a level."""
        return max((sum(map(len, level.windows)) for level in self.levels), default=0)

    @property
    def scratch_size(self) -> int:
        """Most groups of a level (scratch for one gather of their windows)."""
        return max((level.stop - level.start for level in self.levels), default=0)


def _level_windows(
    first: np.ndarray, span: np.ndarray, bits: int
) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """Windows of spans `[first, first + span)`: one per set bit of the span, low bits first.

    Returns the order of the groups (most windows first), the table positions of the
    windows of each size, and for each `j` the staged positions (windows numbered in
    table order) of the `j`-th windows of the groups, in that order, that have one.
    """
    count = np.zeros(len(span), dtype=np.int64)
    table_positions, groups, which = [], [], []  # which: the window's rank in its group's
    for b in range(bits):
        has_bit = np.flatnonzero((span >> b) & 1)
        table_positions.append(first[has_bit] + (span[has_bit] & ((1 << b) - 1)))
        groups.append(has_bit)
        which.append(count[has_bit])
        count[has_bit] += 1
    order = np.argsort(-count, kind="stable")
    rank_in_level = np.empty(len(span), dtype=np.int64)
    rank_in_level[order] = np.arange(len(span))
    groups, which = np.concatenate(groups), np.concatenate(which)
    staged = np.arange(len(groups))  # windows are staged in table order
    windows = []
    for j in range(int(count.max(initial=0))):
        chosen = which == j
        at = np.empty(int(chosen.sum()), dtype=np.int64)
        at[rank_in_level[groups[chosen]]] = staged[chosen]  # groups with a j-th window lead
        windows.append(at)
    return order, table_positions, windows


def _sparse_tables(
    table_positions: list[np.ndarray], width: int
) -> tuple[int, list[tuple[np.ndarray, np.ndarray]], list[np.ndarray]]:
    """Which doubling tables to compute whole, and the pairs that compute the others.

    Table `b` is needed where windows of size `2**b` start and where table `b + 1`
    needs it (at `p` and `p + 2**b`). The needed sets shrink as `b` grows; from the
    first table whose set is small enough (a gathered entry costs about three dense
    ones: two gathers and one element-wise pass), each table holds only its needed
    entries, in order.

    Returns the number of whole tables, the `(left, right)` pairs of each later
    table, and the window positions translated into the tables that hold them.
    """
    bits = len(table_positions)
    needed = [np.empty(0, dtype=np.int64)] * bits
    for b in range(bits - 1, 0, -1):
        above = needed[b + 1] if b + 1 < bits else np.empty(0, dtype=np.int64)
        needed[b] = np.unique(np.concatenate([table_positions[b], above, above + (1 << b)]))
    dense = next(
        (b for b in range(1, bits) if _SPARSE_ENTRY_COST * len(needed[b]) < width - (1 << b)),
        bits,
    )
    steps, positions = [], list(table_positions[:dense])
    for b in range(dense, bits):
        entries, half = needed[b], 1 << (b - 1)
        if b - 1 < dense:
            steps.append((entries, entries + half))
        else:
            previous = needed[b - 1]
            steps.append(
                (np.searchsorted(previous, entries), np.searchsorted(previous, entries + half))
            )
        positions.append(np.searchsorted(entries, table_positions[b]))
    return dense, steps, positions


def _plan(trie: _SortedTrie, num_items: int) -> tuple[_ReductionPlan, np.ndarray]:
    """The reduction plan of a trie, and the node id of each of its pre-order nodes."""
    num_nodes = len(trie.parent)
    num_children = np.bincount(trie.parent[1:], minlength=num_nodes)
    groups = np.flatnonzero(num_children >= 2)
    groups = groups[groups != 0]  # the root's value is a plain reduction of the whole row
    group_lo, group_hi = trie.rank[groups], trie.hi[groups]
    num_groups = len(groups)

    # Nearest branching ancestor of every node: constant along single-child chains,
    # which are runs of consecutive ids in pre-order.
    node_ids = np.arange(num_nodes)
    chain_child = np.zeros(num_nodes, dtype=bool)
    chain_child[1:] = num_children[trie.parent[1:]] == 1
    chain_top = np.maximum.accumulate(np.where(chain_child, 0, node_ids))
    branching_ancestor = trie.parent[chain_top]
    group_of_node = np.full(num_nodes, -1, dtype=np.int64)
    group_of_node[groups] = np.arange(num_groups)

    # Entities: items 0..L-1 (by rank), then groups L.. ; each with range and parent group.
    entity_lo = np.concatenate([np.arange(num_items), group_lo])
    entity_parent = np.concatenate(
        [branching_ancestor[trie.leaf_of_rank], branching_ancestor[groups]]
    )
    entity_parent = np.where(entity_parent >= 0, group_of_node[np.maximum(entity_parent, 0)], -1)

    # Choose the levels: which groups each finishes, over which row.
    computed = np.zeros(num_items + num_groups, dtype=bool)
    computed[:num_items] = True
    specs = []  # (groups, span starts, span lengths, bits, row entities or None)
    remaining, first, span, row = np.arange(num_groups), group_lo, group_hi - group_lo, None
    while len(remaining):
        bits = int(span.max()).bit_length()
        if row is None:
            bits = min(bits, _FIRST_LEVEL_BITS)
        finish = span < (1 << bits)
        specs.append((remaining[finish], first[finish], span[finish], bits, row))
        computed[num_items + remaining[finish]] = True
        remaining = remaining[~finish]
        if len(remaining):
            # Next row: the computed entities whose parent group is not computed; they tile
            # the items, and each remaining group spans a run of them.
            parent_computed = computed[num_items + np.maximum(entity_parent, 0)]
            row = np.flatnonzero(computed & ~(parent_computed & (entity_parent >= 0)))
            row = row[np.argsort(entity_lo[row], kind="stable")]
            row_lo = entity_lo[row]
            first = np.searchsorted(row_lo, group_lo[remaining])
            span = np.searchsorted(row_lo, group_hi[remaining]) - first

    # Groups are numbered level by level, each level's in the order of its windows.
    group_start = 1 + num_items
    group_number = np.zeros(num_groups + 1, dtype=np.int64)  # one spare for masked lookups
    next_group, level_windows = 0, []
    for members, first, span, bits, _ in specs:
        order, table_positions, windows = _level_windows(first, span, bits)
        group_number[members[order]] = next_group + np.arange(len(members))
        level_windows.append((next_group, table_positions, windows))
        next_group += len(members)

    def slot_of_entity(entities: np.ndarray) -> np.ndarray:
        group_slot = group_start + group_number[np.maximum(entities - num_items, 0)]
        return np.where(entities < num_items, 1 + entities, group_slot)

    plan_levels = []
    for (members, _, _, _, row), (first_group, table_positions, windows) in zip(
        specs, level_windows, strict=True
    ):
        width = num_items if row is None else len(row)
        dense_tables, sparse_steps, table_positions = _sparse_tables(table_positions, width)
        plan_levels.append(
            _PlanLevel(
                row=None if row is None else slot_of_entity(row),
                width=width,
                start=group_start + first_group,
                stop=group_start + first_group + len(members),
                dense_tables=dense_tables,
                sparse_steps=sparse_steps,
                table_positions=table_positions,
                windows=windows,
            )
        )

    # Node ids: the root, the items by rank, the groups in plan order, then the nodes
    # with a single child ("chain" nodes), which show the value of the first other
    # node below them, ordered by that node's position.
    values_stop = group_start + num_groups
    position = np.empty(num_nodes, dtype=np.int64)
    position[0] = 0
    position[trie.leaf_of_rank] = 1 + np.arange(num_items)
    position[groups] = group_start + group_number[:num_groups]
    chains = np.flatnonzero(num_children == 1)
    chains = chains[chains != 0]
    not_chain = np.where(num_children != 1, node_ids, num_nodes)
    representative = np.minimum.accumulate(not_chain[::-1])[::-1]
    source = position[representative[chains]]
    order = np.argsort(source, kind="stable")
    position[chains[order]] = values_stop + np.arange(len(chains))
    plan = _ReductionPlan(
        num_items=num_items,
        perm=trie.order,
        levels=plan_levels,
        values_stop=values_stop,
        chain_source=source[order],
    )
    return plan, position


def _workspace_size(plan: _ReductionPlan) -> int:
    """Float64 values `_run_plan` needs: row, tables, pairs, staging, scratch, a weight row."""
    return (
        plan.row_size
        + 2 * plan.table_size
        + plan.pair_size
        + plan.stage_size
        + plan.scratch_size
        + plan.num_items
    )


def _run_plan(
    plan: _ReductionPlan,
    weights: Sequence[np.ndarray],
    op: np.ufunc,
    workspace: np.ndarray,
    out: np.ndarray,
) -> None:
    """Write every node's value for each weight row (`num_items` floats) into a row of `out`.

    The output row itself holds the values the plan computes (see `_ReductionPlan`);
    the doubling tables, staged windows and level rows live in `workspace`
    (`_workspace_size(plan)` float64 values, reused between calls: fresh memory
    costs page faults), and rows are processed one at a time so that a row's
    working values stay in the CPU cache. Every step is a gather (`take` in "clip"
    mode, numpy's fast path: the plan's indices are all in range) or a dense
    element-wise pass, each into a preallocated destination that shares no memory
    with its sources (numpy would copy otherwise).
    """
    size = plan.num_items
    row_buffer, rest = workspace[: plan.row_size], workspace[plan.row_size :]
    tables, rest = rest[: 2 * plan.table_size].reshape(2, -1), rest[2 * plan.table_size :]
    pairs, rest = rest[: plan.pair_size], rest[plan.pair_size :]
    stage, rest = rest[: plan.stage_size], rest[plan.stage_size :]
    scratch, converted = rest[: plan.scratch_size], rest[plan.scratch_size :][:size]
    for weight_row, out_row in zip(weights, out, strict=True):
        if weight_row.dtype != np.float64:
            np.copyto(converted, weight_row)
            weight_row = converted
        values = out_row[: plan.values_stop]
        values[0] = op.reduce(weight_row)
        weight_row.take(plan.perm, out=values[1 : 1 + size], mode="clip")
        for level in plan.levels:
            table = values[1 : 1 + size]
            if level.row is not None:
                table = row_buffer[: level.width]
                values.take(level.row, out=table, mode="clip")
            staged = 0
            for b, positions in enumerate(level.table_positions):
                if b >= level.dense_tables:
                    left, right = level.sparse_steps[b - level.dense_tables]
                    pair, sparse = pairs[: len(left)], tables[b % 2, : len(left)]
                    table.take(left, out=sparse, mode="clip")
                    table.take(right, out=pair, mode="clip")
                    table = op(sparse, pair, out=sparse)
                elif b:
                    half = 1 << (b - 1)
                    table = op(table[:-half], table[half:], out=tables[b % 2, : len(table) - half])
                table.take(positions, out=stage[staged : staged + len(positions)], mode="clip")
                staged += len(positions)
            block = values[level.start : level.stop]
            for j, positions in enumerate(level.windows):
                if j == 0:
                    stage.take(positions, out=block, mode="clip")
                else:
                    head, window = block[: len(positions)], scratch[: len(positions)]
                    stage.take(positions, out=window, mode="clip")
                    op(head, window, out=head)
        values.take(plan.chain_source, out=out_row[plan.values_stop :], mode="clip")
