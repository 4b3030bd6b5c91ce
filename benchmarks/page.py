"""Redraw the performance page's first table and picture from docs/performance.json, which
holds the table cell for cell by groups of rows (a refreshed row: its id and provenance)."""

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

from benchmarks.core import ROOT, Figure, cells

OPTIONS = {"check": (False, "compare only, write nothing")}
OPTIONS["merge"] = (None, "comma-separated `--json` files (made elsewhere) to merge first")
OPTIONS["measured"] = (None, "with --merge: where they ran (a GPU's name; the date is today's)")
DATA = ROOT / "docs" / "performance.json"
PAGE = ROOT / "docs" / "performance.md"
IMAGE = ROOT / "docs" / "images" / "performance.png"
BEGIN = "<!-- performance-table: begin (written by `python -m benchmarks page`) -->"
END = "<!-- performance-table: end -->"
RATIOS = ("ratio_floor", "released_floor", "ratio_released")
RELEASED_CELLS = ("released", "released_floor", "ratio_released")


def cell(row: dict, key: str) -> str:
    """One cell of a row as printed (ratios with `×` after each alternative)."""
    if key in RATIOS:
        return "—" if row.get(key) is None else " / ".join(f"{a}×" for a in row[key].split(" / "))
    return row.get(key, "") if key == "measured" else row.get(key) or "—"


def table(data: dict) -> str:
    """The page's first table, in Markdown (groups without rows are left out)."""
    columns = data["columns"]  # cell name -> header, in the table's order
    lines = [list(columns.values()), ["---"] * len(columns)]
    for group in (group for group in data["groups"] if group["rows"]):
        header = {"workload": f"**{group['name']}**", "measured": group.get("measured", "")}
        header["floor"] = f"*{group['floor']}*" if group.get("floor") else ""
        lines.append([header.get(key, "") for key in columns])
        lines += [[cell(row, key) for key in columns] for row in group["rows"]]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def page_with_table(page: str, text: str) -> str:
    """`page` with `text` between its table markers."""
    start, end = page.index(BEGIN) + len(BEGIN), page.index(END)
    return page[:start] + "\n" + text + "\n" + page[end:]


def merge(data: dict, figures: list[dict], stamp: dict) -> None:
    """Put `figures` (`Figure` records) into `data`'s rows by id, stamped, each replacing its row
    (or joining its group), keeping its 0.3.1 cells if it has none; `released_only`: those alone."""
    groups = {group["id"]: group for group in data["groups"]}
    for figure in (Figure(**figure) for figure in figures):
        rows = groups[figure.id.split("/")[0]]["rows"]
        index = next((i for i, row in enumerate(rows) if row.get("id") == figure.id), len(rows))
        old = rows[index] if index < len(rows) else {}
        new = {"id": figure.id, **cells(figure), "notes": figure.notes}
        provenance = dict(old.get("provenance", {}))
        theirs = {key: value for key, value in new.items() if key in RELEASED_CELLS}
        if figure.released_only:
            row = {key: value for key, value in old.items() if key not in RELEASED_CELLS}
            row = {"id": new["id"], "workload": new["workload"], **row, **theirs}
            row["released notes"] = new["notes"]
            provenance["released"] = stamp
        else:
            row, provenance["ours"] = new, stamp
            if theirs:
                provenance["released"] = stamp
            elif "released" in old and "released" in provenance:
                row |= {key: old[key] for key in RELEASED_CELLS if key in old}
            else:
                provenance.pop("released", None)
        ours, theirs = provenance.get("ours"), provenance.get("released")
        row["measured"] = (ours or theirs)["measured"]
        if ours and theirs and ours != theirs:
            row["measured"] += f"; 0.3.1: {theirs['measured']}"
        row["provenance"] = provenance
        rows[index : index + 1] = [row]  # the old row replaced, or a new one appended


