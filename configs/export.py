"""A trained run as a directory Hugging Face transformers loads (maelm_jax/export/run.py).

    python main.py --config=configs/export.py --workdir=exports/quickstart \
        --export_config.init_from=runs/quickstart

`init_from` is a pretraining or fine-tuning workdir (its newest finished checkpoint) or
one of its checkpoints/<step> directories; `--workdir` is the new directory.
"""

from maelm_jax.config import variants
from maelm_jax.export import config as export_config


def get_config(arg: str | None = None):
    variants.require_none(arg)
    return export_config.export_defaults()
