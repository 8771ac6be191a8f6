"""Parts of one study, run apart (a share of its models each, on other machines or in
other sittings), merged into one report (maelm_jax/study/merge.py):

    python main.py --config=configs/study/merge.py --workdir=runs/study \
        --config.inputs=runs/part_a,runs/part_b

Each input is a study's workdir, or a directory or file of its study.json.
"""

from maelm_jax.config import variants
from maelm_jax.study import config as study_config


def get_config(arg: str | None = None):
    variants.require_none(arg)
    return study_config.merge_defaults()
