"""What a pretraining run predicts for the <mask> pieces of any text.

    python main.py --config=configs/fill_mask.py --workdir=runs/quickstart \
        --config.text="The <mask> module provides functions for working with files."

`--workdir` is a pretraining workdir (or one of its checkpoints/<step>), only read. Each
`<mask>` is one piece; several texts are separated by "|". `--config.top_k` sets how many
predictions are shown per mask (default 5).
"""

from maelm_jax.config import variants
from maelm_jax.fill_mask import config as fill_mask_config


def get_config(arg: str | None = None):
    variants.require_none(arg)
    return fill_mask_config.fill_mask_defaults()
