"""Entry point: python main.py --config=configs/<file>.py[:variant] --workdir=<dir>.

Pretraining configs (configs/pretrain/) run maelm_jax.pretrain.train; fine-tuning configs
(configs/finetune/, `mode = "finetune"`) run maelm_jax.finetune.train, or with
`sweep = True` maelm_jax.finetune.sweep; the effective-rank analysis
(configs/analysis/rank.py, `mode = "rank"`) runs maelm_jax.analysis.run; fill-mask
(configs/fill_mask.py, `mode = "fill_mask"`) runs maelm_jax.fill_mask.run; the laptop-scale
study (configs/study/mini.py, `mode = "study"`) runs maelm_jax.study.run, and the merge of
a study's parts run apart (configs/study/merge.py, `mode = "study_merge"`)
maelm_jax.study.merge, and the pooling of a study's calls (configs/study/pool.py, `mode =
"study_pool"`) maelm_jax.study.pool; the export to Hugging Face transformers (configs/export.py,
`mode = "export"`) runs maelm_jax.export.run; a pretraining config with
`--config.mode=prepare` writes its corpus as block shards with Apache Beam
(maelm_jax.data.prepare) for `--config.data.prepared` of later runs. Each
mode's entry is picked here, so no module of maelm_jax has to import its caller.

Any config field can be overridden with --config.<field>=<value>.
"""

import logging
import pathlib
import sys
import time

from absl import app, flags
from absl import logging as absl_logging

from maelm_jax import cli, compile_cache, distributed, errors, host_memory
from maelm_jax.analysis import run as analysis_run
from maelm_jax.export import run as export_run
from maelm_jax.fill_mask import run as fill_mask_run
from maelm_jax.finetune import sweep as finetune_sweep
from maelm_jax.finetune import train as finetune_train
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.pretrain import train as pretrain_train
from maelm_jax.study import merge as study_merge
from maelm_jax.study import pool as study_pool
from maelm_jax.study import run as study_run
from maelm_jax.training import budget, preemption

FLAGS = flags.FLAGS
# New fields are accepted while parsing, so `--config.data.sources.main.path=...` can
# switch a source's kind from the command line; validation then refuses any field that
# the config kind does not have (a mistyped one), naming it (maelm_jax/schema.py).
cli.define_config(None, "Config file (file.py or file.py:variant).", lock_config=False,
                  accept_new_attributes=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and prepared data: a "
                    "local path or a bucket's gs://bucket/path.")
flags.DEFINE_bool("allow_config_change", False, "Go on in a workdir whose run was recorded "
                  "with a config that differs in fields its results depend on: pretraining "
                  "continues its checkpoints under the new config, fine-tuning starts again.")
flags.DEFINE_bool("debug", False, "Show the full traceback of configuration and data errors.")
flags.DEFINE_bool("library_logs", False, "Also show other libraries' INFO logs (e.g. orbax).")
flags.DEFINE_bool("keep_host_memory", True, "Have glibc's malloc keep freed memory for reuse "
                  "instead of unmapping XLA's per-step scratch buffer (CPU steps: up to about a "
                  "sixth faster; maelm_jax/host_memory.py). Linux with glibc only.")
flags.DEFINE_bool("compilation_cache", True, "Keep compiled programs (and XLA's autotuning "
                  "results) on disk, so that the next run of the same program compiles in "
                  "seconds (maelm_jax/compile_cache.py).")
flags.DEFINE_string("compilation_cache_dir", "", "Where: default $JAX_COMPILATION_CACHE_DIR, "
                    "else ~/.cache/maelm_jax/jax ($MAELM_JAX_CACHE/jax).")
flags.DEFINE_string("coordinator_address", "", "host:port of process 0, for multi-process "
                    "runs outside TPU pods and SLURM (which are detected automatically).")
flags.DEFINE_integer("num_processes", 0, "Number of processes (with --coordinator_address).",
                     lower_bound=0)
flags.DEFINE_integer("process_id", -1, "This process's index from 0 (with "
                     "--coordinator_address).", lower_bound=-1)
flags.DEFINE_float("time_limit_minutes", 0.0, "Stop once this much wall time has passed "
                   "(training saves a checkpoint at the step it is on; the study stops "
                   "between its parts) and exit with status 75; the same command continues. "
                   "0: no limit.", lower_bound=0.0)
