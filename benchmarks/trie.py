"""The token-character tries on the qwen2 vocabulary (151,936 tokens) against a dict trie.

Both classes on the CPU: build, one row's sums and maxima, batches of 32, 32 awaits on
`AsyncTokenCharacterTrie` against one batched call, memory. Floor: an insertion-built
dict trie reduced depth by depth with `np.add.at` / `np.maximum.at`, checked against
both tries. `--device cuda`: the device path there (`--device-path`: forced on the CPU).
"""

import argparse
import asyncio
import gc
import tracemalloc
from functools import partial
from statistics import median
from typing import Any

import numpy as np
import torch

from benchmarks.core import Figure, median_ms, record, set_threads
from benchmarks.workload import OpCounter
from genlm.backend import AsyncTokenCharacterTrie, ParallelTokenCharacterTrie, TokenCharacterTrie

OPTIONS = {"repeats": 15, "threads": 0}
OPTIONS["device"] = ("cpu", "cuda: the device path on CUDA only")
OPTIONS["device_path"] = (False, "add the device path on the CPU")

BATCH = 32
FIGURES = {  # name -> page row id, label, target
    "build": ("build", "build (both classes)", "≤ 2,000 ms"),
    "weight_sum": ("weight_sum", "`weight_sum`, one row", "≤ 3 ms"),
    "weight_max": ("weight_max", "`weight_max`, one row", "≤ 6 ms"),
    "batch_sum": ("batch_weight_sum", f"`batch_weight_sum`, {BATCH} rows", "≤ 40 ms"),
    "batch_max": ("batch_weight_max", f"`batch_weight_max`, {BATCH} rows", "≤ 120 ms"),
}


class ReferenceTrie:
    """The floor: an insertion-built dict trie, reduced depth by depth."""

    def __init__(self, vocab: list):
        children, parent, depth = [{}], [-1], [0]
        self.leaf_of_item = np.empty(len(vocab), dtype=np.int64)
        for i, item in enumerate(vocab):
            node = 0
            for key in [*item, (None, i)]:  # the symbols, then the item's leaf
                if (child := children[node].get(key)) is None:
                    child = children[node][key] = len(children)
                    children.append({})
                    parent.append(node)
                    depth.append(depth[node] + 1)
                node = child
            self.leaf_of_item[i] = node
        self.children, parent, depth = children, np.array(parent), np.array(depth)
        order = np.argsort(-depth, kind="stable")[:-1]  # deepest first, root excluded
        bounds = np.flatnonzero(np.diff(depth[order])) + 1
        self.levels = [(nodes, parent[nodes]) for nodes in np.split(order, bounds)]

    def reduce(self, ws: np.ndarray, at: Any, empty: float) -> np.ndarray:
        """Every node's sum (`np.add.at`) or maximum (`np.maximum.at`) of its items' `ws`."""
        values = np.full(len(self.children), empty)
        values[self.leaf_of_item] = ws
        for nodes, parents in self.levels:
            at(values, parents, values[nodes])
        return values


def node_paths(children: list[dict]) -> list[tuple]:
    """The edge keys on the path to every node, by node id (to match two tries' nodes)."""
    paths, stack = [()] * len(children), [0]
    while stack:
        node = stack.pop()
        for key, child in children[node].items():
            paths[child] = (*paths[node], key)
            stack.append(child)
    return paths


def check(trie: Any, reference: ReferenceTrie, ws: np.ndarray) -> None:
    """Assert that `trie` agrees with the floor on one row of weights."""
    index = {path: node for node, path in enumerate(node_paths(reference.children))}
    nodes = np.array([index[path] for path in node_paths(trie.children)])
    expected = reference.reduce(ws, np.maximum.at, -np.inf)[nodes]
    assert np.array_equal(trie.weight_max(ws), expected), "weight_max disagrees"
    expected = reference.reduce(ws, np.add.at, 0.0)[nodes]
    assert np.allclose(trie.weight_sum(ws), expected, rtol=1e-9, atol=1e-12), "weight_sum"


