"""TokenCharacterTrie and ParallelTokenCharacterTrie against a brute-force reference.

The reference walks `children` from the root and reduces, for every node, over the
items whose symbols start with the node's path (a leaf: over its own item)."""

import collections
import math
import multiprocessing
import shutil
import warnings
from concurrent.futures import ThreadPoolExecutor

import graphviz
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from genlm.backend import (
    AsyncTokenCharacterTrie,
    ParallelTokenCharacterTrie,
    Token,
    TokenCharacterTrie,
)
from genlm.backend.trie import base as trie_base
from genlm.backend.trie import parallel as trie_parallel

# Plain byte strings are still supported items (deprecated in favour of `Token`s), and most
# vocabularies here use them on purpose; the warning itself is tested below
# (`test_plain_bytes_warn_once_per_trie`), which records warnings whatever the filters.
PLAIN_BYTES_WARNING = "Passing plain bytes to TokenCharacterTrie is deprecated"
pytestmark = pytest.mark.filterwarnings(f"ignore:{PLAIN_BYTES_WARNING}:DeprecationWarning")


def symbols_of(item) -> tuple:
    """The symbols of a vocabulary item, as the trie's edges carry them (bytes -> ints)."""
    return tuple(item)


def walk(trie) -> dict[int, tuple[tuple, int | None]]:
    """Every node reachable from the root: node -> (symbols on its path, item if a leaf)."""
    found = {trie.root: ((), None)}
    stack = [trie.root]
    while stack:
        node = stack.pop()
        path, _ = found[node]
        for edge, child in trie.children[node].items():
            assert child not in found, "the trie must be a tree"
            if isinstance(edge, tuple) and len(edge) == 2 and edge[0] is None:
                found[child] = (path, edge[1])
            else:
                found[child] = (path + (edge,), None)
            stack.append(child)
    return found


def node_items(trie, vocab) -> dict[int, list[int]]:
    """For each node, the positions of the items below it, from their symbols alone.

    An inner node with path p is above every item whose symbols start with p;
    a leaf is above its own item only.
    """
    item_symbols = [symbols_of(item) for item in vocab]
    items = {}
    for node, (path, leaf_item) in walk(trie).items():
        if leaf_item is not None:
            items[node] = [leaf_item]
        else:
            items[node] = [i for i, s in enumerate(item_symbols) if s[: len(path)] == path]
    return items


def reduce_nodes(items: dict[int, list[int]], ws: np.ndarray, how: str) -> np.ndarray:
    """The reference value of every node: `math.fsum` (correctly rounded) or `max`."""
    out = np.empty(len(items))
    for node, members in items.items():
        values = [float(ws[i]) for i in members]
        if how == "sum":
            out[node] = math.fsum(values) if values else 0.0
        else:
            out[node] = max(values) if values else -math.inf
    return out


class TorchPathTrie(ParallelTokenCharacterTrie):
    """The parallel class's device path (the one CUDA devices run), forced on the CPU.

    `_on_cpu` decides both whether the CSR matrix is built and which path reduces.
    """

    def __init__(self, vocab):
        super().__init__(vocab, device="cpu")

    def _on_cpu(self) -> bool:
        return False


CLASSES = [
    TokenCharacterTrie,
    lambda vocab: ParallelTokenCharacterTrie(vocab, device="cpu"),
    TorchPathTrie,
]
CLASS_IDS = ["sequential", "parallel", "parallel-torch-path"]


def assert_sums_close(actual, expected, ws):
    # A float64 sum of n terms, added in any order (the numpy plan's, or the device
    # path's sparse product), is within n * 2**-52 * sum(|terms|) of the exact sum (the
    # reference is correctly rounded); -inf entries must match exactly.
    finite = np.asarray(ws, dtype=np.float64)
    scale = np.abs(finite[np.isfinite(finite)]).sum() + 1e-300
    np.testing.assert_allclose(actual, expected, rtol=0, atol=len(finite) * 2.0**-52 * scale)


