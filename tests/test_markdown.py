"""Tests for the one renderer of Markdown tables (maelm_jax/infra/markdown.py). A row is
its cells between bars; a table is its header, the rule and its rows. Every generated
block of README.md and docs/ is compared with the committed one in this layout."""

import pytest

from maelm_jax.infra import markdown

pytestmark = pytest.mark.tier("unit")


def test_a_row_is_its_cells_between_bars():
    assert markdown.row(["a", "b"]) == "| a | b |"
    assert markdown.row([1, 2.5, None, "`x`"]) == "| 1 | 2.5 | None | `x` |"  # through str()
    assert markdown.row(c for c in "xy") == "| x | y |"  # any iterable


def test_an_empty_cell_keeps_its_spaces_and_a_blank_one_is_one_space():
    assert markdown.row(["", "b"]) == "|  | b |"  # the study's tables
    assert markdown.row(["side", markdown.BLANK, markdown.BLANK, "why"]) == "| side | | | why |"


def test_a_table_is_its_header_the_rule_and_a_line_per_row():
    assert markdown.table(["model", "loss"], [["MLM", "2.31"], ("MAE-LM", 2.4)]) == [
        "| model | loss |", "|---|---|", "| MLM | 2.31 |", "| MAE-LM | 2.4 |"]
    assert markdown.table(["only"], []) == ["| only |", "|---|"]
    assert markdown.table(["a", "b", "c"], iter([[1, 2, 3]]))[1] == "|---|---|---|"
    assert markdown.table([markdown.BLANK] * 2, [["k", "v"]])[:1] == ["| | |"]  # a model card's
