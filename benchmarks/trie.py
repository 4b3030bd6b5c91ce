"""The tries on the qwen2 vocabulary, and their device path on CUDA (`--device cuda`).
Floor: an insertion-built dict trie reduced depth by depth, checked against both tries."""

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
from genlm.backend.tokenization import decode_vocab

OPTIONS = {"repeats": 15, "threads": 0, "device": ("cpu", "cuda: the device path on CUDA only")}
BATCH = 32
CLASSES = TokenCharacterTrie, partial(ParallelTokenCharacterTrie, device="cpu")  # on the CPU
FIGURES = {  # name (page row `trie/name`) -> label, target, further figures in the notes
    "build": ("build (both classes)", "≤ 2,000 ms", ("nodes", "memory")),
    "weight_sum": ("`weight_sum`, one row", "≤ 3 ms", ()),
    "weight_max": ("`weight_max`, one row", "≤ 6 ms", ()),
    "batch_weight_sum": (f"`batch_weight_sum`, {BATCH} rows", "≤ 40 ms", ("results kept, ms",)),
    "batch_weight_max": (f"`batch_weight_max`, {BATCH} rows", "≤ 120 ms", ()),
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

    def reduce(self, ws: np.ndarray, op: str) -> np.ndarray:
        """Every node's sum (`np.add.at`) or maximum (`np.maximum.at`) of its items' `ws`."""
        at, empty = (np.add.at, 0.0) if op == "sum" else (np.maximum.at, -np.inf)
        values = np.full(len(self.children), empty)
        values[self.leaf_of_item] = ws
        for nodes, parents in self.levels:
            at(values, parents, values[nodes])
        return values


def check(trie: Any, reference: ReferenceTrie, ws: np.ndarray) -> None:
    """Assert that `trie` agrees with the floor on every node for one row of weights."""
    nodes, stack = np.zeros(len(trie.children), dtype=np.int64), [(0, 0)]  # -> floor's node
    while stack:  # both tries walked together, edge key by edge key
        node, floor_node = stack.pop()
        nodes[node], edges = floor_node, reference.children[floor_node]
        stack += [(child, edges[key]) for key, child in trie.children[node].items()]
    sums, maxima = (reference.reduce(ws, op)[nodes] for op in ("sum", "max"))
    assert np.array_equal(trie.weight_max(ws), maxima), "weight_max disagrees"
    assert np.allclose(trie.weight_sum(ws), sums, rtol=1e-9, atol=1e-12), "weight_sum disagrees"


def time_class(make: Any, probs: Any, logprobs: Any, repeats: int, extras: bool = True) -> dict:
    """Wall and CPU ms of a class's figures; `extras`: kept results, awaits, memory."""
    trie, batches = make(), {"sum": probs, "max": logprobs}
    batched = {op: partial(getattr(trie, f"batch_weight_{op}"), batches[op]) for op in batches}
    figures = {"build": median_ms(make, 3), "nodes": len(trie.children)}
    figures["weight_sum"] = median_ms(lambda: trie.weight_sum(probs[0]), repeats, True)
    figures["weight_max"] = median_ms(lambda: trie.weight_max(logprobs[0]), repeats, True)
    for op, call in batched.items():  # a caller that drops each result, as a sampler
        figures[f"batch_weight_{op}"] = median_ms(call, repeats if extras else 5, True)
    if not extras:
        return figures
    kept = []  # a caller that keeps every result: each call writes fresh memory
    figures["results kept, ms"] = median_ms(lambda: kept.append(batched["sum"]()), 5, True)[0]
    kept.clear()
    async_trie, loop = AsyncTokenCharacterTrie(trie), asyncio.new_event_loop()

    async def awaits(op: str) -> None:  # one await per row, all at once
        await asyncio.gather(*map(getattr(async_trie, f"weight_{op}"), batches[op]))

    for op in batches:  # in pairs: a shared machine's load drifts between series by > 1.2x
        calls = batched[op], partial(lambda op: loop.run_until_complete(awaits(op)), op)
        pairs = [[median_ms(call, 1)[0] for call in calls] for _ in range(repeats)]
        figures[f"async_{op}"] = [median(column) for column in zip(*pairs, strict=True)]
        figures[f"async_{op}_ratio"] = median(awaited / direct for direct, awaited in pairs)
    loop.close()
    async_trie.shutdown()
    gc.collect()  # memory: MiB a build allocates that the trie still holds (numpy's included)
    tracemalloc.start()
    _built = make()  # held while traced
    gc.collect()
    figures["memory"] = tracemalloc.get_traced_memory()[0] / 2**20
    tracemalloc.stop()
    return figures


def weights(tokenizer: str) -> tuple[list, torch.Tensor, torch.Tensor]:
    """Each version's `decode_vocab` of a tokenizer, and seeded probabilities over it."""
    from transformers import AutoTokenizer

    vocab, _ = decode_vocab(AutoTokenizer.from_pretrained(tokenizer))
    logits = np.random.default_rng(0).normal(size=(BATCH, len(vocab))).astype(np.float32)
    logprobs = torch.log_softmax(torch.from_numpy(logits), dim=-1)
    return vocab, logprobs.exp(), logprobs


def device_figures(vocab: list, probs: torch.Tensor, logprobs: torch.Tensor, args: Any) -> None:
    """The device path of `ParallelTokenCharacterTrie` against the numpy path; records."""
    numpy_make = partial(TokenCharacterTrie, vocab)
    makes = numpy_make, partial(ParallelTokenCharacterTrie, vocab, args.device)
    numpy_build, build = (median_ms(make, 3)[0] / 1e3 for make in makes)
    numpy_trie, torch_trie = (make() for make in makes)
    rows = {"sum": (probs, probs.to(args.device)), "max": (logprobs, logprobs.to(args.device))}
    for op, agree in (("max", np.array_equal), ("sum", partial(np.allclose, rtol=1e-12))):
        expected = getattr(numpy_trie, f"batch_weight_{op}")(rows[op][0][:2])
        assert agree(getattr(torch_trie, f"batch_weight_{op}")(rows[op][1][:2]), expected)
    notes = {"numpy path s": numpy_build}
    record(Figure("gpu/trie_build", "trie build, qwen2", "s", build, notes=notes))
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
            ops.append(counter.dispatched)
        notes = {"numpy path ms": tuple(numpy_ms), "operators per call": ops}
        record(Figure(f"gpu/trie_{kind}", f"trie {label}", "ms", tuple(ours), notes=notes))


def run(args: argparse.Namespace) -> None:
    """Time both classes against the floor on the CPU, or only the device path on `--device`."""
    from genlm.backend import assets

    set_threads(args.threads)
    vocab, probs, logprobs = weights(str(assets.tokenizer("qwen2")))
    if args.device != "cpu":
        return device_figures(vocab, probs, logprobs, args)
    reference = ReferenceTrie(vocab)
    floor = dict.fromkeys(FIGURES) | {"build": median_ms(lambda: ReferenceTrie(vocab), 1)[0]}
    for op, rows in (("sum", probs), ("max", logprobs)):
        floor[f"weight_{op}"] = median_ms(partial(reference.reduce, rows[0].numpy(), op), 3)[0]
    for make in CLASSES:
        check(make(vocab), reference, logprobs[1].numpy().astype(np.float64))
    timings = [time_class(partial(make, vocab), probs, logprobs, args.repeats) for make in CLASSES]
    for name, (label, target, further) in FIGURES.items():
        ours, cpu = zip(*(timing[name] for timing in timings), strict=True)
        notes = {"CPU ms": cpu} | {key: tuple(timing[key] for timing in timings) for key in further}
        record(Figure(f"trie/{name}", label, "ms", ours, floor[name], target=target, notes=notes))
    direct, awaits = zip(timings[0]["async_sum"], timings[0]["async_max"], strict=True)
    ratios = tuple(timing[f"async_{op}_ratio"] for timing in timings for op in ("sum", "max"))
    label = f"{BATCH} concurrent awaits on `AsyncTokenCharacterTrie` (sum / max)"
    notes, target = {"paired ratios, each class": ratios}, "≤ 1.2× the call"
    record(Figure("trie/async", label, "ms", awaits, direct, target=target, notes=notes))