def check_against_reference(trie, vocab, ws):
    items = node_items(trie, vocab)
    assert len(items) == len(trie.children)
    assert_sums_close(trie.weight_sum(ws), reduce_nodes(items, ws, "sum"), ws)
    np.testing.assert_array_equal(trie.weight_max(ws), reduce_nodes(items, ws, "max"))


def check_structure(trie, vocab):
    nodes = walk(trie)
    assert set(nodes) == set(range(len(trie.children)))
    assert trie.root == 0 and trie.decode == list(vocab)
    for i, item in enumerate(vocab):
        node = trie.root
        for symbol in item:
            node = trie.children[node][symbol]
        leaf = trie.children[node][(None, i)]
        if isinstance(item, Token):
            key = (bytes(item), item.token_id)
        else:
            key = tuple(item) if isinstance(item, list) else item
        assert trie.word2leaf[key] == leaf and trie.leaf2word[leaf] == key
        assert trie.children[leaf] == {}
    assert len(trie.word2leaf) == len(trie.leaf2word) == len(vocab)
    for node, (path, _) in nodes.items():
        prefix = trie.node2prefix[node]
        if all(isinstance(s, int) and 0 <= s < 256 for s in path):
            assert prefix == bytes(path) and isinstance(prefix, bytes)
        else:
            assert prefix == path
    assert len(trie.node2prefix) == len(trie.children)


class EndOfSequence:
    """An end-of-sequence item iterable over its own symbol (or over nothing)."""

    def __init__(self, symbols: tuple = ()):
        self.symbols = symbols

    def __iter__(self):
        return iter(self.symbols)

    def __repr__(self):
        return "EOS"


EOS_SYMBOL = "<eos>"

HAND_VOCABS = {
    "prefixes": [b"a", b"ab", b"abc", b"b", b"", b"abd"],
    "tokens_sharing_bytes": [Token(0, b"ab"), Token(1, b"ab"), Token(2, b"a"), Token(3, b"")],
    "single": [b"x"],
    "empty_string_only": [b""],
    "nul_and_high_bytes": [b"\x00", b"\x00\x00", b"\xff", b"\xff\x00", b"\x00\xff", b"\x01"],
    "bytes_and_eos": [b"a", b"ab", EndOfSequence()],
    "bytes_and_eos_symbol": [Token(0, b"a"), Token(1, b"<"), EndOfSequence((EOS_SYMBOL,))],
    "mixed_symbols": ["ab", "ac", b"ab", (1, 2), [300, "x"], (), (97,)],
}


@pytest.mark.parametrize("make", CLASSES, ids=CLASS_IDS)
@pytest.mark.parametrize("name", HAND_VOCABS)
def test_hand_vocabularies_match_brute_force(make, name):
    vocab = HAND_VOCABS[name]
    trie = make(vocab)
    check_structure(trie, vocab)
    rng = np.random.default_rng(0)
    ws = rng.normal(size=len(vocab))
    ws[0] = -np.inf
    ws[-1] = 0.0
    check_against_reference(trie, vocab, ws)
    check_against_reference(trie, vocab, np.full(len(vocab), -np.inf))


def test_node2prefix_types():
    trie = TokenCharacterTrie([b"ab", EndOfSequence((EOS_SYMBOL,)), [97, EOS_SYMBOL]])
    prefixes = set(trie.node2prefix.values())
    assert prefixes == {b"", b"a", b"ab", (EOS_SYMBOL,), (97, EOS_SYMBOL)}
    with pytest.raises(KeyError):
        trie.node2prefix[len(trie.children)]


byte_strings = st.lists(st.sampled_from([0, 1, 97, 98, 255]), max_size=5).map(bytes)
weights = st.one_of(
    st.floats(-1e3, 1e3, allow_nan=False), st.just(0.0), st.just(-np.inf), st.just(-0.5)
)


@st.composite
def vocab_and_weights(draw):
    strings = draw(st.lists(byte_strings, max_size=25))
    as_tokens = draw(st.booleans())
    vocab = (
        [Token(i, s) for i, s in enumerate(strings)] if as_tokens else list(dict.fromkeys(strings))
    )
    if draw(st.booleans()):
        vocab.append(EndOfSequence(draw(st.sampled_from([(), (EOS_SYMBOL,)]))))
    ws = np.array(draw(st.lists(weights, min_size=len(vocab), max_size=len(vocab))))
    return vocab, ws


@settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(vocab_and_weights())
def test_random_vocabularies_match_brute_force(data):
    vocab, ws = data
    items = None
    for make in CLASSES:
        trie = make(vocab)
        check_structure(trie, vocab)
        items = node_items(trie, vocab) if items is None else items
        assert_sums_close(trie.weight_sum(ws), reduce_nodes(items, ws, "sum"), ws)
        np.testing.assert_array_equal(trie.weight_max(ws), reduce_nodes(items, ws, "max"))


@settings(max_examples=15, deadline=None, derandomize=True)
@given(st.lists(byte_strings, min_size=1, max_size=40, unique=True), st.integers(0, 4))
def test_batches_equal_rows(vocab, batch):
    # Maxima do not depend on the order of the terms: a batch's rows equal single rows.
    # Sums do (the device path's sparse product adds a batch's terms in another order
    # than a single row's), so each batched row is held to the bound of any order
    # against the brute-force sum.
    rng = np.random.default_rng(batch)
    ws = rng.normal(size=(batch, len(vocab)))
    for make in CLASSES:
        trie = make(vocab)
        items = node_items(trie, vocab)
        expected = np.array([trie.weight_max(row) for row in ws])
        expected = expected.reshape(batch, len(trie.children))
        for weights in (ws, list(ws), torch.from_numpy(ws)):
            np.testing.assert_array_equal(trie.batch_weight_max(weights), expected)
            sums = trie.batch_weight_sum(weights)
            assert sums.shape == (batch, len(trie.children))
            for row, summed in zip(ws, sums, strict=True):
                assert_sums_close(summed, reduce_nodes(items, row, "sum"), row)


def test_results_kept_by_the_caller_are_never_overwritten():
    # A later result may be written into the memory of an earlier one only when nothing
    # refers to it any more: every way of keeping a result must protect it.
    vocab = [b"a", b"ab", b"abc", b"b", b"ba", b"c", b""]
    rng = np.random.default_rng(3)
    first, second = rng.normal(size=(2, 4, len(vocab)))
    for make in CLASSES[:2]:  # the numpy path (the torch path copies results off the device)
        trie = make(vocab)
        items = node_items(trie, vocab)
        expected = np.array([reduce_nodes(items, row, "max") for row in first])
        # Each kept result is followed by a call of the same shape on other weights.
        kept_array = trie.batch_weight_max(first)
        trie.batch_weight_max(second)
        kept_row = trie.batch_weight_max(first)[2]
        trie.batch_weight_max(second)
        kept_tensor = torch.from_numpy(trie.batch_weight_max(first))
        trie.batch_weight_max(second)
        kept_single = trie.weight_max(first[1])
        trie.weight_max(second[0])
        np.testing.assert_array_equal(kept_array, expected)
        np.testing.assert_array_equal(kept_row, expected[2])
        np.testing.assert_array_equal(kept_tensor.numpy(), expected)
        np.testing.assert_array_equal(kept_single, expected[1])


def test_threads_calling_at_once_get_their_own_results():
    rng = np.random.default_rng(4)
    vocab = sorted({bytes(rng.integers(97, 101, size=rng.integers(1, 6))) for _ in range(300)})
    batches = rng.normal(size=(6, 5, len(vocab)))
    trie = TokenCharacterTrie(vocab)
    items = node_items(trie, vocab)
    expected = [[reduce_nodes(items, row, "sum") for row in batch] for batch in batches]
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda b: [trie.batch_weight_sum(b) for _ in range(4)], batches))
    for batch, repeats, rows in zip(batches, results, expected, strict=True):
        for result in repeats:
            for row, weights, reference in zip(result, batch, rows, strict=True):
                assert_sums_close(row, reference, weights)


