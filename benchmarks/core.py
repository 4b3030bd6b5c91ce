"""The suite's shared parts: the figure record, timing, alternation, child processes, 0.3.1.
Nothing here imports torch, so that the memory benchmark's parent process stays small."""

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RELEASED = Path.home() / ".cache" / "genlm-backend" / "released-0.3.1"
RESULT = "RESULT "  # prefix of the line on which a child prints its result
COLUMNS = {"ours": "this project", "floor": "floor", "ratio_floor": "÷ floor"}
COLUMNS |= {"released": "0.3.1", "ratio_released": "÷ 0.3.1"}
Value = float | tuple[float, ...]


@dataclass
class Figure:
    """One measured figure: the row `id` (`group/row`) of the performance page's table."""

    id: str
    workload: str
    unit: str  # of the four values; `+ms` prints `ours` less `floor`, `%` has no ratio
    ours: Value  # a tuple for alternatives `a / b`, as may be the other three
    floor: Value | None = None  # timed in the same process
    released: Value | None = None  # 0.3.1's
    released_floor: Value | None = None  # 0.3.1's own process's floor
    target: str = ""
    notes: dict[str, Any] = field(default_factory=dict)  # further figures, not in the table
    released_only: bool = False  # refreshes only the row's 0.3.1 cells


FIGURES: list[Figure] = []  # what this process recorded, written out by `--json`


def number(value: float, unit: str = "") -> str:
    """Three significant digits, thousands separated; operation counts as integers."""
    if unit == "ops" or value == 0 or not math.isfinite(value):
        return f"{value:,.0f}"
    if abs(value) < 1e-3:
        return f"{value:.1e}"
    return f"{value:,.{max(0, 2 - math.floor(math.log10(abs(value))))}f}"


def alternatives(value: Any) -> tuple:
    """A value's alternatives: itself alone unless it is a tuple or a list."""
    return tuple(value) if isinstance(value, tuple | list) else (value,)


def ratio(a: Value | None, b: Value | None) -> str | None:
    """`a / b` as a ratio cell, alternative by alternative; None when either is missing."""
    if a is None or b is None:
        return None
    a, b = alternatives(a), alternatives(b)
    a, b = (a * len(b) if len(a) == 1 else a), (b * len(a) if len(b) == 1 else b)
    cells = []
    for x in (x / y for x, y in zip(a, b, strict=True)):
        digits = 2 if 0.1 <= x < 10 else 1 if x < 100 else 0
        cells.append(f"{x:.{digits if x >= 0.1 else 1 - math.floor(math.log10(x))}f}")
    return " / ".join(cells)


def amount(value: Value, unit: str, sign: str = "") -> str:
    """A figure with its unit; alternatives as `a / b unit`."""
    text = " / ".join(f"{sign * (v >= 0)}{number(v, unit)}" for v in alternatives(value))
    return text + ("%" if unit == "%" else f" {unit}")


def cells(f: Figure) -> dict[str, str]:
    """The figure's cells of the page's table (ratios without their `×`)."""
    unit, plus = f.unit.lstrip("+"), f.unit.startswith("+")  # `+`: scalars only
    ours = amount(f.ours - f.floor, unit, "+") if plus else amount(f.ours, unit)
    row = {"workload": f.workload, "ours": ours}
    if f.released is not None:
        row["released"] = amount(f.released, unit)
    if f.floor is not None:
        floors = f.floor if f.released_floor is None else (f.floor, f.released_floor)
        row["floor"] = amount(floors, unit)
    row["ratio_floor"] = None if unit == "%" else ratio(f.ours, f.floor)
    row["released_floor"] = ratio(f.released, f.released_floor or f.floor)
    row["ratio_released"] = ratio(f.ours, f.released)
    return {key: value for key, value in row.items() if value is not None}


def note(value: Any) -> str:
    """A note's value as printed."""
    if isinstance(value, tuple | list):
        return " / ".join(map(note, value))
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return number(value) if isinstance(value, float) else str(value)


