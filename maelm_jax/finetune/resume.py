"""An unfinished fine-tuning run and how it continues: `<workdir>/resume/<step>/`.

train.run writes a resume checkpoint (the whole train state, the best evaluation's
parameters so far, the evaluations and the metrics since the last log line) at every
evaluation but the last, every train.checkpoint_every steps and on SIGTERM; running the
same command again restores the latest one when the workdir's config.json matches. Once
results.json is written the run is finished and resume/ is deleted.
"""

from __future__ import annotations

import json
from typing import Any

import flax
import jax
import ml_collections
from absl import logging

from maelm_jax import config as pretrain_config
from maelm_jax import distributed, layout, paths
from maelm_jax.finetune import config as config_lib
from maelm_jax.training import checkpoint as checkpoint_lib
from maelm_jax.training import engine
from maelm_jax.training import workdir as workdir_lib

# The newest resume checkpoint, and the one before it in case the newest is damaged.
KEEP = 2


@flax.struct.dataclass
class ResumeState:
    """The arrays of a resume checkpoint."""

    train: Any  # setup.FinetuneState
    # select="best": the best evaluation's parameters so far (before the first evaluation
    # a stand-in, the current ones, which nothing reads); select="final": None.
    best_params: Any

    @property
    def step(self) -> jax.Array:
        """The step, which the Checkpointer checks against the step it names; a seed
        group's state (seed_group.py) holds one per seed, all equal."""
        return self.train.step.reshape(-1)[0]


def resumable(workdir: paths.Path, config: ml_collections.ConfigDict) -> bool:
    """Whether `workdir` holds an unfinished run that `config` continues: a resume
    checkpoint, no results.json, and a config.json that differs from `config` at most in
    fields that do not change what the run computes (workdir_lib.config_changes: the
    mesh, the logging and checkpoint cadence, ...). An unfinished run of another config
    is not continued; a warning names the fields."""
    resume = workdir / layout.RESUME_DIR
    if (workdir / layout.RESULTS_FILE).exists() or not (
            resume.is_dir() and any(p.name.isdigit() for p in resume.iterdir())):
        return False
    defaults = json.loads(pretrain_config.to_json(config_lib.finetune_defaults()))
    changed = workdir_lib.config_changes(layout.recorded_config(workdir) or {},
                                         json.loads(pretrain_config.to_json(config)), defaults)
    if changed:
        shown = ", ".join(f"config.{k}" for k in changed[:5])
        more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
        logging.warning("%s holds an unfinished run with a different %s%s: starting over",
                        workdir, shown, more)
        return False
    return True


def start_over(workdir: paths.Path) -> None:
    """Removes what an earlier run left that this one could take for its own: results.json
    (a finished run) and resume checkpoints. metrics.jsonl is emptied by the writer."""
    paths.make_dirs(workdir)
    paths.remove(workdir / layout.RESUME_DIR)
    paths.remove(workdir / layout.RESULTS_FILE)


def restore_or_init(ckpt: checkpoint_lib.Checkpointer, setup, encoder_params, select: str,
                    resume: bool) -> tuple[int, Any, Any, engine.Progress]:
    """(start step, state, best params on the host or None, progress): the latest resume
    checkpoint's when `resume`, else a fresh state at step 0. setup: finetune.setup's
    state_setup."""
    if resume:
        target = ResumeState(setup.abstract,
                             setup.abstract.params if select == "best" else None)
        restored = ckpt.restore_latest(target)
        if restored is not None:
            step, saved, meta = restored
            progress = engine.Progress.from_meta(meta)
            best_params = (distributed.host_copy(saved.best_params)
                           if select == "best" and progress.best is not None else None)
            logging.info("resuming from %s/%d", ckpt.directory, step)
            return step, saved.train, best_params, progress
    return 0, setup.init(encoder_params), None, engine.Progress()


def save(ckpt: checkpoint_lib.Checkpointer, step: int, state, best_params, select: str,
         progress: engine.Progress, seconds: float) -> None:
    """Starts writing resume/<step> (asynchronously); state: setup.FinetuneState;
    `seconds`: this attempt's so far."""
    if select == "best" and best_params is None:
        best_params = state.params  # the stand-in: no evaluation yet
    ckpt.save(step, ResumeState(state, best_params if select == "best" else None),
              progress.meta(step, seconds))
