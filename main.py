"""Entry point: python main.py --config=configs/<file>.py[:variant] --workdir=<dir>.

The config's `mode` picks what runs: `MODES` below is the one list of the modes, each with
its configs and its entry (one signature for all), so no module of maelm_jax has to import
its caller. Any config field can be overridden with --config.<field>=<value>.
"""

import contextlib
import dataclasses
import logging
import os
import pathlib
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
from absl import app, flags
from absl import logging as absl_logging

from maelm_jax.analysis import run as analysis_run
from maelm_jax.export import run as export_run
from maelm_jax.fill_mask import run as fill_mask_run
from maelm_jax.finetune import sweep as finetune_sweep
from maelm_jax.finetune import train as finetune_train
from maelm_jax.infra import cli, compile_cache, distributed, errors, host_memory, paths, stacks
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.pretrain import train as pretrain_train
from maelm_jax.study import merge as study_merge
from maelm_jax.study import pool as study_pool
from maelm_jax.study import run as study_run
from maelm_jax.training import budget, preemption
from maelm_jax.workdirs import lock

FLAGS = flags.FLAGS
# New fields are accepted while parsing, so `--config.data.sources.main.path=...` can
# switch a source's kind from the command line; validation then refuses any field that
# the config kind does not have (a mistyped one), naming it (maelm_jax/config/schema.py).
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
                  "sixth faster; maelm_jax/infra/host_memory.py). Linux with glibc only.")
flags.DEFINE_bool("compilation_cache", True, "Keep compiled programs (and XLA's autotuning "
                  "results) on disk, so that the next run of the same program compiles in "
                  "seconds (maelm_jax/infra/compile_cache.py).")
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
# Exit status of a run stopped by Ctrl-C: 128 + SIGINT, what a shell reports for it.
INTERRUPTED_STATUS = 130

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