def test_batches_shared_among_more_threads_than_this_machine_has(monkeypatch):
    # Machines with more cores split a batch into more shares, of unequal sizes here.
    monkeypatch.setattr(trie_base, "_row_thread_count", lambda: 4)
    rng = np.random.default_rng(6)
    vocab = sorted({bytes(rng.integers(97, 101, size=rng.integers(1, 6))) for _ in range(200)})
    ws = rng.normal(size=(7, len(vocab)))
    trie = TokenCharacterTrie(vocab)
    items = node_items(trie, vocab)
    for row, weights in zip(trie.batch_weight_sum(ws), ws, strict=True):
        assert_sums_close(row, reduce_nodes(items, weights, "sum"), weights)
    for row, weights in zip(trie.batch_weight_max(ws), ws, strict=True):
        np.testing.assert_array_equal(row, reduce_nodes(items, weights, "max"))


def test_a_forked_child_reduces_batches():
    # The row threads belong to the process that started them: a forked child must
    # start its own rather than wait forever on threads it does not have.
    vocab = [b"a", b"ab", b"b", b"bc", b"bd"]
    ws = np.random.default_rng(5).normal(size=(4, len(vocab)))
    trie = TokenCharacterTrie(vocab)
    trie.batch_weight_sum(ws)  # starts this process's row threads
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=lambda: results.put(trie.batch_weight_sum(ws)))
    child.start()
    try:
        from_child = results.get(timeout=60)
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    items = node_items(trie, vocab)
    for row, weights in zip(from_child, ws, strict=True):
        assert_sums_close(row, reduce_nodes(items, weights, "sum"), weights)


def test_many_items_and_deep_chains_match_brute_force():
    # Wide fan-outs and long chains of nested prefixes exercise every level of the plan.
    rng = np.random.default_rng(1)
    vocab = [b"=" * n for n in range(2, 90)] + [bytes([b]) for b in range(256)]
    vocab += sorted({bytes(rng.integers(97, 100, size=rng.integers(2, 8))) for _ in range(600)})
    ws = rng.normal(size=len(vocab))
    ws[rng.integers(0, len(vocab), size=20)] = -np.inf
    for make in CLASSES:
        trie = make(vocab)
        check_against_reference(trie, vocab, ws)


@pytest.mark.parametrize("make", CLASSES, ids=CLASS_IDS)
def test_weight_inputs(make):
    vocab = [b"a", b"ab", b"b"]
    trie = make(vocab)
    expected = trie.weight_sum(np.array([1.0, 2.0, 3.0]))
    for ws in (
        torch.tensor([1.0, 2.0, 3.0]),
        torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16),
        np.array([1, 2, 3], dtype=np.float32),
        [1.0, 2.0, 3.0],
    ):
        result = trie.weight_sum(ws)
        assert isinstance(result, np.ndarray) and result.dtype == np.float64
        np.testing.assert_array_equal(result, expected)
    for batch in (np.array([[1, 2, 3]], dtype=np.float32), torch.tensor([[1.0, 2.0, 3.0]])):
        result = trie.batch_weight_sum(batch)
        assert isinstance(result, np.ndarray) and result.dtype == np.float64
        np.testing.assert_array_equal(result, expected[None])
    assert trie.batch_weight_max([]).shape == (0, len(trie.children))


@pytest.mark.parametrize("make", CLASSES, ids=CLASS_IDS)
def test_wrong_lengths_raise(make):
    trie = make([b"a", b"b"])
    for method in (trie.weight_sum, trie.weight_max):
        for ws in (np.ones(3), np.ones(1), np.ones((1, 2)), torch.ones(3)):
            with pytest.raises(ValueError, match="shape"):
                method(ws)
    for method in (trie.batch_weight_sum, trie.batch_weight_max):
        for ws in (np.ones((2, 3)), np.ones(2), [np.ones(2), np.ones(3)]):
            with pytest.raises(ValueError, match="shape"):
                method(ws)


