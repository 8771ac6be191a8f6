"""Entry point: python main.py --config=configs/<file>.py[:variant] --workdir=<dir>.

Any config field can be overridden with --config.<field>=<value>.
"""

import logging
import pathlib

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from maelm_jax.training import loop

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", None, "Config file (file.py or file.py:variant).", lock_config=True
)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and prepared data.")
flags.DEFINE_bool("library_logs", False, "Also show other libraries' INFO logs (e.g. orbax).")
flags.mark_flags_as_required(["config", "workdir"])

_PROJECT_DIR = pathlib.Path(__file__).resolve().parent


class _ProjectInfoOnly(logging.Filter):
    """Orbax alone logs dozens of INFO lines per checkpoint; keep ours and every warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or pathlib.Path(
            record.pathname
        ).resolve().is_relative_to(_PROJECT_DIR)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    absl_logging.set_verbosity(absl_logging.INFO)
    if not FLAGS.library_logs:
        absl_logging.get_absl_handler().addFilter(_ProjectInfoOnly())
    loop.train_and_evaluate(FLAGS.config, FLAGS.workdir)


if __name__ == "__main__":
    app.run(main)
