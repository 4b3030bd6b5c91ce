"""The performance page's first table is the one its JSON renders, and a refresh keeps what it must.

`docs/performance.json` holds the figures; `python -m benchmarks page` writes the
table between the page's markers (and draws the picture); `python -m benchmarks all`
merges new figures into the JSON. Neither needs matplotlib here.
"""

import copy

from benchmarks import page
from benchmarks.core import Figure


def test_the_page_table_is_the_json_rendered():
    text = page.PAGE.read_text()
    assert page.page_with_table(text, page.table(page.load())) == text, (
        "docs/performance.md and docs/performance.json differ: edit the JSON, then run "
        "`python -m benchmarks page`"
    )


def test_row_ids_are_unique_and_name_their_group():
    data = page.load()
    ids = [row["id"] for group in data["groups"] for row in group["rows"] if "id" in row]
    assert len(ids) == len(set(ids))
    for group in data["groups"]:
        assert all(row["id"].split("/")[0] == group["id"] for row in group["rows"] if "id" in row)


def figure(**fields) -> dict:
    return vars(Figure(**{"workload": "w", "unit": "s", "ours": 1.0, **fields}))


def test_a_refresh_replaces_its_rows_and_keeps_the_others():
    data, stamp = page.load(), {"run": "r", "measured": "2030-01-01, a CPU, 2 cores"}
    before = copy.deepcopy(data)
    page.merge(data, [figure(id="trie/build", ours=(1.0, 2.0), floor=4.0)], stamp)
    page.merge(data, [figure(id="launches/lockstep", unit="ops", ours=10.0, floor=8.0)], stamp)
    rows = {row.get("id"): row for group in data["groups"] for row in group["rows"]}
    build = rows["trie/build"]
    assert (build["ours"], build["ratio_floor"]) == ("1.00 / 2.00 s", "0.25 / 0.50")
    # 0.3.1's cells came from another run: kept, with their date.
    assert build["released"] == "6,831 / 8,564 ms"
    assert build["measured"] == "2030-01-01, a CPU, 2 cores; 0.3.1: 2026-11-24, EPYC"
    assert (rows["launches/lockstep"]["ours"], rows["launches/lockstep"]["ratio_floor"]) == (
        "10 ops",
        "1.25",
    )
    untouched = [g for g in before["groups"] if g["id"] not in ("trie", "launches")]
    assert untouched == [g for g in data["groups"] if g["id"] not in ("trie", "launches")]


def test_a_release_only_refresh_keeps_this_projects_cells():
    data, stamp = page.load(), {"run": "r", "measured": "2030-01-01, a CPU, 2 cores"}
    old = next(row for row in data["groups"][1]["rows"] if row["id"] == "trie/weight_sum")
    ours = old["ours"]
    new = figure(id="trie/weight_sum", ours=(1.0, 1.0), released=(2.0, 4.0), released_only=True)
    page.merge(data, [new], stamp)
    row = next(row for row in data["groups"][1]["rows"] if row["id"] == "trie/weight_sum")
    assert (row["ours"], row["released"], row["ratio_released"]) == (
        ours,
        "2.00 / 4.00 s",
        "0.50 / 0.25",
    )
    assert row["measured"] == "2026-11-22, EPYC; 0.3.1: 2030-01-01, a CPU, 2 cores"
