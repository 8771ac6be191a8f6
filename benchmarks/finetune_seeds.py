r"""Fine-tuning time per run, alone and in a seed group (maelm_jax/finetune/seed_group.py):
what grid.seeds_per_program buys on this machine at a study's sizes.

    python benchmarks/finetune_seeds.py [--config=configs/study/gpu.py] [--runs=3] \
        [--steps=20 --repeats=5]

Builds the study's encoder (config.pretrain.model; random weights, which the time does not
depend on) under a two-class GLUE head, as fine-tuning builds it (finetune/setup.py), at
the study's fine-tuning batch and length, with the fine-tuning config's dropout, dtype and
attention kernel. It times the whole host loop of a run: each step's batches drawn and
padded (train.train_batches alone, seed_group.stacked_batches in a group), put on the
device and the step dispatched; `--steps` steps per measurement, `--repeats` measurements
alternating alone and grouped, medians. And one evaluation of `--eval_examples` sequences:
runs alone evaluate once each, a group once for all of them.

The sequences are random ids of random lengths from 8 to the study's max_seq_len, so the
batches fall into its buckets much as GLUE's sentence-pair tasks do; single sentences
(SST-2, CoLA) are shorter and their steps cheaper, which favours the group more.

Prints ms per step and per run of each, the speedup, and what the study's fine-tuning
costs either way (its tasks' runs at max_train_examples, upper bounds): the figures that
choose the study's finetune.seeds_per_program. Each run writes its record (recording.py) to
--record_dir; docs/finetuning.md's table is generated from the committed ones.
"""

from __future__ import annotations

import os
import statistics
import time
import types

import jax
import numpy as np
from absl import app, flags

from benchmarks import REPO_ROOT, harness, recording
from maelm_jax.finetune import config as finetune_config
from maelm_jax.finetune import data, heads, seed_group, tasks, train
from maelm_jax.finetune import encoder as finetune_encoder
from maelm_jax.finetune import setup as setup_lib
from maelm_jax.infra import cli, errors, records, sharding, timer
from maelm_jax.study import config as study_config
from maelm_jax.text import tokenizer

FLAGS = flags.FLAGS


def define_flags() -> None:
    cli.define_config(str(REPO_ROOT / "configs" / "study" / "gpu.py"),
                      "Study config file[:variant] whose model and fine-tuning sizes to time "
                      "(default: configs/study/gpu.py).", prefix=cli.program())
    harness.define_timing_flags(steps=20, benchmark="finetune_seeds")
    flags.DEFINE_integer("runs", 3, "Seeds in the group.", lower_bound=2)
    flags.DEFINE_integer("eval_examples", 2000, "Dev sequences in the timed evaluation.",
                         lower_bound=1)


def seed_config(study) -> object:
    """The fine-tuning config of the study's runs, from scratch (no checkpoint to read):
    the pretraining encoder's architecture, the study's fine-tuning sizes."""
    c = finetune_config.finetune_defaults()
    for field in ("num_layers", "d_model", "num_heads", "d_ff", "pre_ln", "rel_pos_buckets",
                  "rel_pos_max_distance", "rel_pos_bucket_fn"):
        c.model[field] = study.pretrain.model[field]
    c.model.max_positions = study.pretrain.data.seq_len
    f = study.finetune
    c.data.max_seq_len = f.max_seq_len
    c.train.update(batch_size=f.batch_size, learning_rate=f.learning_rate,
                   warmup_ratio=f.warmup_ratio, num_epochs=f.num_epochs)
    c.mesh.shape = (1, 1, 1)
    return c


def classification_task(c, split: tasks.Split):
    """What setup.build reads of a GLUE classification task."""
    return types.SimpleNamespace(
        train=split,
        model=lambda cfg: heads.SequenceClassifier(cfg, 2, c.model.classifier_dropout,
                                                   c.model.pooling),
        loss_sums=lambda outputs, batch: heads.classification_loss_sums(
            outputs, batch["labels"], batch["weights"]),
        eval_outputs=lambda outputs: {"prediction": outputs.argmax(-1)})


def random_split(n: int, max_len: int, vocab_size: int, seed: int) -> tasks.Split:
    rng = np.random.default_rng(seed)
    sequences = [rng.integers(tokenizer.NUM_SPECIAL, vocab_size, length).astype(np.int32)
                 for length in rng.integers(8, max_len + 1, n)]
    return tasks.Split(sequences, {"labels": rng.integers(0, 2, n).astype(np.int32)})