def structure_mib(make: Any) -> float:
    """MiB allocated by a build and still held by the trie (Python objects and numpy)."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    trie = make()
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    node_items = getattr(trie, "_node_items", None)
    return (held + (0 if node_items is None else node_items.nbytes())) / 2**20


def time_class(make: Any, probs: Any, logprobs: Any, repeats: int, extras: bool = True) -> dict:
    """Wall and CPU ms of a class's figures; `extras`: kept results, awaits, memory."""
    trie = make()
    batched = {"sum": partial(trie.batch_weight_sum, probs)}
    batched["max"] = partial(trie.batch_weight_max, logprobs)
    figures = {"build": median_ms(make, 3), "nodes": len(trie.children)}
    figures["weight_sum"] = median_ms(lambda: trie.weight_sum(probs[0]), repeats, True)
    figures["weight_max"] = median_ms(lambda: trie.weight_max(logprobs[0]), repeats, True)
    for name, call in batched.items():  # a caller that drops each result, as a sampler
        figures[f"batch_{name}"] = median_ms(call, repeats if extras else 5, True)
    if not extras:
        return figures
    kept = []  # a caller that keeps every result: each call writes fresh memory
    figures["kept"] = median_ms(lambda: kept.append(trie.batch_weight_sum(probs)), 5, True)
    kept.clear()
    async_trie, loop = AsyncTokenCharacterTrie(trie), asyncio.new_event_loop()
    for name, batch in (("sum", probs), ("max", logprobs)):
        method = getattr(async_trie, f"weight_{name}")

        def awaits(method: Any = method, batch: Any = batch) -> None:
            async def gathered() -> None:
                await asyncio.gather(*(method(row) for row in batch))

            loop.run_until_complete(gathered())

        # In pairs: the load of a shared machine drifts between series by more than 1.2x.
        pairs = [(median_ms(batched[name], 1), median_ms(awaits, 1)) for _ in range(repeats)]
        figures[f"async_{name}"] = [median(pair[i][0] for pair in pairs) for i in (0, 1)]
        figures[f"async_{name}_ratio"] = median(pair[1][0] / pair[0][0] for pair in pairs)
    loop.close()
    async_trie.shutdown()
    figures["memory"] = structure_mib(make)
    return figures


def weights(tokenizer: str) -> tuple[list, torch.Tensor, torch.Tensor]:
    """Each version's `decode_vocab` of a tokenizer, and seeded probabilities over it."""
    from transformers import AutoTokenizer

    from genlm.backend import decode_vocab

    vocab, _ = decode_vocab(AutoTokenizer.from_pretrained(tokenizer))
    rng = np.random.default_rng(0)
    logits = torch.from_numpy(rng.normal(size=(BATCH, len(vocab))).astype(np.float32))
    logprobs = torch.log_softmax(logits, dim=-1)
    return vocab, logprobs.exp(), logprobs


def classes(vocab: list) -> list[Any]:
    """Builders of both classes on the CPU."""
    return [partial(TokenCharacterTrie, vocab), partial(ParallelTokenCharacterTrie, vocab, "cpu")]


