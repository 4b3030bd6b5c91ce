"""KVPrefixCache against brute force: stored sequences, their key/values, and memory held."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from genlm.backend.cache import KVPrefixCache

BYTES_PER_TOKEN = 2 * 8  # fake key/values: two float64 per token


def fake_kv(token_ids, start=0):
    """Key/values of `token_ids[start:]` that depend on the whole prefix of each token.

    Shape `[1, tokens, 2]` (token dimension -2): position and a hash of the prefix
    up to and including the token, so a value served for the wrong prefix shows.
    """
    rows, h = [], 0
    for i, token in enumerate(token_ids):
        h = (h * 1_000_003 + token + 1) % 2_147_483_647
        if i >= start:
            rows.append([float(i), float(h)])
    return torch.tensor(rows, dtype=torch.float64).reshape(1, -1, 2)


def held_bytes(cache, namespaces=(None,)):
    """Bytes of the distinct tensors the cache's nodes keep alive (measured, not accounted)."""
    storages = {}
    stack = [cache.root(namespace) for namespace in namespaces]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node.past_key_values is not None:
            storage = node.past_key_values.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def assert_served_exactly(cache, token_ids, namespace=None):
    found = cache.match(token_ids, namespace)
    if found.length:
        assert torch.equal(found.key_values(), fake_kv(token_ids[: found.length]))
    return found.length


def common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_match_of_empty_cache_is_the_root():
    cache = KVPrefixCache(1000)
    found = cache.match([1, 2, 3])
    assert found.length == 0 and found.segments == () and found.key_values() is None
    assert found.node.past_key_values is None


def test_insert_then_match_prefixes_extensions_and_branches():
    cache = KVPrefixCache(10_000)
    cache.insert([1, 2, 3, 4], 0, fake_kv([1, 2, 3, 4]))
    assert assert_served_exactly(cache, [1, 2, 3, 4, 5]) == 4
    assert assert_served_exactly(cache, [1, 2, 9]) == 2  # ends inside the edge
    cache.insert([1, 2, 9, 9], 2, fake_kv([1, 2, 9, 9], 2))  # branch: splits the edge
    assert assert_served_exactly(cache, [1, 2, 9, 9]) == 4
    assert assert_served_exactly(cache, [1, 2, 3, 4]) == 4
    cache.insert([1, 2, 3, 4, 5, 6], 4, fake_kv([1, 2, 3, 4, 5, 6], 4))  # extends a leaf
    assert assert_served_exactly(cache, [1, 2, 3, 4, 5, 6, 7]) == 6
    assert cache.nbytes == held_bytes(cache)


def test_match_respects_max_length_and_namespaces():
    cache = KVPrefixCache(10_000)
    cache.insert([5, 6, 7], 0, fake_kv([5, 6, 7]), namespace="a")
    assert cache.match([5, 6, 7], "a", max_length=2).length == 2
    assert cache.match([5, 6, 7], "b").length == 0
    assert cache.match([5, 6, 7]).length == 0


def test_insert_without_cached_start_stores_nothing():
    cache = KVPrefixCache(10_000)
    assert cache.insert([1, 2, 3], 2, fake_kv([1, 2, 3], 2)) == 0
    assert cache.nbytes == 0


def test_budget_never_exceeded_and_lru_evicted_first():
    cache = KVPrefixCache(10 * BYTES_PER_TOKEN)
    cache.insert([1, 1, 1, 1], 0, fake_kv([1, 1, 1, 1]))
    cache.insert([2, 2, 2, 2], 0, fake_kv([2, 2, 2, 2]))
    cache.match([1, 1, 1, 1])  # 1s are now more recently used than 2s
    cache.insert([3, 3, 3, 3], 0, fake_kv([3, 3, 3, 3]))
    assert cache.nbytes <= cache.max_bytes and cache.peak_nbytes <= cache.max_bytes
    assert cache.match([2, 2, 2, 2]).length == 0
    assert assert_served_exactly(cache, [1, 1, 1, 1]) == 4
    assert assert_served_exactly(cache, [3, 3, 3, 3]) == 4


def test_locked_path_is_not_evicted():
    cache = KVPrefixCache(8 * BYTES_PER_TOKEN)
    cache.insert([1, 2, 3, 4], 0, fake_kv([1, 2, 3, 4]))
    found = cache.match([1, 2, 3, 4])
    cache.lock(found.node)
    for token in range(5, 9):
        cache.insert([token] * 4, 0, fake_kv([token] * 4))
    assert assert_served_exactly(cache, [1, 2, 3, 4]) == 4
    assert cache.nbytes <= cache.max_bytes
    cache.unlock(found.node)
    cache.insert([9] * 8, 0, fake_kv([9] * 8))
    assert cache.match([1, 2, 3, 4]).length == 0
    assert assert_served_exactly(cache, [9] * 8) == 8


def test_entry_larger_than_budget_is_not_stored():
    cache = KVPrefixCache(3 * BYTES_PER_TOKEN)
    assert cache.insert([1, 2, 3, 4], 0, fake_kv([1, 2, 3, 4])) == 0
    assert cache.nbytes == 0


def test_matched_segments_survive_eviction_and_clear():
    cache = KVPrefixCache(4 * BYTES_PER_TOKEN)
    cache.insert([1, 2, 3], 0, fake_kv([1, 2, 3]))
    found = cache.match([1, 2, 3])
    cache.clear()
    cache.insert([4, 5, 6, 7], 0, fake_kv([4, 5, 6, 7]))
    assert torch.equal(found.key_values(), fake_kv([1, 2, 3]))
    assert len(cache) == 1 and cache.nbytes == 4 * BYTES_PER_TOKEN


def test_particles_growing_one_token_at_a_time_keep_paths_short():
    cache = KVPrefixCache(1_000_000)
    particles = [[7, 7] for _ in range(4)]
    cache.insert(particles[0], 0, fake_kv(particles[0]))
    for step in range(40):
        for p, particle in enumerate(particles):
            particle.append((step * 4 + p) % 5)
            cache.insert(particle, len(particle) - 1, fake_kv(particle, len(particle) - 1))
    for particle in particles:
        found = cache.match(particle)
        assert found.length == len(particle)
        assert len(found.segments) <= 3  # shared prompt edge, then one growing edge each
        assert_served_exactly(cache, particle)
    assert cache.nbytes == held_bytes(cache)


sequences = st.lists(st.integers(0, 3), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(
    operations=st.lists(st.tuples(sequences, st.integers(0, 12), st.booleans()), max_size=25),
    budget_tokens=st.integers(0, 60),
)
def test_random_operations_against_brute_force(operations, budget_tokens):
    cache = KVPrefixCache(budget_tokens * BYTES_PER_TOKEN)
    unbounded = KVPrefixCache(10**9)
    inserted = []
    for token_ids, start, lock in operations:
        start = min(start, len(token_ids) - 1)
        start = min(start, cache.match(token_ids).length)  # attach to what is cached
        found = cache.match(token_ids)
        if lock:
            cache.lock(found.node)
        cache.insert(token_ids, start, fake_kv(token_ids, start))
        if lock:
            cache.unlock(found.node)
        unbounded.insert(token_ids, 0, fake_kv(token_ids))
        inserted.append(token_ids)
        assert cache.nbytes <= cache.max_bytes
        assert cache.nbytes == held_bytes(cache)
        for probe in inserted:
            # What is served is exact; without a budget, the match is the longest common prefix.
            assert_served_exactly(cache, probe)
            brute = max(common_prefix(probe, other) for other in inserted)
            assert assert_served_exactly(unbounded, probe) == brute
    assert cache.peak_nbytes <= cache.max_bytes
