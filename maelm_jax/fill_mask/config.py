"""Fill-mask's config (configs/fill_mask.py): plain data, read before any model is built."""

from __future__ import annotations

from typing import Any

import ml_collections

from maelm_jax.config import schema
from maelm_jax.infra import errors


class FillMaskError(errors.UserError):
    """A fill-mask input mistake; the message names the field or file."""


def fill_mask_defaults() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.mode = "fill_mask"  # main.py dispatches on it
    # The texts, each with one or more <mask> marks: a string (several separated by "|")
    # or a list of strings.
    c.text = ""
    c.top_k = 5  # predictions shown per <mask>
    return c


FIELDS: dict[str, schema.Field] = {
    "mode": schema.choice("fill_mask"),
    "text": schema.Field((str, list, tuple), "a text with <mask>, '|'-separated texts or a "
                         "list", lambda v: bool(texts(v))),
    "top_k": schema.integer(1),
}


def texts(value: Any) -> list[str]:
    """The texts of config.text: "|"-separated in a string, or a list."""
    parts = value.split("|") if isinstance(value, str) else [str(v) for v in value]
    return [p.strip() for p in parts if p.strip()]