def cpu_figures(vocab: list, probs: torch.Tensor, logprobs: torch.Tensor, repeats: int) -> None:
    """Time both classes and the floor on the CPU; record the figures."""
    reference = ReferenceTrie(vocab)
    floor = {"build": median_ms(lambda: ReferenceTrie(vocab), 1)[0]}
    sums = partial(reference.reduce, probs[0].numpy(), np.add.at, 0.0)
    maxes = partial(reference.reduce, logprobs[0].numpy(), np.maximum.at, -np.inf)
    floor["weight_sum"], floor["weight_max"] = (median_ms(f, 3)[0] for f in (sums, maxes))
    for make in classes(vocab):
        check(make(), reference, logprobs[1].numpy().astype(np.float64))
    runs = [time_class(make, probs, logprobs, repeats) for make in classes(vocab)]
    for name, (row_id, label, target) in FIGURES.items():
        ours = tuple(run[name][0] for run in runs)
        notes = {"CPU ms": tuple(run[name][1] for run in runs)}
        if name == "build":
            notes |= {key: tuple(run[key] for run in runs) for key in ("nodes", "memory")}
        if name == "batch_sum":
            notes["results kept, ms"] = tuple(run["kept"][0] for run in runs)
        floor_ms = floor.get(name)
        record(Figure(f"trie/{row_id}", label, "ms", ours, floor_ms, target=target, notes=notes))
    direct, awaits = zip(runs[0]["async_sum"], runs[0]["async_max"], strict=True)
    ratios = tuple(run[f"async_{op}_ratio"] for run in runs for op in ("sum", "max"))
    label = f"{BATCH} concurrent awaits on `AsyncTokenCharacterTrie` (sum / max)"
    notes, target = {"paired ratios, each class": ratios}, "≤ 1.2× the call"
    record(Figure("trie/async", label, "ms", awaits, direct, target=target, notes=notes))


class TorchPathTrie(ParallelTokenCharacterTrie):
    """`ParallelTokenCharacterTrie` with its device path forced onto the CPU."""

    def _on_cpu(self) -> bool:
        return False


def device_figures(vocab: list, probs: torch.Tensor, logprobs: torch.Tensor, args: Any) -> None:
    """The device path of `ParallelTokenCharacterTrie` against the numpy path; records."""
    device = args.device
    make = TorchPathTrie if device == "cpu" else ParallelTokenCharacterTrie
    numpy_build = median_ms(lambda: TokenCharacterTrie(vocab), 3)[0] / 1e3
    build = median_ms(lambda: make(vocab, device=device), 3)[0] / 1e3
    numpy_trie, torch_trie = TokenCharacterTrie(vocab), make(vocab, device=device)
    rows = {"sum": (probs, probs.to(device)), "max": (logprobs, logprobs.to(device))}
    expected = numpy_trie.batch_weight_max(logprobs[:2])
    assert np.array_equal(torch_trie.batch_weight_max(rows["max"][1][:2]), expected)
    expected = numpy_trie.batch_weight_sum(probs[:2])
    assert np.allclose(torch_trie.batch_weight_sum(rows["sum"][1][:2]), expected, rtol=1e-12)
    group, title = ("gpu", "trie") if device != "cpu" else ("trie", "device path on the CPU:")
    notes = {"numpy path s": numpy_build}
    record(Figure(f"{group}/trie_build", f"{title} build, qwen2", "s", build, notes=notes))
    for kind, prefix, pick, count, label in (
        ("single", "", 0, args.repeats, "`weight_sum` / `weight_max`, qwen2, one row"),
        ("batch", "batch_", slice(None), 5, f"batch of {BATCH}, qwen2: sum / max"),
    ):
        ours, numpy_ms, ops = [], [], []
        for op, (cpu_rows, device_rows) in rows.items():
            on_numpy = partial(getattr(numpy_trie, f"{prefix}weight_{op}"), cpu_rows[pick])
            on_device = partial(getattr(torch_trie, f"{prefix}weight_{op}"), device_rows[pick])
            numpy_ms.append(median_ms(on_numpy, count, True)[0])
            ours.append(median_ms(on_device, count, True)[0])
            with OpCounter() as counter:  # after the warm-up calls above
                on_device()
            ops.append(counter.counts.total())
        notes = {"numpy path ms": tuple(numpy_ms), "operators per call": ops}
        record(Figure(f"{group}/trie_{kind}", f"{title} {label}", "ms", tuple(ours), notes=notes))


def run(args: argparse.Namespace) -> None:
    """Run the CPU benchmark, or the device path on `args.device`."""
    from genlm.backend import assets

    set_threads(args.threads)
    vocab, probs, logprobs = weights(str(assets.tokenizer("qwen2")))
    if args.device == "cpu":
        cpu_figures(vocab, probs, logprobs, args.repeats)
    if args.device != "cpu" or args.device_path:
        device_figures(vocab, probs, logprobs, args)