@pytest.mark.parametrize("make", CLASSES, ids=CLASS_IDS)
def test_duplicates_raise(make):
    # 0.3.x's message prefix, then the item and both of its positions.
    with pytest.raises(
        ValueError, match=r"^Duplicate word in vocabulary: b'a' is both decode\[0\] and decode\[2\]"
    ):
        make([b"a", b"b", b"a"])
    with pytest.raises(
        ValueError,
        match=r"^Duplicate word in vocabulary: \(b'a', 3\) is both decode\[1\] and decode\[2\]",
    ):
        make([Token(2, b"a"), Token(3, b"a"), Token(3, b"a")])
    with pytest.raises(ValueError, match=r"^Duplicate word in vocabulary: \(1, 2\)"):
        make([(1, 2), "ab", (1, 2)])
    make([Token(3, b"a"), Token(4, b"a"), b"a"])  # distinct keys


# Every way of building a trie from a vocabulary.
BUILDERS = [
    *CLASSES[:2],
    lambda vocab: AsyncTokenCharacterTrie.from_vocab(vocab, backend="parallel", device="cpu").trie,
    lambda vocab: AsyncTokenCharacterTrie.from_vocab(vocab, backend="sequential").trie,
]
BUILDER_IDS = [*CLASS_IDS[:2], "from_vocab-parallel", "from_vocab-sequential"]


@pytest.mark.parametrize("make", BUILDERS, ids=BUILDER_IDS)
def test_plain_bytes_warn_once_per_trie(make):
    plain = [b"a", b"ab", b"b", b"", EndOfSequence()]
    tokens = [Token(0, b"a"), Token(1, b"ab"), Token(2, b"b"), Token(3, b""), EndOfSequence()]
    ws = np.array([0.1, 0.2, 0.3, 0.15, 0.25])
    for vocab in (plain, [tokens[0], b"ab", tokens[2], bytearray(b""), tokens[4]]):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trie = make(vocab)
        [warning] = caught  # one warning per trie, however many plain items
        assert warning.category is DeprecationWarning
        message = str(warning.message)
        assert message.startswith(PLAIN_BYTES_WARNING)
        assert "pass Token items instead" in message and "decode_vocab" in message
        assert warning.filename == __file__  # points at the code that built the trie
        # Still works: the same trie as the Tokens give.
        expected = make(tokens)
        np.testing.assert_array_equal(trie.weight_sum(ws), expected.weight_sum(ws))
        assert trie.children == expected.children
    with pytest.warns(DeprecationWarning, match=f"^{PLAIN_BYTES_WARNING}") as record:
        make([b"x", b"y", b"z"])
    assert len(record) == 1 and "3 of the 3 items are plain bytes" in str(record[0].message)


@pytest.mark.parametrize("make", BUILDERS, ids=BUILDER_IDS)
def test_tokens_and_symbol_items_do_not_warn(make, gpt2_vocab):
    vocabularies = [
        [Token(0, b"a"), Token(1, b"ab"), EndOfSequence((EOS_SYMBOL,))],
        ["ab", (1, 2), [300, "x"], EndOfSequence()],
        [*gpt2_vocab, EndOfSequence()],  # decode_vocab's Tokens, as the project's code passes
        [],
    ]
    for vocab in vocabularies:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            make(vocab)


def test_bad_items_raise():
    with pytest.raises(TypeError, match="decode\\[1\\]"):
        TokenCharacterTrie([b"a", 5])
    with pytest.raises(TypeError, match="unhashable"):
        TokenCharacterTrie([b"a", [[1]]])


def test_empty_vocabulary():
    for make in CLASSES:
        trie = make([])
        assert trie.children == [{}]
        np.testing.assert_array_equal(trie.weight_sum(np.zeros(0)), [0.0])
        np.testing.assert_array_equal(trie.weight_max(np.zeros(0)), [-np.inf])