def main(argv) -> None:
    del argv
    harness.start_host_memory()
    study = FLAGS.config
    try:  # a bad field is one line naming it, as main.py gives it
        study_config.validate(study)
        c = seed_config(study)
        vocab_size = study.pretrain.tokenizer.vocab_size
        # Random ids above SentencePiece's five special ones (random_split's draws).
        encoder_cfg = finetune_encoder.build(
            c, finetune_encoder.scratch_architecture(c, vocab_size), tokenizer.SENTENCEPIECE_IDS)
    except errors.UserError as e:
        cli.fail(str(e), cli.program())
    max_len = c.data.max_seq_len
    buckets = data.buckets_for(max_len, c.data.buckets)
    t = c.train
    split = random_split(max(t.batch_size * 64, 1), max_len, vocab_size, 0)
    dev = random_split(FLAGS.eval_examples, max_len, vocab_size, 1)
    task = classification_task(c, split)
    steps_per_run = 10 ** 6  # the schedule's length; only its shape matters here
    seeds = tuple(range(1, FLAGS.runs + 1))
    what, peak = records.machine_speed()
    print(f"{harness.device_line()}, {os.cpu_count()} CPUs; {records.describe_speed(what, peak)}")
    print(f"encoder {c.model.num_layers} x {c.model.d_model} ({c.model.num_heads} heads, FFN "
          f"{c.model.d_ff}), |V|={vocab_size}, {jax.numpy.dtype(encoder_cfg.stack.dtype).name}, "
          f"attention {encoder_cfg.stack.attention_impl}; batch {t.batch_size}, lengths 8-"
          f"{max_len} (buckets {buckets}); a group of {len(seeds)} runs; {FLAGS.repeats} x "
          f"{FLAGS.steps} timed steps each")
    mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
    sides = {}
    schedule = setup_lib.schedule_of(t, steps_per_run)
    for name, group in (("alone", None), ("group", seeds)):
        program = setup_lib.build(c, encoder_cfg, task, steps_per_run, buckets[0], mesh=mesh,
                                  runs=group and setup_lib.Runs.of_seeds(group, schedule))
        state = program.state.init(None)
        if group is None:
            batches = (program.on_mesh(b) for _, b in train.train_batches(
                split, t.batch_size, buckets, 1, 10 ** 6, 0))
        else:
            batches = (program.stacked_on_mesh(b) for b in seed_group.stacked_batches(
                split, t.batch_size, buckets, group, 10 ** 6, 0))
        sides[name] = types.SimpleNamespace(program=program, batches=batches, times=[])
        start = time.perf_counter()
        with sharding.activate(program.mesh, program.rules):
            # Compiles the step (almost every batch of lengths up to max_seq_len pads to
            # the last bucket), then the untimed warm-up steps.
            for _ in range(1 + FLAGS.warmup):
                state, metrics = program.train_step(state, next(batches))
            jax.block_until_ready((state, metrics))
        sides[name].state = state
        sides[name].compile_seconds = time.perf_counter() - start
        print(f"  {name}: compiled and warmed up in {sides[name].compile_seconds:.1f} s")

    for r in range(FLAGS.repeats):
        for name in (("alone", "group") if r % 2 == 0 else ("group", "alone")):
            side = sides[name]
            with sharding.activate(side.program.mesh, side.program.rules):
                start = time.perf_counter()
                for _ in range(FLAGS.steps):
                    side.state, metrics = side.program.train_step(side.state, next(side.batches))
                jax.block_until_ready((side.state, metrics))
            side.times.append((time.perf_counter() - start) / FLAGS.steps)

    evals = {}
    for name, side in sides.items():
        run_eval = train.evaluator(side.program, t.eval_batch_size, buckets)(side.state.params)

        def evaluate(run_eval=run_eval):
            return run_eval(dev.sequences, dev.targets)
        _, evals[name] = timer.timed(evaluate, FLAGS.repeats)

    alone, group = (statistics.median(sides[n].times) for n in ("alone", "group"))
    runs = len(seeds)
    print()
    print(f"{'':6s} {'ms/step':>9s} {'ms per run-step':>16s} {'eval s':>8s} "
          f"{'eval s per run':>15s}")
    print(f"{'alone':6s} {1e3 * alone:9.2f} {1e3 * alone:16.2f} {evals['alone']:8.2f} "
          f"{evals['alone']:15.2f}")
    print(f"{'group':6s} {1e3 * group:9.2f} {1e3 * group / runs:16.2f} {evals['group']:8.2f} "
          f"{evals['group'] / runs:15.2f}")
    print(f"speedup per run: train steps {alone * runs / group:.2f}x, evaluation "
          f"{evals['alone'] * runs / evals['group']:.2f}x")
    steps = -(-study.finetune.max_train_examples // t.batch_size) * t.num_epochs
    print(f"one run of {steps} steps (max_train_examples {study.finetune.max_train_examples} x "
          f"{t.num_epochs} epochs / batch {t.batch_size}) trains in {steps * alone:.0f} s "
          f"alone, {steps * group / runs:.0f} s as one of a group of {runs} (evaluations "
          "not counted)")
    m = c.model
    recording.save("finetune_seeds", {
        "encoder": {"num_layers": m.num_layers, "d_model": m.d_model, "num_heads": m.num_heads,
                    "d_ff": m.d_ff, "vocab_size": vocab_size,
                    "dtype": jax.numpy.dtype(encoder_cfg.stack.dtype).name,
                    "attention_impl": encoder_cfg.stack.attention_impl},
        "batch_size": t.batch_size, "max_seq_len": max_len, "runs": runs,
        "repeats": FLAGS.repeats, "steps": FLAGS.steps, "eval_examples": FLAGS.eval_examples,
        "step_ms": {"alone": 1e3 * alone, "group": 1e3 * group}, "eval_seconds": evals,
        "compile_seconds": {name: side.compile_seconds for name, side in sides.items()}},
        (what, peak))


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.tool_flags_parser)
