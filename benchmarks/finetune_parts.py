r"""What fine-tuning a task costs the study besides its steps, per model or as one program:
the host time of its parts before and after sweep.run_models.

    python benchmarks/finetune_parts.py --config=configs/study/gpu.py:one_call \
        --config.glue_dir=DIR --tokenizer=runs/study_tokenizer/tokenizer.model [--task=SST-2]

A study fine-tunes every model and the control on a task. Trained per model (as the first
GPU call did), a task is one part per model and seed group, each with its fixed cost:
the task's data tokenised, the program built, its compiled steps loaded, a first step and
evaluation. Trained as one program (sweep.run_models), it is one part per seed group. For
both, this times a part the way the study's sizing does (maelm_jax/study/timing.py: the
program compiled, its steps timed, then a part started again, its programs from the
compilation cache) at the study's shapes, on the study's encoder with random weights,
and prints per task: parts, host seconds per part and in all, and the steps' seconds.
Each run writes its record (recording.py) to --record_dir; docs/finetuning.md's table is
generated from the committed ones.
"""

from __future__ import annotations

import math
import os
import tempfile

import jax
from absl import app, flags

from benchmarks import REPO_ROOT, harness, recording
from maelm_jax.infra import cli, errors, records
from maelm_jax.study import config as study_config
from maelm_jax.study import run as study_run
from maelm_jax.study import sizing, timing
from maelm_jax.text import tokenizer as tokenizer_lib

FLAGS = flags.FLAGS


def define_flags() -> None:
    cli.define_config(str(REPO_ROOT / "configs" / "study" / "gpu.py"),
                      "Study config file[:variant] whose fine-tuning to time (default: "
                      "configs/study/gpu.py); give --config.glue_dir.", prefix=cli.program())
    flags.DEFINE_string("tokenizer", "", "The study's sentencepiece model (required).")
    flags.DEFINE_string("task", "", "The GLUE task to time (default: the study's first).")
    flags.DEFINE_integer("repeats", 3, "Timed steps per program, after the one that "
                         "compiles.", lower_bound=1)
    recording.define_flag("finetune_parts")


def _check(study) -> tuple[str, tokenizer_lib.Tokenizer]:
    """(the task, the tokenizer), or one line naming the flag or field."""
    study_config.validate(study)
    if not FLAGS.tokenizer or not os.path.isfile(FLAGS.tokenizer):
        raise errors.UserError(f"--tokenizer: expected a sentencepiece .model file, got "
                               f"{FLAGS.tokenizer!r}")
    if not study.glue_dir:
        raise errors.UserError("--config.glue_dir: expected the GLUE directory")
    task = FLAGS.task or study_config.names(study.tasks)[0]
    if task not in study_config.GLUE_TASKS:
        raise errors.UserError(f"--task: expected one of {', '.join(study_config.GLUE_TASKS)}, "
                               f"got {task!r}")
    if not os.path.isfile(os.path.join(study.glue_dir, task, "train.tsv")):
        raise errors.UserError(f"--config.glue_dir: {study.glue_dir}/{task}/train.tsv is "
                               "missing")
    return task, tokenizer_lib.load_tokenizer(FLAGS.tokenizer)


def main(argv) -> None:
    del argv
    study = FLAGS.config
    try:
        task, tok = _check(study)
    except errors.UserError as e:
        cli.fail(str(e), cli.program())
    names = study_config.names(study.models)
    trained = names + ([study_run.SCRATCH] if study.scratch else [])
    pretrain = study_config.model_config(study, names[0])
    c = study_run.sweep_config(study, task, "")
    seeds = tuple(study.seeds)[:study.finetune.seeds_per_program]
    groups = math.ceil(len(study.seeds) / study.finetune.seeds_per_program)
    train_rows, _ = sizing.task_rows(study, task)
    f = study.finetune
    steps = f.num_epochs * math.ceil(train_rows / f.batch_size)
    what, peak = records.machine_speed()
    print(f"{harness.device_line()}, {os.cpu_count()} CPUs; {records.describe_speed(what, peak)}")
    m = pretrain.model
    print(f"{task}: {train_rows} examples, {steps} steps a run; encoder {m.num_layers} x "
          f"{m.d_model}, batch {f.batch_size}, {f.max_seq_len} tokens; {len(trained)} models "
          f"x {len(seeds)} seeds a group, {groups} group(s)")
    sides = {"per model": [(n,) for n in trained], "one program": [tuple(trained)]}
    figures = {}
    with tempfile.TemporaryDirectory() as cache:
        # A fresh compilation cache, as on a lent machine: the second start finds it.
        jax.config.update("jax_compilation_cache_dir", cache)
        for side, programs in sides.items():
            models = programs[0]
            keys = tuple(f"{n}/seed_{s}" for n in models for s in seeds)
            compile_s, step_s, _, part_s = timing.time_finetuning(
                pretrain, c, tok, keys, tuple(s for _ in models for s in seeds), FLAGS.repeats)
            parts = len(programs) * groups
            figures[side] = {"parts": parts, "runs_per_program": len(keys),
                             "compile_seconds": compile_s, "step_seconds": step_s,
                             "part_seconds": part_s, "host_seconds": parts * part_s,
                             "steps_seconds": parts * steps * step_s}
    print(f"\n{'':12s} {'parts':>5s} {'runs':>5s} {'compile s':>9s} {'ms/step':>8s} "
          f"{'s/part':>7s} {'host s':>7s} {'steps s':>8s}")
    for side, r in figures.items():
        print(f"{side:12s} {r['parts']:5d} {r['runs_per_program']:5d} "
              f"{r['compile_seconds']:9.1f} {1e3 * r['step_seconds']:8.2f} "
              f"{r['part_seconds']:7.2f} {r['host_seconds']:7.1f} {r['steps_seconds']:8.1f}")
    recording.save("finetune_parts", {
        "task": task, "train_rows": train_rows, "steps_per_run": steps,
        "encoder": {"num_layers": m.num_layers, "d_model": m.d_model,
                    "vocab_size": tok.vocab_size},
        "batch_size": f.batch_size, "max_seq_len": f.max_seq_len, "models": trained,
        "seeds_per_group": len(seeds), "groups": groups, "sides": figures}, (what, peak))


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.tool_flags_parser)
