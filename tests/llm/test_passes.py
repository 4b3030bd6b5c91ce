"""plan_passes against a brute-force count of a batch's distinct uncached tokens; sub_batches."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from genlm.backend.llm.passes import Row, plan_passes, sub_batches

PROMPT = (7, 7, 1)  # cached before the batch; every context extends it


def prefixes(context):
    return {context[:n] for n in range(1, len(context) + 1)}


def run(passes, cached):
    """Simulate the backend: each row runs from its longest cached prefix (never past its
    first read), its tokens then join the cache. Returns the tokens run and the reads."""
    tokens, reads = 0, {}
    for rows in passes:
        for row in rows:
            limit = min(row.reads, default=len(row.context)) - 1
            past = max((n for n in range(limit + 1) if row.context[:n] in cached), default=0)
            tokens += len(row.context) - past
            for length, query in zip(row.reads, row.queries, strict=True):
                assert query not in reads, "a context is read twice"
                reads[query] = row.context[:length]
        for row in rows:  # a pass's key/values join the cache after the pass
            cached |= prefixes(row.context)
    return tokens, reads


contexts_strategy = st.lists(
    st.lists(st.integers(0, 2), min_size=1, max_size=12).map(lambda t: PROMPT + tuple(t)),
    min_size=1,
    max_size=12,
    unique=True,
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(contexts=contexts_strategy, min_saved=st.sampled_from([1, 4, 32]))
def test_every_context_read_once_from_its_own_position(contexts, min_saved):
    cached = prefixes(PROMPT)
    passes = plan_passes(contexts, lambda c: len(PROMPT), min_saved)
    tokens, reads = run(passes, set(cached))
    assert reads == dict(enumerate(contexts))
    assert tokens <= sum(len(c) - len(PROMPT) for c in contexts)
    if min_saved == 1:  # every shared stretch runs once: the batch's tree of new tokens
        distinct = set().union(*map(prefixes, contexts)) - cached
        assert tokens == len(distinct)


def test_all_prefixes_of_a_sequence_are_one_row():
    sequence = tuple(range(10, 58))
    passes = plan_passes([sequence[:n] for n in range(1, 49)], lambda c: 0)
    assert len(passes) == 1 and len(passes[0]) == 1
    assert passes[0][0].context == sequence
    assert passes[0][0].reads == list(range(1, 49))


def test_a_long_shared_uncached_prompt_runs_once_first():
    prompt = tuple(range(100, 164))
    contexts = [prompt + (i, i + 1) for i in range(8)]
    passes = plan_passes(contexts, lambda c: 0)
    assert [[row.context for row in rows] for rows in passes] == [[prompt], contexts]
    assert passes[0][0].reads == []
    # Cached already: no trunk.
    assert len(plan_passes(contexts, lambda c: len(prompt))) == 1


@pytest.mark.parametrize("shared", [1, 3])
def test_short_shared_stretches_are_recomputed(shared):
    contexts = [tuple(range(shared)) + (50 + i,) for i in range(4)]
    assert len(plan_passes(contexts, lambda c: 0)) == 1  # (4 - 1) * 3 < 32 tokens spared


def test_a_prefix_inside_the_cached_part_of_its_row_runs_alone():
    prompt = tuple(range(30))
    contexts = [prompt[:3], prompt[:12], prompt + (5, 6)]
    passes = plan_passes(contexts, lambda c: min(len(c), 25))  # prompt[:25] cached
    rows = {row.context: row.reads for row in passes[0]}
    assert len(passes) == 1
    assert rows == {prompt[:3]: [3], prompt[:12]: [12], prompt + (5, 6): [32]}


def test_prefixes_of_a_cached_prompt_recompute_it_where_rows_of_their_own_cost_more():
    prompt = tuple(range(50))
    contexts = [prompt[:n] for n in range(1, 51)] + [prompt + (7, 8)]
    cached = set(prefixes(prompt[:30]))  # cache_kv(prompt[:30])
    # Rows of their own: 30 one-token rows and the row from its cached 30 tokens.
    passes = plan_passes(contexts, lambda c: 30 if len(c) >= 30 else len(c))
    assert len(passes[0]) == 31
    assert run(passes, set(cached)) == (52, dict(enumerate(contexts)))
    # At two tokens a row of its own, the row recomputes the prompt instead.
    passes = plan_passes(contexts, lambda c: 30 if len(c) >= 30 else len(c), alone_cost=2.0)
    assert [[(row.context, row.reads) for row in rows] for rows in passes] == [
        [(prompt + (7, 8), [*range(1, 51), 52])]
    ]
    assert run(passes, set(cached)) == (52, dict(enumerate(contexts)))


@pytest.mark.parametrize(
    ("lengths", "alone"),
    [
        ([3], [3]),  # one read deep inside: one token alone, not 23 recomputed
        ([3, 12], [3, 12]),
        ([24], []),  # 2 tokens recomputed cost no more than one row of its own
        ([3, 22, 23, 24], [3]),  # the row recomputes from 22 (4 tokens) and runs 3 alone
    ],
)
def test_reads_inside_the_cached_part_run_alone_where_that_costs_less(lengths, alone):
    prompt = tuple(range(30))
    contexts = [prompt[:n] for n in lengths] + [prompt + (5, 6)]
    passes = plan_passes(contexts, lambda c: min(len(c), 25), alone_cost=2.0)
    (rows,) = passes
    assert sorted(row.reads[0] for row in rows if len(row.context) < 32) == alone
    long_row = next(row for row in rows if len(row.context) == 32)
    assert long_row.reads == [n for n in lengths if n not in alone] + [32]
    tokens, reads = run(passes, set(prefixes(prompt[:25])))
    assert reads == dict(enumerate(contexts))


def test_a_context_cached_whole_runs_only_its_last_token():
    prompt = tuple(range(20))
    passes = plan_passes([prompt[:5], prompt], lambda c: len(c))  # both cached whole
    assert [[(row.context, row.reads) for row in rows] for rows in passes] == [
        [(prompt[:5], [5]), (prompt, [20])]
    ]


def rows_of(sizes):
    """Rows of `new + past` tokens, each read at its end, and their past lengths."""
    rows = [Row(tuple(range(new + past)), [new + past]) for new, past in sizes]
    return rows, [past for _, past in sizes]


def test_short_rows_do_not_share_a_sub_batch_with_a_long_one():
    # A 20-token trunk from a 30-token past, and 29 prefixes one token past their cached part.
    rows, pasts = rows_of([(20, 30)] + [(1, n) for n in range(29)])
    assert sub_batches(rows, pasts) == [[0, 29], list(range(28, 0, -1))]
    # Without padding beyond 8 tokens, the trunk runs alone (40 slots for 21 tokens before).
    assert sub_batches(rows, pasts, padding=0.0) == [[0], list(range(29, 0, -1))]


def test_aligned_pasts_and_fits_split_sub_batches():
    rows, pasts = rows_of([(2, 5), (2, 6), (2, 5), (2, 5)])
    assert sub_batches(rows, pasts) == [[1, 0, 2, 3]]
    assert sub_batches(rows, pasts, aligned_pasts=True) == [[1], [0, 2, 3]]
    asked = []

    def fits(n_rows, max_new, max_past, n_reads):
        asked.append((n_rows, max_new, max_past, n_reads))
        return n_rows <= 2

    assert sub_batches(rows, pasts, fits=fits) == [[1, 0], [2, 3]]
    assert asked == [(2, 2, 6, 2), (3, 2, 6, 3), (2, 2, 5, 2)]
