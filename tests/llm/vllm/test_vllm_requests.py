"""How `AsyncVirtualLM` turns a batch of queries into engine requests (no engine needed)."""

import json
import random

import pytest

from genlm.backend.llm.vllm.request_plan import adapts_output_layer, plan_requests


def always(adapter):
    return True


def random_queries(rng, count, adapters=(None,), lengths=(1, 6)):
    """Distinct (adapter, context) queries over a tiny alphabet, so that many are prefixes."""
    queries = set()
    while len(queries) < count:
        length = rng.randint(*lengths)
        queries.add((rng.choice(adapters), tuple(rng.randint(0, 2) for _ in range(length))))
    return list(queries)


def extends(longer, shorter):
    return len(longer) > len(shorter) and longer[: len(shorter)] == shorter


@pytest.mark.parametrize("lengths", [(1, 6), (5, 5)], ids=["mixed-lengths", "one-length"])
@pytest.mark.parametrize("seed", range(20))
def test_every_query_is_in_one_chain_of_prefixes_of_its_first(seed, lengths):
    rng = random.Random(seed)
    queries = random_queries(rng, 40, adapters=(None, "a", "b"), lengths=lengths)
    plan = plan_requests(queries, always)
    members = [i for chain in plan for i in chain.members]
    assert sorted(members) == list(range(len(queries)))
    for chain in plan:
        adapter, first = queries[chain.members[0]]
        assert chain.reads_prefix_cache
        for i in chain.members[1:]:
            assert queries[i][0] == adapter and extends(first, queries[i][1])
    # A request per context that no other context of its adapter extends: no fewer possible.
    unextended = [
        q for q in queries if not any(o[0] == q[0] and extends(o[1], q[1]) for o in queries)
    ]
    assert len(plan) == len(unextended)


def test_all_prefixes_of_a_sequence_are_one_request():
    ids = (5, 9, 2, 7, 7, 1)
    queries = [(None, ids[:i]) for i in range(len(ids), 0, -1)]
    (chain,) = plan_requests(queries, always)
    assert chain.members[0] == 0 and sorted(chain.members) == list(range(len(ids)))


def test_adapters_without_chains_get_a_request_per_query():
    queries = [(None, (1,)), (None, (1, 2)), ("head", (1,)), ("head", (1, 2))]
    plan = plan_requests(queries, lambda adapter: adapter != "head")
    assert sorted(sorted(chain.members) for chain in plan) == [[0, 1], [2], [3]]


def test_a_recomputed_chain_is_used_only_where_it_computes_fewer_tokens():
    block = 4
    # All 8 prefixes of 8 tokens: alone they compute 1+2+3+4+1+2+3+4 = 20 tokens, the chain 8.
    queries = [(None, tuple(range(k))) for k in range(1, 9)]
    (chain,) = plan_requests(queries, always, recompute=True, block_size=block)
    assert not chain.reads_prefix_cache
    # Two prefixes that each end a block past the cache: alone 1 + 1 tokens, the chain 9.
    queries = [(None, tuple(range(5))), (None, tuple(range(9)))]
    plan = plan_requests(queries, always, recompute=True, block_size=block)
    assert sorted(chain.members for chain in plan) == [[0], [1]]
    assert all(chain.reads_prefix_cache for chain in plan)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"target_modules": ["q_proj", "v_proj"]}, False),
        ({"target_modules": "model.*(q_proj|v_proj)"}, False),
        ({"target_modules": ["q_proj", "lm_head"]}, True),
        ({"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}, True),
        ({"target_modules": ".*(lm_head|q_proj)"}, True),
        (None, True),  # unreadable: counted as changing it
    ],
)
def test_adapters_that_change_the_output_layer_are_recognised(tmp_path, config, expected):
    if config is not None:
        (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    assert adapts_output_layer(str(tmp_path)) is expected
