"""Draw the benchmark figures of docs/performance.md as a picture.

Reads `docs/performance.json`: the machine, the date, and for each figure the
time of genlm-backend (`ours`) and of the reference the benchmark measures it
against (`reference`, named by `reference_name`), both in `unit`, lower is
better. Writes `docs/images/performance.png`: one panel per figure with both
times as bars and their ratio in the panel's title.
"""

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

DOCS = Path(__file__).resolve().parent.parent / "docs"
COLUMNS = 2


def main() -> None:
    data = json.loads((DOCS / "performance.json").read_text())
    figures = data["figures"]
    rows = math.ceil(len(figures) / COLUMNS)
    fig, axes = plt.subplots(rows, COLUMNS, figsize=(11, 1.45 * rows + 1.0), squeeze=False)
    for axis, item in zip(axes.flat, figures, strict=False):
        labels = ["genlm-backend", item["reference_name"]]
        times = [item["ours"], item["reference"]]
        bars = axis.barh(labels, times, color=["tab:blue", "tab:gray"])
        axis.bar_label(bars, [f" {t:g} {item['unit']}" for t in times], fontsize=8)
        axis.invert_yaxis()
        axis.set_xlim(0, max(times) * 1.35)
        axis.set_xticks([])
        axis.tick_params(axis="y", labelsize=8)
        axis.set_title(
            f"{item['name']}: {item['ours'] / item['reference']:.2f}x the reference", fontsize=9
        )
        for side in ("top", "right", "bottom"):
            axis.spines[side].set_visible(False)
    for axis in axes.flat[len(figures) :]:
        axis.set_visible(False)
    fig.suptitle(
        f"Time, lower is better: genlm-backend and the reference of each benchmark\n"
        f"{data['machine']}; measured {data['date']}; {data['note']}",
        fontsize=10,
    )
    fig.tight_layout()
    out = DOCS / "images" / "performance.png"
    out.parent.mkdir(exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
