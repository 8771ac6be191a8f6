"""The export config: which run to export. `configs/export.py` starts from
`export_defaults()`; main.py runs maelm_jax/export/run.py when ``config.mode == "export"``
and writes the export to ``--workdir``."""

from __future__ import annotations

import ml_collections

from maelm_jax.config import schema
from maelm_jax.infra import errors


class ExportError(errors.UserError):
    """An export that cannot be made; the message names the field or file."""


def export_defaults() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.mode = "export"  # main.py dispatches on it
    # The run to export: a pretraining or fine-tuning workdir (its newest finished
    # checkpoint) or one of its checkpoints/<step> directories.
    c.init_from = ""
    # The PyTorch classes: "maelm", our own (every architecture; the code ships beside the
    # weights, loaded with trust_remote_code=True), or "roberta", transformers' own
    # RobertaForMaskedLM / RobertaModel, for an encoder that is a plain RoBERTa
    # (model.pre_ln=False, model.rel_pos_buckets=0; export/roberta.py).
    c.classes = "maelm"
    return c


FIELDS: dict[str, schema.Field] = {
    "mode": schema.choice("export"),
    "init_from": schema.Field((str,), "a pretraining or fine-tuning workdir, or "
                              "<workdir>/checkpoints/<step>", bool, path=True),
    "classes": schema.choice("maelm", "roberta"),
}


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The config with its paths absolute, or an ExportError naming the first bad field."""
    schema.check(config, FIELDS, export_defaults(), ExportError)
    return schema.resolve_paths(config, FIELDS)
