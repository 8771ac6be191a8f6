"""The papers' named models, written once: the changes each makes to a pretraining config.

`MODELS` holds the four models the papers compare (MLM, MAE-LM, 3ML_self, 3ML_cross); the
study trains them side by side, the benchmarks time them, configs/pretrain/3ml.py sizes
them to 3ML Table 4. Every other registered objective is a model too, named after itself
with its own defaults (`names`, `get`), so a new objective joins the study and the
benchmarks by its registry line. `TABLE2` holds MAE-LM Table 2's ablation rows, each a change to
MAE-LM base (configs/pretrain/base.py offers them as variants). A recipe changes only
what defines its model, so models built from one config share its corpus, tokenizer,
encoder, budget, optimiser and seed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections

from maelm_jax.config import variants
from maelm_jax.pretrain import objectives


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A named model: dotted config fields to set, then `derive` for the fields that follow
    from others (a decoder sized from the encoder)."""

    name: str
    display_name: str  # as the papers write it
    changes: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    derive: Callable[[ml_collections.ConfigDict], None] | None = None

    def apply(self, config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
        """A copy of the pretraining `config` made into this model."""
        c = config.copy_and_resolve_references()
        variants.apply(c, self.changes)
        if self.derive is not None:
            self.derive(c)
        return c


def _three_ml(config: ml_collections.ConfigDict) -> None:
    """3ML Table 4's decoder: 2 layers at half the encoder's width (half its heads and FFN,
    so the head size is the encoder's), with the encoder's dropout and attention dropout
    ("dropout 0.1 on the whole model")."""
    m = config.model
    m.decoder.update(num_layers=2, d_model=m.d_model // 2, d_ff=m.d_ff // 2,
                     num_heads=max(1, m.num_heads // 2), dropout=m.dropout,
                     attention_dropout=m.attention_dropout)


def _three_ml_cross(config: ml_collections.ConfigDict) -> None:
    """3ML_cross: the 3ML decoder as a cross decoder; encoder and decoder pre-LN (post-LN
    3ML_cross does not train, Table 4's note)."""
    _three_ml(config)
    m = config.model
    m.decoder.kind = "cross"
    m.pre_ln = m.decoder.pre_ln = True


# 3ML Table 4: 40 % of positions predicted, 80-10-10 corruption.
_THREE_ML_MASKING = {"masking.mask_ratio": 0.4, "masking.mask_frac": 0.8,
                     "masking.random_frac": 0.1}

MODELS: dict[str, Recipe] = {r.name: r for r in (
    Recipe("mlm", "MLM", {"objective": "mlm"}),
    Recipe("maelm", "MAE-LM", {"objective": "maelm"}),
    Recipe("3ml_self", "3ML_self", {"objective": "maelm", **_THREE_ML_MASKING}, _three_ml),
    Recipe("3ml_cross", "3ML_cross", {"objective": "maelm", **_THREE_ML_MASKING},
           _three_ml_cross),
)}


def _row(name: str, display_name: str, **changes) -> Recipe:
    return Recipe(name, display_name, {k.replace("__", "."): v for k, v in changes.items()})


# MAE-LM Table 2, one recipe per row: the changes to MAE-LM base (its first row).
TABLE2: dict[str, Recipe] = {r.name: r for r in (
    _row("maelm", "Original: enc. w/o [MASK], aligned positions, relative bias, bi. self"),
    # Handling [MASK]
    _row("mlm", "enc. w. [MASK], no dec. (i.e., MLM)", objective="mlm"),
    _row("enc_mask", "enc. w. [MASK]", masking__delta=1.0),
    _row("enc_mask_reset", "enc. w. [MASK], dec. resets [MASK]", masking__delta=1.0,
         model__decoder__reset_masks=True),
    _row("random_replace", "random replace w/o [MASK]", masking__mask_frac=0.0,
         masking__random_frac=1.0),
    # Position encoding
    _row("misaligned", "misaligned position encoding", model__misaligned_positions=True),
    _row("no_rel_pos", "no relative position encoding", model__rel_pos_buckets=0),
    # Decoder attention ([MASK] queries only; see maelm_jax/models/decoder.py)
    _row("dec_bi_cross", "bi. self + cross", model__decoder__kind="cross"),
    _row("dec_uni_cross", "uni. self + cross", model__decoder__kind="causal_cross"),
    _row("dec_cross_only", "cross only", model__decoder__kind="cross_only"),
    # Decoder size
    _row("dec_2x768", "decoder 2 x 768", model__decoder__num_layers=2),
    _row("dec_6x768", "decoder 6 x 768", model__decoder__num_layers=6),
    _row("dec_4x512", "decoder 4 x 512", model__decoder__d_model=512,
         model__decoder__num_heads=8, model__decoder__d_ff=2048),
    _row("dec_4x1024", "decoder 4 x 1024", model__decoder__d_model=1024,
         model__decoder__num_heads=16, model__decoder__d_ff=4096),
)}


def names() -> tuple[str, ...]:
    """The models by name: the papers' (`MODELS`), then every registered objective that no
    recipe is named after."""
    return (*MODELS, *(name for name in objectives.names() if name not in MODELS))


def study_names() -> tuple[str, ...]:
    """The models a study may train: `names()` and MAE-LM Table 2's other rows (e.g.
    `enc_mask`, the mechanism's own contrast to MAE-LM)."""
    return (*names(), *(name for name in TABLE2 if name not in names()))


def get(name: str) -> Recipe:
    """The model called `name` (one of `names()`); KeyError listing them for any other. A
    Table 2 row is MAE-LM with its changes, whatever objective the config had."""
    if name in MODELS:
        return MODELS[name]
    if name in TABLE2:
        row = TABLE2[name]
        return Recipe(name, row.display_name, {"objective": "maelm", **row.changes})
    if name in objectives.names():
        return Recipe(name, name, {"objective": name})
    raise KeyError(f"unknown model {name!r}; expected one of {', '.join(names())}")


def display_name(name: str) -> str:
    """The papers' name of a model of `MODELS` or a row of `TABLE2` (other names as they
    are)."""
    return get(name).display_name if name in MODELS or name in TABLE2 else name
