"""Draw the benchmark figures of docs/performance.md as a picture.

Reads `docs/performance.json` (a list of {"name", "measured", "target"} in the
same unit per row, lower is better) and writes `docs/images/performance.png`:
each figure as a fraction of its target, so a bar left of 1.0 meets it.
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

DOCS = Path(__file__).resolve().parent.parent / "docs"


def main() -> None:
    rows = json.loads((DOCS / "performance.json").read_text())
    names = [row["name"] for row in rows]
    fractions = [row["measured"] / row["target"] for row in rows]
    figure, axes = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.2))
    colours = ["tab:green" if f <= 1.0 else "tab:red" for f in fractions]
    axes.barh(names, fractions, color=colours)
    axes.axvline(1.0, color="black", linewidth=1)
    axes.invert_yaxis()
    axes.set_xlabel("measured / target (left of 1.0 meets the target)")
    axes.set_title("genlm-backend benchmarks, 2 CPU cores")
    figure.tight_layout()
    out = DOCS / "images" / "performance.png"
    out.parent.mkdir(exist_ok=True)
    figure.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