def draw(data: dict, image: Path = IMAGE) -> None:
    """Draw every ratio of the table on a log scale into `image`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries, y = [], 0.0  # (y, label, group, row)
    for group in data["groups"]:
        rows = [row for row in group["rows"] if any(row.get(key) for key in RATIOS)]
        for row in rows:  # named by its group's short name, its workload, its machine
            workload = re.sub(r"\s*\([^()]*\)$", "", row["workload"].replace("`", ""))
            measured = row.get("measured", "")
            machine = f" ({measured.split(', ')[1]})" if ", " in measured else ""
            entries.append((y, f"{group['short']}: {workload}{machine}", group, row))
            y += 1
        y += 0.6 if rows else 0
    fig = plt.figure(figsize=(13, 0.25 * y + 1.8), layout="constrained")
    left, right = fig.subplots(1, 2, sharey=True, width_ratios=[1.15, 1])
    series = [
        (left, "ratio_floor", "tab:blue", "this project ÷ floor", -0.15),
        (left, "released_floor", "tab:gray", "0.3.1 ÷ floor", 0.15),
        (right, "ratio_released", "tab:orange", "this project ÷ 0.3.1", 0.0),
    ]
    beside = {"textcoords": "offset points", "fontsize": 6.5, "va": "center"}
    for y, _, group, row in entries:
        for axis in (left, right) if group.get("gpu") else ():
            axis.axhspan(y - 0.5, y + 0.5, color="mistyrose", zorder=0)
        for axis, key, color, _, shift in series:
            parts = [part.partition("–") for part in row[key].split(" / ")] if row.get(key) else []
            values = [(float(low), float(high or low)) for low, _, high in parts]  # "0.9–1.1"
            for (low, high), marker in zip(values, "os", strict=False):
                if high > low:
                    axis.plot([low, high], [y + shift] * 2, color=color, linewidth=3)
                axis.plot([high], [y + shift], marker=marker, color=color, markersize=4)
            if values:
                high = max(high for _, high in values)
                axis.annotate(cell(row, key), (high, y + shift), (4, 0), color=color, **beside)
    for axis, title, limits in (
        (left, "against the floor (what you would write by hand)", (0.2, 60)),
        (right, "this project against the released 0.3.1", (0.007, 10)),
    ):
        axis.set(xscale="log", xlim=limits)
        axis.axvline(1, color="black", linewidth=0.8)
        axis.set_title(title, fontsize=9)
        axis.grid(axis="x", color="lightgray", linewidth=0.5)
        axis.tick_params(axis="x", labelsize=8)
        axis.spines[["top", "right"]].set_visible(False)
    left.set_yticks([y for y, *_ in entries], [text for _, text, *_ in entries], fontsize=7)
    left.invert_yaxis()
    handles = [
        plt.Line2D([], [], color=color, marker="o", linewidth=3, label=name)
        for _, _, color, name, _ in series
    ]
    handles.append(plt.Line2D([], [], color="dimgray", marker="s", ls="", label="second of a / b"))
    handles.append(plt.Rectangle((0, 0), 1, 1, color="mistyrose", label="GPU rows"))
    fig.legend(handles=handles, loc="outside lower center", ncol=5, fontsize=8, frameon=False)
    title = "Time ratios, lower is better (below 1: faster than what it is compared with)\n"
    fig.suptitle(title + f"{data['machines']}\ndates and details: docs/performance.md", fontsize=10)
    image.parent.mkdir(exist_ok=True)
    fig.savefig(image, dpi=110)
    print(f"wrote {image}")


def write_page(data: dict) -> None:
    """Rewrite the page's table and the picture from `data`."""
    PAGE.write_text(page_with_table(PAGE.read_text(), table(data)))
    draw(data)


def load(path: Path = DATA) -> dict:
    """The performance data."""
    return json.loads(path.read_text())


def merge_files(data: dict, paths: list[Path], measured: str) -> None:
    """Merge the figures of `--json` files that ran on `measured` (a machine's name) today."""
    now = datetime.datetime.now()
    stamp = {"run": f"{now:%Y-%m-%d %H:%M}", "measured": f"{now:%Y-%m-%d}, {measured}"}
    data.setdefault("runs", {})[stamp["run"]] = {"merged": [p.name for p in paths], "gpu": measured}
    data["machines"] += f"; {measured}" * (measured not in data["machines"])
    for path in paths:
        figures = json.loads(path.read_text())["figures"]
        merge(data, figures, stamp | {"command": f"`--json` file {path.name}, merged"})


def run(args: argparse.Namespace) -> None:
    """Merge `--merge`'s files into the JSON, then redraw (or, with `--check`, compare) the
    page's table and its picture."""
    data, page = load(), PAGE.read_text()
    if args.merge:
        if not args.measured:
            sys.exit("--merge needs --measured: the machine the figures were measured on")
        merge_files(data, [Path(path) for path in args.merge.split(",")], args.measured)
        DATA.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    if not args.check:
        return write_page(data)
    if page_with_table(page, table(data)) != page:
        sys.exit(f"{PAGE}: its table differs from {DATA}; run `python -m benchmarks page`")
    print(f"{PAGE}: the table matches {DATA.name}")