class _NoInterruptTracebacks(logging.Filter):
    """A library that logs the exception it was interrupted in (orbax's wait for a save's
    finalize thread, at a second Ctrl-C during the save) would print the interrupt's
    traceback before main.py's one line about it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and record.exc_info[1] is not None
                    and errors.interrupted(record.exc_info[1]))


def main(argv):
    del argv  # cli.parse_flags refuses stray arguments
    if FLAGS.keep_host_memory:
        host_memory.keep_freed_memory()  # before JAX's backend starts its threads
    absl_logging.set_verbosity(absl_logging.INFO)
    absl_logging.get_absl_handler().addFilter(_NoInterruptTracebacks())
    if not FLAGS.library_logs:
        absl_logging.get_absl_handler().addFilter(_ProjectInfoOnly())
    if FLAGS.compilation_cache:
        compile_cache.enable(FLAGS.compilation_cache_dir)
    else:
        compile_cache.disable()
    preemption.raise_on_ctrl_c()
    try:
        distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
        stacks.on_signal()  # kill -USR1: every thread's stack to stderr (docs/scaling.md)
        if jax.process_count() == 1:  # else JAX's preemption service owns SIGTERM
            preemption.raise_on_sigterm()
        with preemption.time_limit(60 * FLAGS.time_limit_minutes):
            _run_mode(FLAGS.config.get("mode", "pretrain"))
    except preemption.TimeLimit as e:  # a checkpoint is saved; the same command continues
        absl_logging.warning("%s", e)
        sys.exit(TIME_LIMIT_STATUS)
    except preemption.Interrupted as e:  # a checkpoint is saved; the same command continues
        absl_logging.warning("%s", e)
        sys.exit(INTERRUPTED_STATUS)
    except preemption.Preempted as e:  # a checkpoint is saved; the same command continues
        absl_logging.warning("%s", e)
        sys.exit(PREEMPTED_STATUS)
    except errors.UserError as e:
        if FLAGS.debug:
            raise
        cli.fail(cli.one_line(e))
    except (KeyboardInterrupt, errors.Terminated) as e:
        # Ctrl-C or SIGTERM outside a training loop, or a second Ctrl-C inside one.
        _stopped(e)
    except Exception as e:
        if errors.interrupted(e) is None or FLAGS.debug:
            raise
        _stopped(errors.interrupted(e))  # a library that wrapped the interrupt


def _stopped(signal: BaseException) -> None:
    """One line and the status of the signal, whatever library threads are still at work
    (an orbax save being finalised would print its own traceback on the way out)."""
    if FLAGS.debug:
        raise signal
    threading.excepthook = lambda args: None
    logging.getLogger().setLevel(logging.CRITICAL)
    absl_logging.set_verbosity(absl_logging.FATAL)
    how = "Ctrl-C" if isinstance(signal, KeyboardInterrupt) else "SIGTERM"
    print(f"{'interrupted' if how == 'Ctrl-C' else 'terminated'} ({how}): the work since "
          "the last checkpoint is lost; the same command starts again or continues from it",
          file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    # Not sys.exit: the interpreter's teardown while a library's thread is still in C++
    # (an orbax save being finalised) can abort the process (status -6, "terminate
    # called") after the line. Everything of ours was closed on the way here; a save cut
    # short is a temporary directory that is never taken for a checkpoint.
    os._exit(INTERRUPTED_STATUS if how == "Ctrl-C" else PREEMPTED_STATUS)


Entry = Callable[[ml_collections.ConfigDict, str, bool], Any]


@dataclasses.dataclass(frozen=True)
class Mode:
    """A mode main.py runs: the configs that ask for it, what it does, and its entry,
    entry(config, workdir, allow_config_change)."""

    configs: str
    does: str
    entry: Entry
    # Whether it writes --workdir, and so holds it while it runs (workdirs/lock.py).
    writes_workdir: bool = True


def _pretrain(config: ml_collections.ConfigDict, workdir: str, allow_config_change: bool):
    # A time budget counts from the process's start (Python and JAX starting included).
    pretrain_train.train_and_evaluate(config, workdir, allow_config_change,
                                      started=time.monotonic() - budget.process_age())
    if config.train.fill_mask_examples and distributed.is_leader():
        fill_mask_run.after_pretraining(workdir)  # what the finished run learned


def _prepare(config: ml_collections.ConfigDict, workdir: str, allow_config_change: bool):
    del allow_config_change  # nothing is recorded to change
    from maelm_jax.data import prepare  # Apache Beam: imported only for this mode

    pretrain_config.validate(config)
    prepare.run(pretrain_config.resolve_paths(config), workdir)


def _finetune(config: ml_collections.ConfigDict, workdir: str, allow_config_change: bool):
    if config.get("sweep"):
        return finetune_sweep.run_sweep(config, workdir, allow_config_change)
    return finetune_train.run(config, workdir, allow_config_change)


def _without_override(entry: Callable[[ml_collections.ConfigDict, str], Any]) -> Entry:
    """The entry of a mode whose workdir records nothing a changed config could conflict
    with (it is written anew, or refused, by the mode itself)."""
    return lambda config, workdir, allow_config_change: entry(config, workdir)


MODES: dict[str, Mode] = {
    "pretrain": Mode("configs/pretrain/", "pretrain an encoder: MAE-LM, 3ML or MLM",
                     _pretrain),
    "prepare": Mode("configs/pretrain/ with --config.mode=prepare", "write a pretraining "
                    "corpus as block shards with Apache Beam, for later runs' data.prepared",
                    _prepare),
    "finetune": Mode("configs/finetune/", "fine-tune an encoder on a GLUE task or SQuAD "
                     "2.0; a grid of settings and seeds with sweep=True", _finetune),
    "rank": Mode("configs/analysis/rank.py", "the effective rank of runs' encoders, layer "
                 "by layer (the MAE-LM paper's Fig. 1, Table 3)",
                 _without_override(analysis_run.analyse)),
    "fill_mask": Mode("configs/fill_mask.py", "fill [MASK] in texts with a pretraining run",
                      _without_override(fill_mask_run.run), writes_workdir=False),
    "study": Mode("configs/study/", "the objectives pretrained alike, their ranks and GLUE "
                  "against a from-scratch control", _without_override(study_run.run)),
    "study_merge": Mode("configs/study/merge.py", "merge a study's parts run apart",
                        _without_override(study_merge.merge)),
    "study_pool": Mode("configs/study/pool.py", "pool the study's calls into its claims",
                       _without_override(study_pool.pool)),
    "export": Mode("configs/export.py", "a run exported for Hugging Face transformers",
                   _without_override(export_run.run)),
}


def _run_mode(mode: str) -> None:
    """The entry of the config's mode (a config without `mode` is pretraining's; its
    validation refuses an unknown one)."""
    chosen = MODES.get(mode, MODES["pretrain"])
    hold = (lock.held_by_leader(paths.resolve(FLAGS.workdir, "--workdir"))
            if chosen.writes_workdir else contextlib.nullcontext())
    with hold:  # one run per workdir: a second start is refused before it writes
        chosen.entry(FLAGS.config, FLAGS.workdir, FLAGS.allow_config_change)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