def test_torch_path_matrix_lists_the_items_below_every_node():
    # Row n of the device path's CSR matrix holds the items below node n (node ids as
    # in the base class) in increasing order, as a valid CSR matrix must for cuSPARSE.
    rng = np.random.default_rng(7)
    vocab = sorted({bytes(rng.integers(97, 100, size=rng.integers(0, 6))) for _ in range(200)})
    vocab += [EndOfSequence((EOS_SYMBOL,)), EndOfSequence()]
    trie = TorchPathTrie(vocab)
    crow, col = trie._node_items.crow.numpy(), trie._node_items.col.numpy()
    items = node_items(trie, vocab)
    assert len(crow) == len(items) + 1 and crow[-1] == len(col)
    for node, members in items.items():
        assert col[crow[node] : crow[node + 1]].tolist() == sorted(members)
    assert ParallelTokenCharacterTrie(vocab, device="cpu")._node_items is None  # numpy path


def test_torch_path_reduces_large_batches_in_chunks(monkeypatch):
    # Maxima of a batch whose gathered weights exceed the bound are taken a few rows at
    # a time: here 2 rows per chunk, so a batch of 5 has a last chunk of one row.
    rng = np.random.default_rng(8)
    vocab = sorted({bytes(rng.integers(97, 100, size=rng.integers(1, 6))) for _ in range(150)})
    pairs = len(TorchPathTrie(vocab)._node_items.col)
    monkeypatch.setattr(trie_parallel, "_GATHER_BYTES", 2 * 8 * pairs)
    trie = TorchPathTrie(vocab)
    assert trie._node_items.rows_per_gather == 2
    ws = rng.normal(size=(5, len(vocab)))
    ws[1, ::3] = -np.inf
    items = node_items(trie, vocab)
    maxima = trie.batch_weight_max(ws)
    for row, weights in zip(maxima, ws, strict=True):
        np.testing.assert_array_equal(row, reduce_nodes(items, weights, "max"))
        np.testing.assert_array_equal(row, trie.weight_max(weights))


def test_torch_path_cuts_long_segments_into_pieces(monkeypatch):
    # A node's max is taken over pieces of at most `_PIECE` pairs, then over its pieces:
    # with pieces of 2 pairs, every node above the leaves has several.
    rng = np.random.default_rng(9)
    vocab = sorted({bytes(rng.integers(97, 100, size=rng.integers(1, 6))) for _ in range(150)})
    monkeypatch.setattr(trie_parallel, "_PIECE", 2)
    trie = TorchPathTrie(vocab)
    assert trie._node_items.nodes is not None
    ws = rng.normal(size=(3, len(vocab)))
    ws[2, 1::2] = -np.inf
    items = node_items(trie, vocab)
    for row, weights in zip(trie.batch_weight_max(ws), ws, strict=True):
        np.testing.assert_array_equal(row, reduce_nodes(items, weights, "max"))
        np.testing.assert_array_equal(trie.weight_max(weights), row)


