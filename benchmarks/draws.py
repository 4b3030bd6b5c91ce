"""One token drawn per particle from an SMC step's N rows (SmolLM2, 49,152 columns): the cohort of
`genlm.backend.draw` (N concurrent `draw_from` asks, reduced together) against N per-row draws,
numpy's (the floor: the quickest per-row draw here) and torch's `multinomial(softmax(row))`.
Operations counted with the launch benchmark's counter; host reads of tensor values counted
by wrapping torch's reading methods (on a GPU each is a sync)."""

import argparse
import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from benchmarks import workload
from benchmarks.core import Figure, compare, record, set_threads

OPTIONS = {"n": (32, "particles"), "repeats": 15, "device": ("cpu", "cpu, or cuda"), "threads": 0}
OPTIONS["rows"] = (["smollm2", "random"], "SmolLM2's rows, or log-softmax of N(0, 3²) logits")
WIDTH = 49152  # SmolLM2's vocabulary


def step_rows(n: int, device: str, kind: str) -> torch.Tensor:
    """SmolLM2's rows after `n` random continuations of a prompt (one batched call), or as many
    random rows of its width (where the model is not at hand, e.g. a GPU machine offline)."""
    from genlm.backend import assets

    if kind == "random":
        generator = torch.Generator().manual_seed(0)
        return torch.log_softmax(3 * torch.randn(n, WIDTH, generator=generator), -1).to(device)

    _, lm = workload.transformer(assets.smollm2(fetch=False), threads=None)
    generator = torch.Generator().manual_seed(0)
    prompt = lm.tokenizer.encode("The history of the city begins")
    contexts = [
        prompt + torch.randint(0, WIDTH, (3,), generator=generator).tolist() for _ in range(n)
    ]
    return lm.batch_next_token_logprobs_sync(contexts).to(device)


def cohort(rows: list[torch.Tensor]) -> Callable[[], list]:
    from genlm.backend.draw import draw_from

    async def ask() -> list:
        return list(await asyncio.gather(*(draw_from(row) for row in rows)))

    return lambda: asyncio.run(ask())


def per_row_torch(rows: list[torch.Tensor]) -> Callable[[], list]:
    return lambda: [int(torch.multinomial(torch.softmax(row, -1), 1)) for row in rows]


def per_row_numpy(rows: list[torch.Tensor]) -> Callable[[], list]:
    generator = np.random.default_rng(0)

    def draw() -> list:
        picked = []
        for row in rows:
            weights = row.cpu().numpy().astype(np.float64)
            probs = np.exp(weights - weights.max())
            picked.append(int(generator.choice(len(probs), p=probs / probs.sum())))
        return picked

    return draw


HOST_READS = ("tolist", "item", "numpy", "__int__", "__float__", "__index__")


def counted(run: Callable[[], Any]) -> tuple[int, int]:
    """Operations reaching a kernel, and reads of tensor values by the host (each a sync on a
    GPU: `tolist`, `item`, `numpy`, `int(...)`, ...), in one call of `run`."""
    reads = [0]
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counting(original: Callable) -> Callable:
        def read(*args: Any, **kwargs: Any) -> Any:
            reads[0] += 1
            return original(*args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(original))
    try:
        with workload.OpCounter() as counter:
            run()
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return counter.read()[0], reads[0]


def with_picker(name: str | None, draw: Callable[[], list]) -> Callable[[], list]:
    """`draw` run with the picker `name` (`None`: the device's default)."""
    from genlm.backend.draw import set_draw_method

    def run() -> list:
        set_draw_method(name)
        try:
            return draw()
        finally:
            set_draw_method(None)

    return run


def wall_seconds(function: Callable[[], Any]) -> Callable[[], float]:
    """`function`'s wall seconds, the device synchronised before and after."""

    def timed() -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        function()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - start

    return timed


def run(args: argparse.Namespace) -> None:
    """Time and count the cohort under each picker, and the per-row draws."""
    from genlm.backend.draw import DRAW_METHODS, draw_method

    set_threads(args.threads)
    rows = list(step_rows(args.n, args.device, args.rows))
    draws = cohort(rows)
    runs = {name: with_picker(name, draws) for name in DRAW_METHODS}
    runs["default"] = with_picker(None, draws)
    runs["per-row numpy"], runs["per-row torch"] = per_row_numpy(rows), per_row_torch(rows)
    seconds = compare({name: wall_seconds(f) for name, f in runs.items()}, args.repeats, True)
    ms = {name: 1e3 * value for name, value in seconds.items()}
    operations, syncs = counted(runs["default"])
    torch_operations, torch_syncs = counted(runs["per-row torch"])
    notes = {
        "default picker": draw_method(rows[0].device),
        **{f"{name} ms": ms[name] for name in DRAW_METHODS},
        "per-row torch ms": ms["per-row torch"],
        "÷ per-row torch": ms["default"] / ms["per-row torch"],
        "host reads": syncs,
        "per-row torch host reads": torch_syncs,
        "operations": operations,
        "per-row torch operations": torch_operations,
    }
    label = f"{args.n} draws in one cohort, {args.rows} rows ({args.device})"
    target = "≤ 0.5× per-row torch; ≤ 1× per-row numpy"
    figure_id = f"draws/{args.rows}_{args.device}"
    figure = Figure(figure_id, label, "ms", ms["default"], ms["per-row numpy"])
    figure.target, figure.notes = target, notes
    record(figure)
