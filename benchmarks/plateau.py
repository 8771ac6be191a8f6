r"""The unigram plateau at laptop scale (docs/plateau.md): the quickstart's model with the
papers' initialisation and with the quickstart's, MLM and MAE-LM, recorded.

    python benchmarks/plateau.py [--steps=2000] [--eval_every=1000] [--variants=mlm_local,...]

Each variant is ``python main.py --config=configs/pretrain/quickstart.py[:mlm]`` with its
overrides (VARIANTS), run for --steps on the built-in corpus in a fresh workdir, all
sharing one compilation cache; recorded: each evaluation's loss and masked-token accuracy
beside the unigram baseline's accuracy (the plateau: always predicting the most frequent
piece), the wall seconds, and the jitted fp32 matmul's speed. A model on the plateau
stays near the baseline at every evaluation; one that uses context leaves it.

Each run writes its record (recording.py) to --record_dir (default benchmarks/results/; ""
writes none); docs/plateau.md's table is generated from the newest committed one
(`python benchmarks/tables.py`).
"""

from __future__ import annotations

import json
import pathlib
import tempfile

from absl import app, flags

from benchmarks import cold_run, recording
from maelm_jax.infra import cli

CONFIG = "configs/pretrain/quickstart.py"
_NORMAL = "--config.model.rel_pos_init=normal"
# Key -> (the table's name, config variant, overrides of the quickstart's settings), in the
# table's order.
VARIANTS = {
    "mlm_normal": ("MLM, the papers' N(0, 0.02) bias", "mlm", [_NORMAL]),
    "mlm_normal_pre_ln": ("MLM, N(0, 0.02), pre-LN, lr 1e-2, no dropout", "mlm", [
        _NORMAL, "--config.model.pre_ln=true", "--config.train.learning_rate=1e-2",
        "--config.model.dropout=0", "--config.model.attention_dropout=0"]),
    "mlm_local": ("MLM, `rel_pos_init=local` (`quickstart.py:mlm`)", "mlm", []),
    "maelm_paper_decoder": ("MAE-LM, local encoder bias, the paper's decoder (no relative "
                            "bias)", "maelm", ["--config.model.decoder.rel_pos_buckets=0"]),
    "maelm_local": ("MAE-LM, local encoder and decoder bias (`quickstart.py`)", "maelm", []),
}

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_integer("steps", 2000, "Train steps of every variant.", lower_bound=1)
    flags.DEFINE_integer("eval_every", 1000, "Steps between evaluations.", lower_bound=1)
    flags.DEFINE_list("variants", list(VARIANTS), "The variants to run (keys of VARIANTS).")
    cli.choices_flag("variants", VARIANTS)
    recording.define_flag("plateau")


def run_variant(key: str, steps: int, eval_every: int, scratch: pathlib.Path) -> dict:
    """One variant trained in a fresh workdir: its evaluations and wall seconds."""
    name, variant, overrides = VARIANTS[key]
    workdir = scratch / key
    args = [f"--config={CONFIG}:{variant}", f"--workdir={workdir}",
            f"--config.train.num_steps={steps}", f"--config.train.eval_every={eval_every}",
            f"--config.train.checkpoint_every={steps}", "--config.train.fill_mask_examples=0",
            *overrides]
    timed = cold_run.run_main(args, scratch / "jax", "plateau.py")
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["split"] == "eval"]
    return {"key": key, "name": name, "overrides": [f"{CONFIG}:{variant}", *overrides],
            "seconds": timed["seconds"],
            "evals": [{"step": r["step"], "loss": r["loss"], "accuracy": r["accuracy"],
                       "unigram_accuracy": r["unigram_accuracy"]} for r in evals]}


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    with tempfile.TemporaryDirectory() as scratch:
        runs = [run_variant(v, FLAGS.steps, FLAGS.eval_every, pathlib.Path(scratch))
                for v in FLAGS.variants]
    for r in runs:
        cells = ", ".join(f"step {e['step']} {e['loss']:.2f} / {100 * e['accuracy']:.1f} %"
                          for e in r["evals"])
        print(f"{r['name']}: {cells} ({r['seconds']:.0f} s)")
    recording.save("plateau", {"config": CONFIG, "steps": FLAGS.steps,
                             "eval_every": FLAGS.eval_every, "variants": runs})


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.tool_flags_parser)