def test_torch_path_operators_per_call_do_not_grow_with_depth():
    # On a GPU each operator is a kernel launch: the device path reduces a trie in a fixed
    # number of them, for 40 items of one byte (81 nodes) as for a chain of 80 items up to
    # 80 bytes long (161 nodes).
    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.operators = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.operators += 1
            return func(*args, **(kwargs or {}))

    def operators(vocab: list, method: str, rows: int | None) -> int:
        trie = TorchPathTrie(vocab)
        shape = (len(vocab),) if rows is None else (rows, len(vocab))
        weights = torch.rand(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        getattr(trie, method)(weights)
        with Count() as count:
            getattr(trie, method)(weights)
        return count.operators

    shallow = [bytes([b]) for b in range(97, 137)]
    deep = [b"a" * length for length in range(1, 81)]
    for method, rows in [("weight_sum", None), ("weight_max", None)] + [
        ("batch_weight_sum", 32),
        ("batch_weight_max", 32),
    ]:
        assert operators(deep, method, rows) == operators(shallow, method, rows), method


def test_parallel_devices():
    with pytest.raises(ValueError, match="device"):
        ParallelTokenCharacterTrie([b"a"], device="tpu")
    with pytest.raises(ValueError, match="device"):
        ParallelTokenCharacterTrie([b"a"], device=3.5)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            ParallelTokenCharacterTrie([b"a"], device="cuda")
        assert ParallelTokenCharacterTrie([b"a"]).device.type == "cpu"
    assert isinstance(ParallelTokenCharacterTrie([b"a"], device="cpu"), TokenCharacterTrie)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_parallel_cuda_matches_sequential(monkeypatch):
    vocab = [bytes([a, b]) for a in range(97, 110) for b in range(97, 110)] + [b""]
    ws = torch.randn(len(vocab), generator=torch.Generator().manual_seed(0))
    gpu = ParallelTokenCharacterTrie(vocab, device="cuda")
    cpu = TokenCharacterTrie(vocab)
    # Batches reach the host in blocks of two rows: a full block, then a part of one.
    monkeypatch.setattr(trie_parallel, "_STAGE_BYTES", 2 * 8 * len(cpu.children))
    np.testing.assert_array_equal(gpu.weight_max(ws.cuda()), cpu.weight_max(ws))
    np.testing.assert_allclose(gpu.weight_sum(ws.cuda()), cpu.weight_sum(ws), rtol=1e-12)
    batch = torch.randn((3, len(vocab)), generator=torch.Generator().manual_seed(1)).double()
    np.testing.assert_array_equal(gpu.batch_weight_max(batch.cuda()), cpu.batch_weight_max(batch))
    items = node_items(gpu, vocab)
    for row, weights in zip(gpu.batch_weight_sum(batch.cuda()), batch.numpy(), strict=True):
        assert_sums_close(row, reduce_nodes(items, weights, "sum"), weights)


def test_visualize():
    vocab = [b"a", b"ab", b"b\\", EndOfSequence((EOS_SYMBOL,))]
    trie = TokenCharacterTrie(vocab)
    # One weight per node, as weight_sum returns them: here 1000 + the node id.
    graph = trie.visualize(torch.arange(len(trie.children)) + 1000.0)
    assert isinstance(graph, graphviz.Digraph)
    source = graph.source
    for node in range(len(trie.children)):
        assert f"\t{node} [" in source and f"{1000 + node:.3g}" in source
    assert source.count("->") == len(trie.children) - 1
    masses = trie.weight_sum(np.array([0.5, 0.25, 0.25, 0.0]))
    assert f"\t{trie.root} [label=1 " in trie.visualize(masses).source  # the root's mass
    assert "0x5C" in source  # the backslash byte is shown escaped
    assert "'<eos>'" in source
    assert isinstance(trie.visualize(), graphviz.Digraph)
    for wrong in (np.ones(len(vocab)), np.ones(len(trie.children) + 1)):
        with pytest.raises(
            ValueError, match=f"one weight per trie node \\({len(trie.children)} nodes"
        ):
            trie.visualize(wrong)


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz `dot` is not installed")
def test_visualize_renders(tmp_path):
    trie = TokenCharacterTrie([b"a", b"ab", b"b"])
    masses = trie.weight_sum(np.array([0.5, 0.25, 0.25]))
    svg = trie.visualize(masses).pipe(format="svg").decode()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg


@settings(
    max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    st.lists(
        st.lists(st.sampled_from([0, 97, 98]), max_size=7).map(bytes),
        min_size=100,
        max_size=300,
        unique=True,
    ),
    st.integers(0, 2**32 - 1),
)
def test_random_large_vocabularies_match_brute_force(vocab, seed):
    # Large enough for groups of 64+ items, which the second level of the plan computes.
    ws = np.random.default_rng(seed).normal(size=len(vocab))
    for make in CLASSES:
        check_against_reference(make(vocab), vocab, ws)


@pytest.fixture(scope="module")
def gpt2_vocab(tokenizer_path):
    from transformers import AutoTokenizer

    from genlm.backend import decode_vocab

    return decode_vocab(AutoTokenizer.from_pretrained(tokenizer_path("gpt-2")))[0]


def test_real_vocabulary_matches_brute_force(gpt2_vocab):
    vocab = gpt2_vocab
    rng = np.random.default_rng(0)
    ws = np.log(rng.dirichlet(np.ones(len(vocab))))
    ws[rng.integers(0, len(vocab), size=100)] = -np.inf
    probs = np.exp(ws)
    tries = [make(vocab) for make in CLASSES]
    nodes = walk(tries[0])
    sample = [tries[0].root, *rng.choice(len(nodes), size=300, replace=False).tolist()]
    for trie in tries:
        assert walk(trie) == nodes  # same structure, same node ids
        sums, maxes = trie.weight_sum(probs), trie.weight_max(ws)
        for node in sample:
            path, leaf_item = nodes[node]
            prefix = bytes(path)
            if leaf_item is not None:
                members = [leaf_item]
            else:
                members = [i for i, token in enumerate(vocab) if token.startswith(prefix)]
            assert trie.node2prefix[node] == prefix
            assert maxes[node] == max(ws[members])
            # fsum is correctly rounded; a float64 sum of n <= 50257 terms in [0, 1] is
            # within n * 2**-52 of it.
            assert abs(sums[node] - math.fsum(probs[members])) <= len(members) * 2.0**-52


@pytest.mark.parametrize("name", ["llama-spm", "deepseek-coder"])
def test_tokens_sharing_bytes_each_get_a_leaf(name, tokenizer_path):
    """Real vocabularies where distinct ids share bytes: every id has its own leaf and mass."""
    from transformers import AutoTokenizer

    from genlm.backend import decode_vocab

    vocab, _ = decode_vocab(AutoTokenizer.from_pretrained(tokenizer_path(name)))
    counts = collections.Counter(bytes(token) for token in vocab)
    shared = [token for token in vocab if counts[bytes(token)] > 1]
    assert len(shared) >= 16  # the check below would be vacuous otherwise
    ws = np.random.default_rng(0).random(len(vocab))
    for trie in (TokenCharacterTrie(vocab), ParallelTokenCharacterTrie(vocab, device="cpu")):
        assert len(trie.leaf2word) == len(vocab)
        assert sorted(trie.word2leaf) == sorted((bytes(t), t.token_id) for t in vocab)
        sums = trie.weight_sum(ws)
        np.testing.assert_allclose(sums[trie.root], ws.sum(), rtol=1e-12)
        for token in shared[:16]:  # a shared byte string's node holds all its ids' mass
            node = trie.root
            for byte in bytes(token):
                node = trie.children[node][byte]
            below = sum(ws[t.token_id] for t in vocab if bytes(t).startswith(bytes(token)))
            np.testing.assert_allclose(sums[node], below, rtol=1e-12)
            assert sums[trie.word2leaf[(bytes(token), token.token_id)]] == ws[token.token_id]


@pytest.mark.parametrize(
    "make", [TokenCharacterTrie, lambda d: ParallelTokenCharacterTrie(d, "cpu")]
)
def test_results_belong_to_the_caller(make):
    vocab = [b"a", b"ab", b"b", b"ba", b"bb"]
    trie = make(vocab)
    ws = np.array([0.1, 0.2, 0.3, 0.25, 0.15])
    expected = _brute_force_sums(vocab, ws, trie)
    kept = trie.weight_sum(ws)
    kept_batch = trie.batch_weight_sum([ws, ws])
    kept.fill(-1.0)  # the caller changes what it got
    kept_batch[1].fill(-2.0)
    for _ in range(3):  # later calls neither reuse kept results nor see the changes
        again, batch = trie.weight_sum(ws), trie.batch_weight_sum([ws, ws])
        assert not np.shares_memory(again, kept) and not np.shares_memory(batch, kept_batch)
        np.testing.assert_allclose(again, expected, rtol=1e-12)
        np.testing.assert_allclose(batch, np.stack([expected, expected]), rtol=1e-12)
    assert (kept == -1.0).all() and (kept_batch[1] == -2.0).all()


def _brute_force_sums(vocab, ws, trie):
    """Per node: the sum of the weights of the items whose bytes start with its prefix."""
    sums = np.zeros(len(trie.children))
    for node in range(len(trie.children)):
        prefix = trie.node2prefix[node]
        if node in trie.leaf2word:
            sums[node] = ws[vocab.index(trie.leaf2word[node])]
        else:
            sums[node] = sum(
                w for item, w in zip(vocab, ws, strict=True) if item.startswith(bytes(prefix))
            )
    return sums
