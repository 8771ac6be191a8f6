"""The MAE-LM paper's effective-rank analysis (Fig. 1, Table 3) of trained encoders.

    python main.py --config=configs/analysis/rank.py --workdir=runs/rank \
        --config.runs=runs/mlm,runs/maelm

Each run is a pretraining or fine-tuning workdir (or one of its checkpoints/<step>). By
default every encoder reads its own held-out data (validation blocks, or a fine-tuning
run's dev set); `--config.source.kind=text --config.source.path=held_out.txt` (any corpus
kind of the pretraining config), `--config.source.kind=glue --config.source.task=mnli
--config.source.data_dir=/data/glue` or `--config.source.kind=squad
--config.source.path=dev-v2.0.json` read the same text for every run instead. The workdir
gets rank.json, rank.md, rank_layers.png (Fig. 1(a)) and rank_mask.png (Fig. 1(b)).
"""

from maelm_jax.analysis import config as rank_config
from maelm_jax.config import variants


def get_config(arg: str | None = None):
    variants.require_none(arg)
    return rank_config.rank_defaults()
