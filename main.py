"""Entry point: python main.py --config=configs/<file>.py[:variant] --workdir=<dir>.

Pretraining configs (configs/pretrain/) run maelm_jax.training.loop; fine-tuning configs
(configs/finetune/, `mode = "finetune"`) run maelm_jax.finetune.train, or with
`sweep = True` maelm_jax.finetune.sweep; the effective-rank analysis
(configs/analysis/rank.py, `mode = "rank"`) runs maelm_jax.analysis.run; fill-mask
(configs/fill_mask.py, `mode = "fill_mask"`) runs maelm_jax.fill_mask; the laptop-scale
study (configs/study/mini.py, `mode = "study"`) runs maelm_jax.study.run. Each
mode's entry is picked here, so no module of maelm_jax has to import its caller.

Any config field can be overridden with --config.<field>=<value>.
"""

import logging
import os
import pathlib
import re
import sys

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from maelm_jax import distributed, errors, fill_mask
from maelm_jax.analysis import run as analysis_run
from maelm_jax.finetune import sweep as finetune_sweep
from maelm_jax.finetune import train as finetune_train
from maelm_jax.study import run as study_run
from maelm_jax.training import loop, preemption

FLAGS = flags.FLAGS
# New fields are accepted while parsing, so `--config.data.sources.main.path=...` can
# switch a source's kind from the command line; validation then refuses any field that
# the config kind does not have (a mistyped one), naming it (maelm_jax/schema.py).
config_flags.DEFINE_config_file(
    "config", None, "Config file (file.py or file.py:variant).", lock_config=False,
    accept_new_attributes=True,
)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and prepared data: a "
                    "local path or a bucket's gs://bucket/path.")
flags.DEFINE_bool("allow_config_change", False, "Continue a workdir's run even though the "
                  "config changes fields that its checkpoints depend on.")
flags.DEFINE_bool("debug", False, "Show the full traceback of configuration and data errors.")
flags.DEFINE_bool("library_logs", False, "Also show other libraries' INFO logs (e.g. orbax).")
flags.DEFINE_string("coordinator_address", "", "host:port of process 0, for multi-process "
                    "runs outside TPU pods and SLURM (which are detected automatically).")
flags.DEFINE_integer("num_processes", 0, "Number of processes (with --coordinator_address).")
flags.DEFINE_integer("process_id", -1, "This process's index (with --coordinator_address).")
flags.mark_flags_as_required(["config", "workdir"])

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


def _one_line(error: BaseException) -> str:
    """The message alone: config_flags wraps a config file's own error in its traceback."""
    text = str(error).strip()
    if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":  # a quoted repr
        text = text[1:-1]
    text = text.replace("\\n", "\n").replace("\\'", "'")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if "Traceback (most recent call last):" in text:
        # The last line is "<module>.<ExceptionClass>: message"; keep the message.
        message = re.sub(r"^[\w.]+(Error|Exception): ", "", lines[-1])
        return f"{lines[0].split(':')[0]}: {message}"
    return " ".join(lines)


def _config_file_error(argv) -> str | None:
    """A --config naming no file: config_flags would defer the error to a traceback."""
    values = [arg.split("=", 1)[1] for arg in argv[1:] if arg.startswith("--config=")]
    values += [argv[i + 1] for i, arg in enumerate(argv[1:-1], start=1) if arg == "--config"]
    if not values:
        return None
    path = values[-1].split(":", 1)[0]
    if not os.path.isfile(path):
        what = "is a directory" if os.path.isdir(path) else "does not exist"
        return (f"--config: {path} {what} (relative to {os.getcwd()}); expected a config file "
                "such as configs/pretrain/quickstart.py")
    return None


def _missing_section(argv, error: Exception) -> str | None:
    """An override through a section the config does not have (--config.modle.dropout, or
    a new source --config.data.sources.extra.kind): ml_collections says only the key."""
    if not isinstance(error, KeyError) or not error.args:
        return None
    match = re.match(r"""'([^']+)'(?:\s*Did you mean "([^"]+)")?""", str(error.args[0]))
    if not match:
        return None
    key, suggestion = match.groups()
    for arg in argv[1:]:
        parts = arg.split("=", 1)[0].removeprefix("--config.").split(".")
        if arg.startswith("--config.") and key in parts[:-1]:
            prefix = ".".join(["config", *parts[: parts.index(key)]])
            hint = f"; did you mean {prefix}.{suggestion}?" if suggestion else (
                "; a new section (such as another source) needs a config file")
            return f"{arg.split('=', 1)[0]}: {prefix} has no field {key!r}{hint}"
    return None


def _parse_flags(argv):
    """Flag and config-override mistakes (a mistyped field, a bad value, a broken config
    file) exit with one line instead of a traceback."""
    message = None if "--debug" in argv else _config_file_error(argv)
    if message is None:
        try:
            return FLAGS(argv)
        except Exception as e:  # config_flags raises whatever the config file or override did
            if "--debug" in argv:
                raise
            message = _missing_section(argv, e) or _one_line(e)
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    absl_logging.set_verbosity(absl_logging.INFO)
    if not FLAGS.library_logs:
        absl_logging.get_absl_handler().addFilter(_ProjectInfoOnly())
    try:
        distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
        mode = FLAGS.config.get("mode", "pretrain")
        if mode == "finetune" and FLAGS.config.get("sweep"):
            finetune_sweep.run_sweep(FLAGS.config, FLAGS.workdir)
        elif mode == "finetune":
            finetune_train.run(FLAGS.config, FLAGS.workdir)
        elif mode == "rank":
            analysis_run.analyse(FLAGS.config, FLAGS.workdir)
        elif mode == "fill_mask":
            fill_mask.run(FLAGS.config, FLAGS.workdir)
        elif mode == "study":
            study_run.run(FLAGS.config, FLAGS.workdir)
        else:
            loop.train_and_evaluate(FLAGS.config, FLAGS.workdir, FLAGS.allow_config_change)
    except preemption.Preempted as e:  # a checkpoint is saved: not a failure
        absl_logging.warning("%s", e)
    except errors.UserError as e:
        if FLAGS.debug:
            raise
        print(f"error: {_one_line(e)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
