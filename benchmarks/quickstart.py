r"""The README's first command, as a new user runs it: wall time, peak memory and where the
model ends, recorded.

    python benchmarks/quickstart.py [--config=configs/pretrain/quickstart.py] [-- --config.x=y]

Runs ``python main.py --config=<config> --workdir=<fresh directory>`` cold (cold_run.py: a
process of its own, an empty compilation cache), after the ``pip install`` (not timed: it
depends on the network). Recorded: the wall seconds, the process's peak resident memory,
the steps, the first logged train loss and the last evaluation (loss, masked-token
accuracy and the unigram baseline's accuracy, the plateau a small model must leave),
beside the jitted fp32 matmul's speed, which the seconds are read against. Arguments
after ``--`` go to main.py (e.g. a shorter run for a test).

Each run writes its record (recording.py) to --record_dir (default benchmarks/results/; ""
writes none); README.md's table is generated from the committed ones
(`python benchmarks/tables.py`).
"""

from __future__ import annotations

import json
import pathlib
import tempfile

from absl import app, flags

from benchmarks import cold_run, recording
from maelm_jax.infra import cli

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("config", "configs/pretrain/quickstart.py", "The config main.py runs.")
    recording.define_flag("quickstart")


def _lines(path: pathlib.Path, split: str) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if r["split"] == split]


def measure(config: str, extra: list[str]) -> dict:
    """Runs main.py on `config` in a fresh workdir and compilation cache; its figures."""
    with tempfile.TemporaryDirectory() as scratch:
        workdir = pathlib.Path(scratch) / "run"
        timed = cold_run.run_main([f"--config={config}", f"--workdir={workdir}", *extra],
                                  pathlib.Path(scratch) / "jax", "quickstart.py")
        train = _lines(workdir / "metrics.jsonl", "train")
        evals = _lines(workdir / "metrics.jsonl", "eval")
        run_config = json.loads((workdir / "config.json").read_text())
    last = evals[-1]
    return {
        "command": " ".join(["python", "main.py", f"--config={config}",
                             "--workdir=runs/quickstart", *extra]),
        "objective": run_config["objective"],
        "steps": run_config["train"]["num_steps"],
        **timed,
        "first_train_loss": train[0]["loss"],
        "vocab_size": run_config["tokenizer"]["vocab_size"],
        "eval": {"step": last["step"], "loss": last["loss"], "accuracy": last["accuracy"],
                 "unigram_accuracy": last["unigram_accuracy"]},
    }


def main(argv):
    figures = measure(FLAGS.config, argv[1:])
    e = figures["eval"]
    print(f"{figures['command']}: {figures['seconds']:.0f} s, peak {figures['peak_gb']:.2f} GB; "
          f"step {e['step']}: loss {figures['first_train_loss']:.2f} -> {e['loss']:.2f}, "
          f"accuracy {e['accuracy']:.3f} (unigram {e['unigram_accuracy']:.3f})")
    recording.save("quickstart", figures)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.forwarding_flags_parser)
