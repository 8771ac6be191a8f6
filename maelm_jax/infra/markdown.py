"""The one renderer of Markdown tables. Every table the project generates goes through it:
the blocks of README.md and docs/, the benchmarks' and the study's reports, a sweep's
table, the rank analysis's table and a model card's. So all of them are laid out the same
way, and a generated block matches the committed one byte for byte (tests/test_docs.py,
tests/benchmarks/test_tables.py).

    table(["model", "loss"], [["MLM", "2.31"]])
    -> ["| model | loss |", "|---|---|", "| MLM | 2.31 |"]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

BLANK = object()
"""A cell left blank, written as one space: "| |". Used for the model card's header (its
key-value tables have no column names) and for the cells of a suite's side that was not
measured. An empty string is a cell holding "", written "|  |", as in the study's tables."""


def row(cells: Iterable[object]) -> str:
    """One line of a table: `cells` between bars, "| a | b |". Each cell is any value,
    written with str(), or BLANK."""
    return "|" + "|".join(" " if c is BLANK else f" {c!s} " for c in cells) + "|"


def table(header: Sequence[object], rows: Iterable[Iterable[object]]) -> list[str]:
    """A table's lines, without line ends. First `header` (the column names), then the rule
    under it ("|---|---|", one "---|" per column), then one line for each row of `rows`
    (each row's cells, as in `row`)."""
    return [row(header), "|" + "---|" * len(header), *(row(r) for r in rows)]
