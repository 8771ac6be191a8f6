"""A run's recorded config.json read back over the defaults of its kind (layout.KINDS),
so a run recorded before a field existed still reads: the field counts at its default.

The defaults of each kind whose workdirs later runs read (pretraining, and fine-tuning as
another run's init_from or the analyses' input) are named here once. This module sits
above fine-tuning: fine-tuning reads the runs it starts from through maelm_jax/runs.py,
which needs no kind's defaults but pretraining's.
"""

from __future__ import annotations

from collections.abc import Callable

import ml_collections

from maelm_jax.config import schema
from maelm_jax.finetune import config as finetune_config
from maelm_jax.infra import paths
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.workdirs import layout

# config.mode -> its defaults; a record without a mode is a pretraining run's.
DEFAULTS: dict[str, Callable[[], ml_collections.ConfigDict]] = {
    "pretrain": pretrain_config.pretrain_defaults,
    "prepare": pretrain_config.pretrain_defaults,
    "finetune": finetune_config.finetune_defaults,
}


def run_config(recorded: dict) -> ml_collections.ConfigDict:
    """The recorded config with its kind's defaults filled in."""
    defaults = DEFAULTS.get(recorded.get("mode", "pretrain"), pretrain_config.pretrain_defaults)
    return ml_collections.ConfigDict(schema.over_defaults(defaults().to_dict(), recorded))


def recorded_config(workdir: paths.Path) -> ml_collections.ConfigDict:
    """The workdir's config.json over its kind's defaults (the pretraining defaults when
    there is none)."""
    return run_config(layout.recorded_config(workdir) or {})