def record(figure: Figure) -> None:
    """Keep `figure` for `--json`, and print it as a line of the suite's table."""
    if not FIGURES:
        print(f"{'figure':<56}" + "".join(f"{t:>18}" for t in COLUMNS.values()) + "  notes")
    FIGURES.append(figure)
    row = cells(figure)
    notes = [figure.target] * bool(figure.target)
    notes += [f"{key} {note(value)}" for key, value in figure.notes.items()]
    line = "".join(f"{row.get(key, '—'):>18}" for key in COLUMNS)
    print(f"{figure.workload[:55]:<56}{line}  {'; '.join(notes)}", flush=True)


def timed(function: Callable[..., Any], *args: Any) -> tuple[float, float, Any]:
    """Wall and process CPU seconds of `function(*args)`, and its result."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = function(*args)
    return time.perf_counter() - wall, time.process_time() - cpu, result


def median_ms(function: Callable[[], Any], repeats: int, warm_up: bool = False) -> tuple:
    """Median wall and CPU milliseconds of `repeats` calls, each result dropped at once."""
    if warm_up:
        function()
    return tuple(1e3 * m for m in medians([timed(function)[:2] for _ in range(repeats)]))


def alternate(runs: dict[str, Callable[[], Any]], repeats: int, first: int = 0) -> dict:
    """Each run `repeats` times, one after another, starting one later every repeat."""
    names, results = list(runs), {name: [] for name in runs}
    for repeat in range(first, first + repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            results[name].append(runs[name]())
    return results


def medians(results: list[Any]) -> Any:
    """Leaf by leaf: the median of numbers; a value every result shares, or all of them."""
    first = results[0]
    if isinstance(first, dict):
        return {key: medians([result[key] for result in results]) for key in first}
    if isinstance(first, list | tuple):
        return [medians(list(column)) for column in zip(*results, strict=True)]
    if isinstance(first, int | float):
        return median(results)
    return first if len(set(results)) == 1 else results


def compare(runs: dict[str, Callable[[], Any]], repeats: int, warm_up: bool = False) -> dict:
    """Each run's `medians` over `repeats` alternated rounds (after an untimed one: `warm_up`)."""
    for run in runs.values() if warm_up else ():
        run()
    return {name: medians(results) for name, results in alternate(runs, repeats).items()}


def in_child(
    target: str,
    released: Path | None = None,
    env: dict | None = None,
    timeout: float | None = None,
    **kwargs: Any,
) -> Any:
    """`module:function(**kwargs)`'s JSON result, run in a fresh process with `env` set and
    `genlm.backend` imported from `released` (0.3.1's folder) or this checkout (checked);
    `subprocess.TimeoutExpired` after `timeout` seconds."""
    paths = [str(released or ""), str(ROOT), os.environ.get("PYTHONPATH", "")]
    environ = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), **(env or {})}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    command = [sys.executable, "-m", "benchmarks", "child", target, json.dumps(kwargs)]
    with tempfile.TemporaryDirectory() as cwd:  # not the checkout: it would shadow 0.3.1
        done = subprocess.run(
            command, env=environ, cwd=cwd, capture_output=True, text=True, timeout=timeout
        )
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{target} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(lines[-1][len(RESULT) :])
    if result["module"] and (released or ROOT) not in Path(result["module"]).resolve().parents:
        raise RuntimeError(f"{target} imported genlm.backend from {result['module']}")
    return result["value"]


def released_folder(folder: str | None = None) -> Path:
    """A folder holding genlm-backend 0.3.1 alone, installed there first if it is not."""
    folder = Path(folder or RELEASED).resolve()
    if not (folder / "genlm" / "backend").is_dir():
        print(f"installing genlm-backend 0.3.1 into {folder}", flush=True)
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(folder)]
        subprocess.run([*pip, "genlm-backend==0.3.1"], check=True)
    return folder


def set_threads(threads: int | None) -> None:
    """Set torch's intra-op threads (0 or None: leave torch's default)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
