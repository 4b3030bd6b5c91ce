"""The first table of docs/performance.md and its picture, both from docs/performance.json.

`docs/performance.json` holds the table cell for cell: groups of rows (one
group per benchmark, with the floor it is measured against and when), each
row with this project's figure, the released genlm-backend 0.3.1's, the
floor's and the three ratios (this project ÷ floor, 0.3.1 ÷ floor, this
project ÷ 0.3.1). A ratio cell is a number, a range `lo–hi`, or alternatives
`a / b`; a missing cell prints as "—". A group with `pending` has no figures
yet and prints that sentence instead.

Running the script rewrites the table between the page's two
`performance-table` markers and draws `docs/images/performance.png`: every
ratio of the table on a log scale, lower is better. `--check` changes nothing
and exits with status 1 when the page's table differs from the JSON.

Run: `python benchmarks/plot_performance.py [--check]` (needs matplotlib, in the
`docs` extra).
"""

import argparse
import json
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"
DATA = DOCS / "performance.json"
PAGE = DOCS / "performance.md"
IMAGE = DOCS / "images" / "performance.png"
BEGIN = "<!-- performance-table: begin (written by benchmarks/plot_performance.py) -->"
END = "<!-- performance-table: end -->"
CELLS = [
    "workload",
    "ours",
    "released",
    "floor",
    "ratio_floor",
    "released_floor",
    "ratio_released",
    "measured",
]
RATIOS = ("ratio_floor", "released_floor", "ratio_released")


def ratio_values(cell: str | None) -> list[tuple[float, float]]:
    """The (low, high) of each alternative of a ratio cell: "0.9–1.1" or "0.12 / 0.06"."""
    if cell is None:
        return []
    spans = []
    for alternative in cell.split(" / "):
        low, _, high = alternative.partition("–")
        spans.append((float(low), float(high or low)))
    return spans


def ratio_text(cell: str | None) -> str:
    if cell is None:
        return "—"
    return " / ".join(f"{alternative}×" for alternative in cell.split(" / "))


def row_line(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def table(data: dict) -> str:
    """The page's first table, in Markdown."""
    lines = [row_line([data["columns"][key] for key in CELLS]), row_line(["---"] * len(CELLS))]
    for group in data["groups"]:
        header = {"workload": f"**{group['name']}**"}
        if group.get("floor"):
            header["floor"] = f"*{group['floor']}*"
        if group.get("measured"):
            header["measured"] = group["measured"]
        lines.append(row_line([header.get(key, "") for key in CELLS]))
        if group.get("pending"):
            lines.append(row_line([f"*{group['pending']}*"] + [""] * (len(CELLS) - 1)))
        for row in group["rows"]:
            cells = []
            for key in CELLS:
                if key in RATIOS:
                    cells.append(ratio_text(row.get(key)))
                elif key == "measured":
                    cells.append(row.get(key, ""))
                else:
                    cells.append(row.get(key) or "—")
            lines.append(row_line(cells))
    return "\n".join(lines)


def page_with_table(page: str, text: str) -> str:
    start, end = page.index(BEGIN) + len(BEGIN), page.index(END)
    return page[:start] + "\n" + text + "\n" + page[end:]


def label(group: dict, row: dict) -> str:
    """The row's name in the picture: its group's short name, its workload, its machine."""
    workload = re.sub(r"\s*\([^()]*\)$", "", row["workload"].replace("`", ""))
    machine = f" ({row['measured'].split(', ')[1]})" if row.get("measured") else ""
    return f"{group['short']}: {workload}{machine}"


def draw(data: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = []  # (y, label, group, row); a row None marks a pending group
    y = 0.0
    for group in data["groups"]:
        rows = [row for row in group["rows"] if any(row.get(key) for key in RATIOS)]
        for row in rows or [None]:
            text = label(group, row) if row else f"{group['short']}: figures follow"
            entries.append((y, text, group, row))
            y += 1
        y += 0.6
    fig, (left, right) = plt.subplots(
        1,
        2,
        sharey=True,
        figsize=(13, 0.25 * y + 1.8),
        gridspec_kw={"width_ratios": [1.15, 1]},
        layout="constrained",
    )
    series = [
        (left, "ratio_floor", "tab:blue", "this project ÷ floor", -0.15),
        (left, "released_floor", "tab:gray", "0.3.1 ÷ floor", 0.15),
        (right, "ratio_released", "tab:orange", "this project ÷ 0.3.1", 0.0),
    ]
    for y, _, group, row in entries:
        if group.get("gpu"):
            for axis in (left, right):
                axis.axhspan(y - 0.5, y + 0.5, color="mistyrose", zorder=0)
        if row is None:
            left.text(0.22, y, group["pending"], fontsize=7, color="dimgray", va="center")
            continue
        for axis, key, color, _, shift in series:
            for (low, high), marker in zip(ratio_values(row.get(key)), "os", strict=False):
                if high > low:
                    axis.plot([low, high], [y + shift] * 2, color=color, linewidth=3)
                axis.plot([high], [y + shift], marker=marker, color=color, markersize=4)
            if row.get(key):
                high = max(high for _, high in ratio_values(row[key]))
                axis.annotate(
                    ratio_text(row[key]),
                    (high, y + shift),
                    xytext=(4, 0),
                    textcoords="offset points",
                    fontsize=6.5,
                    va="center",
                    color=color,
                )
    for axis, title, limits in (
        (left, "against the floor (what you would write by hand)", (0.2, 60)),
        (right, "this project against the released 0.3.1", (0.007, 10)),
    ):
        axis.set_xscale("log")
        axis.set_xlim(*limits)
        axis.axvline(1, color="black", linewidth=0.8)
        axis.set_title(title, fontsize=9)
        axis.grid(axis="x", color="lightgray", linewidth=0.5)
        axis.tick_params(axis="x", labelsize=8)
        for side in ("top", "right"):
            axis.spines[side].set_visible(False)
    left.set_yticks([y for y, *_ in entries], [text for _, text, *_ in entries], fontsize=7)
    left.invert_yaxis()
    handles = [
        plt.Line2D([], [], color=color, marker="o", linewidth=3, label=name)
        for _, _, color, name, _ in series
    ]
    pair = plt.Line2D([], [], color="dimgray", marker="s", linestyle="", label="second of a / b")
    handles.append(pair)
    handles.append(plt.Rectangle((0, 0), 1, 1, color="mistyrose", label="H100, before 2026-11-23"))
    fig.legend(handles=handles, loc="outside lower center", ncol=5, fontsize=8, frameon=False)
    fig.suptitle(
        "Time ratios, lower is better (below 1: faster than what it is compared with)\n"
        f"{data['machines']}\ndates and details: docs/performance.md",
        fontsize=10,
    )
    IMAGE.parent.mkdir(exist_ok=True)
    fig.savefig(IMAGE, dpi=110)
    print(f"wrote {IMAGE}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args()
    data = json.loads(DATA.read_text())
    page = PAGE.read_text()
    updated = page_with_table(page, table(data))
    if args.check:
        if updated != page:
            sys.exit(f"{PAGE}: its table differs from {DATA}; run {Path(__file__).name}")
        print(f"{PAGE}: table matches {DATA.name}")
        return
    if updated != page:
        PAGE.write_text(updated)
        print(f"wrote the table of {PAGE}")
    draw(data)


if __name__ == "__main__":
    main()
