"""A fine-tuning run's inputs, decided and read before its workdir is touched: what the
workdir's record says the run does (`check_run`, under fine-tuning's lifecycle policy
`FINE_TUNING`), then the encoder to start from, the tokenizer and the task's encoded data
(`read_inputs` -> `Inputs`). A run, a seed group and a sweep's runs start here."""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections
from absl import logging

from maelm_jax.finetune import config as finetune_config
from maelm_jax.finetune import data, encoder, tasks
from maelm_jax.infra import paths
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.training import lifecycle
from maelm_jax.workdirs import guard as workdir_lib
from maelm_jax.workdirs import layout

# Fine-tuning's lifecycle (training/lifecycle.py). A run of minutes: a changed config
# allowed starts it again rather than continuing its checkpoints under another config.
FINE_TUNING = lifecycle.Policy(
    mode="finetune", noun="fine-tuning", defaults=finetune_config.finetune_defaults,
    resolve_paths=finetune_config.resolve_paths,
    # What changes how the run proceeds, not what it computes: logging and resume
    # cadence, evaluation batches, the mesh, the kernel, compile effort.
    harmless=("train.log_every", "train.checkpoint_every", "train.resume_saves",
              "train.nonfinite", "train.eval_batch_size", "mesh", "sharding_rules",
              "model.attention_impl", "model.pallas", "fast_compile"),
    finished=lambda workdir, config: (workdir / layout.RESULTS_FILE).exists(),
    override=lifecycle.Decision.START, override_words="start it again with the new config")


def _check_workdir(workdir: paths.Path, init_from: str) -> None:
    """Refuses a workdir that is not ours to overwrite (before anything is written)."""
    workdir_lib.check_directory(workdir)
    if init_from and paths.contains(workdir, init_from):
        # Starting over would delete the checkpoint the run is to start from.
        raise finetune_config.FinetuneConfigError(
            f"config.init_from {init_from} is inside --workdir {workdir}; fine-tune into "
            f"another directory")


@dataclasses.dataclass
class Inputs:
    """What a run (or a seed group, seed_group.py) has once its inputs are checked and its
    workdir is ready: the encoder to start from, the tokenizer, the task's encoded data
    and whether the workdir holds an unfinished run to continue."""

    config: ml_collections.ConfigDict  # validated, paths absolute
    workdir: paths.Path
    encoder_cfg: encoder_lib.EncoderConfig
    encoder_params: Any  # numpy, or None for random weights
    tokenizer: Any
    source: str  # where the encoder comes from, in words
    max_len: int
    buckets: tuple[int, ...]
    task: Any  # tasks.make_task's
    resume: bool

    @property
    def steps_per_epoch(self) -> int:
        return data.steps_per_epoch(len(self.task.train), self.config.train.batch_size)


def check_run(config: ml_collections.ConfigDict, workdir: str,
              allow_config_change: bool = False
              ) -> tuple[ml_collections.ConfigDict, paths.Path, lifecycle.Decision]:
    """Validates `config` (returned with absolute paths, and the workdir's) and decides,
    reading only, what the run does in `workdir` (lifecycle.decide: process 0 reads the
    record, every process gets its decision)."""
    config, workdir = finetune_config.validated(config, workdir)
    if config.sweep:
        raise finetune_config.FinetuneConfigError(
            "config.sweep: expected False for a single run (sweep.run_sweep runs the grid)")
    _check_workdir(workdir, config.init_from)
    decision = lifecycle.decided(FINE_TUNING, config, workdir, allow_config_change)
    if (decision is lifecycle.Decision.CONTINUE
            and (workdir / layout.OLD_RESUME_DIR).is_dir()):
        raise layout.WorkdirError(
            f"{workdir}/{layout.OLD_RESUME_DIR}: resume checkpoints in an older layout; "
            f"move them where runs keep them now (mv {workdir}/{layout.OLD_RESUME_DIR} "
            f"{workdir}/{layout.CHECKPOINTS}) and run again")
    return config, workdir, decision


def read_inputs(config: ml_collections.ConfigDict, workdir: paths.Path,
                decision: lifecycle.Decision) -> Inputs:
    """Reads and checks the encoder, tokenizer and task data of `config` and `workdir`
    (check_run's, `decision` not FINISHED). Nothing is written: the workdir is prepared
    when the run's session opens (`train_prepared`)."""
    # Checkpoint, tokenizer and data are checked before the workdir is touched.
    encoder_cfg, encoder_params, tok, source = encoder.encoder_and_tokenizer(config)
    max_len = encoder.max_seq_len(config, encoder_cfg.max_positions)
    buckets = data.buckets_for(max_len, config.data.buckets)
    task = tasks.make_task(config, tok, max_len)
    if len(task.train) == 0:
        raise finetune_config.FinetuneConfigError(
            f"config.data: {task.name} has no usable training example")
    if config.data.one_bucket:
        buckets = data.one_bucket(buckets, max(
            len(s) for split in (task.train, *task.eval_splits()) for s in split.sequences))
    resume = decision is lifecycle.Decision.CONTINUE
    logging.info("%s: %d train examples, max_seq_len %d (buckets %s); encoder %s",
                 task.name, len(task.train), max_len, buckets, source)
    return Inputs(config, workdir, encoder_cfg, encoder_params, tok, source, max_len,
                    buckets, task, resume)
