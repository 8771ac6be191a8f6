"""Entry point: python main.py --config=configs/<file>.py[:variant] --workdir=<dir>.

Any config field can be overridden with --config.<field>=<value>.
"""

from absl import app, flags
from ml_collections import config_flags

from maelm_jax.training import loop

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Config file (file.py or file.py:variant).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and prepared data.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    loop.train_and_evaluate(FLAGS.config, FLAGS.workdir)


if __name__ == "__main__":
    app.run(main)