flags.mark_flags_as_required(["config", "workdir"])
# Exit status of a run stopped at --time_limit_minutes: sysexits.h's EX_TEMPFAIL ("try
# again"), so a script can tell "finished" (0) from "call again".
TIME_LIMIT_STATUS = 75
# Exit status of a preempted run (SIGTERM, or a TPU maintenance event), after it saved a
# checkpoint at the step it was on: 128 + SIGTERM, what a process ended by SIGTERM reports
# and what Kubernetes, JobSet and Slurm treat as "preempted, run again" rather than "done".
PREEMPTED_STATUS = 143

_PROJECT_DIR = pathlib.Path(__file__).resolve().parent
# Our own code (a virtual environment inside the checkout is not).
_OWN_CODE = (_PROJECT_DIR / "maelm_jax", _PROJECT_DIR / "configs", _PROJECT_DIR / "main.py")


class _ProjectInfoOnly(logging.Filter):
    """Orbax alone logs dozens of INFO lines per checkpoint; keep ours and every warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        path = pathlib.Path(record.pathname).resolve()
        return record.levelno >= logging.WARNING or any(
            path == own or path.is_relative_to(own) for own in _OWN_CODE
        )


def main(argv):
    del argv  # cli.parse_flags refuses stray arguments
    if FLAGS.keep_host_memory:
        host_memory.keep_freed_memory()  # before JAX's backend starts its threads
    absl_logging.set_verbosity(absl_logging.INFO)
    if not FLAGS.library_logs:
        absl_logging.get_absl_handler().addFilter(_ProjectInfoOnly())
    if FLAGS.compilation_cache:
        compile_cache.enable(FLAGS.compilation_cache_dir)
    else:
        compile_cache.disable()
    try:
        distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
        with preemption.time_limit(60 * FLAGS.time_limit_minutes):
            _run_mode(FLAGS.config.get("mode", "pretrain"))
    except preemption.TimeLimit as e:  # a checkpoint is saved; the same command continues
        absl_logging.warning("%s", e)
        sys.exit(TIME_LIMIT_STATUS)
    except preemption.Preempted as e:  # a checkpoint is saved; the same command continues
        absl_logging.warning("%s", e)
        sys.exit(PREEMPTED_STATUS)
    except errors.UserError as e:
        if FLAGS.debug:
            raise
        cli.fail(cli.one_line(e))


def _run_mode(mode: str) -> None:
    """The entry of the config's mode (see the module docstring)."""
    if mode == "finetune" and FLAGS.config.get("sweep"):
        finetune_sweep.run_sweep(FLAGS.config, FLAGS.workdir, FLAGS.allow_config_change)
    elif mode == "finetune":
        finetune_train.run(FLAGS.config, FLAGS.workdir, FLAGS.allow_config_change)
    elif mode == "rank":
        analysis_run.analyse(FLAGS.config, FLAGS.workdir)
    elif mode == "fill_mask":
        fill_mask_run.run(FLAGS.config, FLAGS.workdir)
    elif mode == "study":
        study_run.run(FLAGS.config, FLAGS.workdir)
    elif mode == "study_merge":
        study_merge.merge(FLAGS.config, FLAGS.workdir)
    elif mode == "study_pool":
        study_pool.pool(FLAGS.config, FLAGS.workdir)
    elif mode == "export":
        export_run.run(FLAGS.config, FLAGS.workdir)
    elif mode == "prepare":
        from maelm_jax.data import prepare  # Apache Beam: imported only for this mode

        pretrain_config.validate(FLAGS.config)
        prepare.run(pretrain_config.resolve_paths(FLAGS.config), FLAGS.workdir)
    else:
        # A time budget counts from the process's start (Python and JAX starting included).
        pretrain_train.train_and_evaluate(FLAGS.config, FLAGS.workdir, FLAGS.allow_config_change,
                                          started=time.monotonic() - budget.process_age())
        if FLAGS.config.train.fill_mask_examples and distributed.is_leader():
            fill_mask_run.after_pretraining(FLAGS.workdir)  # what the finished run learned


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
