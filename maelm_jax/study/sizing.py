"""A study sized to the time there is: `plan(...)`, and the timing model behind it.

A lent accelerator is held for minutes, so a study that is to finish in one command must
know, before it starts, how long its parts take on that machine. `plan` measures them: it
compiles and times each model's pretraining train step and the fine-tuning step of a seed
group (the programs the study then runs, so JAX's compilation cache finds them again),
then predicts the study's wall time with `predict` and sets every model's pretraining
steps (config.pretrain.train.num_steps at most, each model's config.step_scale applied,
rounded down to sizing.step_multiple) so that the prediction ends within the time left.
The plan is written to <workdir>/sizing.json and reused when the study resumes.

The timing model (`predict`): each model's pretraining is its steps times its measured
step time, plus one evaluation at the end; the rank analysis is a few forward passes per
model; each task's fine-tuning is, for each pretrained model and the control, its seed
groups' steps times the measured group step time plus its evaluations, plus what a part
adds besides (its data, its trainer, loading its programs, timed by starting one again);
the compilations the measurement did not cover (each distinct fine-tuning encoder's
programs per head kind, the other programs of each model); and sizing.overhead_seconds
for what is not timed (start-up, the corpus, saves, the reports). study.json records the
prediction beside the wall time the call took, so each call checks the model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from collections.abc import Callable

import jax
import ml_collections
import numpy as np
from absl import logging

from maelm_jax import errors, layout, paths, runs, sharding
from maelm_jax import tokenizer as tokenizer_lib
from maelm_jax.finetune import data as finetune_data
from maelm_jax.finetune import seed_group, tasks
from maelm_jax.finetune import setup as finetune_setup
from maelm_jax.finetune import train as finetune_train
from maelm_jax.finetune.tasks import glue
from maelm_jax.pretrain import setup as setup_lib
from maelm_jax.study import config as study_config
from maelm_jax.training import preemption


class SizingError(errors.UserError):
    """A study that cannot be sized (no time limit, or too little time)."""


@dataclasses.dataclass
class Timing:
    """What was measured on this machine, in seconds."""

    pretrain_step: dict[str, float]  # per model, one train step
    pretrain_compile: dict[str, float]  # per model, compiling its train step
    finetune_step: float  # one train step of a seed group
    finetune_eval: float  # one eval batch
    finetune_compile: float  # the train and eval steps
    # What a fine-tuning part adds besides its steps and evaluations: its task data, its
    # trainer, loading its programs (compiling them without a compilation cache), the
    # first step and evaluation. On an H200 it was ~7.5 s a part, 2.5x the steps of a
    # part of MRPC: the first one-call study's model left it out and ran out of time.
    finetune_part: float
    # Distinct encoders among the models as fine-tuning rebuilds them (3ML_cross is
    # pre-LN): each compiles its own programs per head kind.
    finetune_encoders: int
    measuring: float  # the whole measurement, compiles included


def _timed(step: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(the first call's seconds less one step's, the median step) of `step`, which
    returns what to wait for."""
    start = time.perf_counter()
    jax.block_until_ready(step())
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step())
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return max(first - median, 0.0), median


def time_pretraining(c: ml_collections.ConfigDict, vocab_size: int,
                     repeats: int) -> tuple[float, float]:
    """(compile seconds, step seconds) of the train step `c` describes, on random tokens."""
    trainer = setup_lib.build(c, vocab_size)
    state = [trainer.init()]
    rows = np.random.default_rng(0).integers(
        tokenizer_lib.NUM_SPECIAL, vocab_size, (c.train.batch_size, c.data.seq_len))
    batch = sharding.global_batch_from_full(rows.astype(np.int32), trainer.mesh)

    def step():
        state[0], metrics = trainer.train_step(state[0], batch)
        return metrics

    with sharding.activate(trainer.mesh, trainer.rules):
        return _timed(step, repeats)


def finetune_encoder(pretrain: ml_collections.ConfigDict, c: ml_collections.ConfigDict,
                     vocab_size: int):
    """The encoder of `pretrain` as a fine-tuning part with config `c` rebuilds it from the
    pretraining checkpoint (finetune/train.py): timed alike, the measured program is the one
    the parts find again in the compilation cache."""
    m = c.model
    return finetune_train.with_kernel(c, runs.pretrained_encoder(
        pretrain.to_dict(), vocab_size, dropout=m.dropout,
        attention_dropout=m.attention_dropout, dtype=m.dtype))


def time_finetuning(study: ml_collections.ConfigDict, pretrain: ml_collections.ConfigDict,
                    c: ml_collections.ConfigDict, tok: tokenizer_lib.Tokenizer,
                    repeats: int) -> tuple[float, float, float, float]:
    """(compile seconds, seconds per train step of a seed group, seconds per eval batch,
    seconds a part adds besides its steps and evaluations) of fine-tuning `pretrain`'s
    encoder with the study's fine-tuning config `c` of a task (its first seed group, one
    bucket of finetune.max_seq_len). The last is timed by doing what each part does once
    more: its task data, its trainer, its programs (from the compilation cache, where there
    is one), a first step and a first evaluation."""
    c = c.copy_and_resolve_references()
    c.train.update(learning_rate=study.finetune.learning_rate,
                   batch_size=study.finetune.batch_size, num_epochs=1,
                   warmup_ratio=study.finetune.warmup_ratio)
    c.tokenizer_path = tok.model_path
    max_len = study.finetune.max_seq_len
    encoder = finetune_encoder(pretrain, c, tok.vocab_size)
    seeds = tuple(study.seeds)[:study.finetune.seeds_per_program]
    buckets = (max_len,)

    def part():
        """A part's start: (trainer, [state], a train batch, an eval batch)."""
        task_data = tasks.make_task(c, tok, max_len)
        trainer = finetune_setup.build(c, encoder, task_data, 1000, max_len,
                                       seeds=seeds if len(seeds) > 1 else None)
        if len(seeds) > 1:
            arrays = next(seed_group.stacked_batches(task_data.train, c.train.batch_size,
                                                     buckets, seeds, 1, 0))
            batch = trainer.stacked_on_mesh(arrays)
        else:
            batch = trainer.on_mesh(next(finetune_train.train_batches(
                task_data.train, c.train.batch_size, buckets, seeds[0], 1, 0))[1])
        split = task_data.eval_splits()[0]
        eval_batch = trainer.on_mesh(next(iter(finetune_data.eval_batches(
            split.sequences, split.targets, c.train.eval_batch_size, buckets))))
        return trainer, [trainer.state.init(None)], batch, eval_batch

    trainer, state, batch, eval_batch = part()

    def step():
        state[0], metrics = trainer.train_step(state[0], batch)
        return metrics

    with sharding.activate(trainer.mesh, trainer.rules):
        compile_train, step_seconds = _timed(step, repeats)
        compile_eval, eval_seconds = _timed(
            lambda: trainer.eval_step(state[0].params, eval_batch), repeats)
    start = time.perf_counter()
    trainer, state, batch, eval_batch = part()
    with sharding.activate(trainer.mesh, trainer.rules):
        jax.block_until_ready(step())  # the state is donated: step() keeps the new one
        jax.block_until_ready(trainer.eval_step(state[0].params, eval_batch))
    again = time.perf_counter() - start - step_seconds - eval_seconds
    return compile_train + compile_eval, step_seconds, eval_seconds, max(again, 0.0)


def measure(study: ml_collections.ConfigDict, configs: dict[str, ml_collections.ConfigDict],
            tasks_found: list[str], tok: tokenizer_lib.Tokenizer,
            sweep_config: Callable[[str], ml_collections.ConfigDict]) -> Timing:
    """Times every model's pretraining step and (with GLUE tasks) the fine-tuning step of
    the first task (`sweep_config(task)`: the study's fine-tuning config of it)."""
    start = time.perf_counter()
    repeats = study.sizing.measure_steps
    compiles, steps = {}, {}
    for name, c in configs.items():
        compiles[name], steps[name] = time_pretraining(c, tok.vocab_size, repeats)
        logging.info("study sizing: %s compiles in %.1f s, steps in %.4f s", name,
                     compiles[name], steps[name])
    ft_compile = ft_step = ft_eval = ft_part = 0.0
    encoders = 0
    if tasks_found:
        first = configs[next(iter(configs))]
        c = sweep_config(tasks_found[0])
        ft_compile, ft_step, ft_eval, ft_part = time_finetuning(study, first, c, tok, repeats)
        encoders = len({repr(finetune_encoder(m, c, tok.vocab_size)) for m in configs.values()})
        logging.info("study sizing: fine-tuning compiles in %.1f s, steps in %.4f s, "
                     "evaluates a batch in %.4f s, a part adds %.1f s; %d distinct "
                     "encoder(s)", ft_compile, ft_step, ft_eval, ft_part, encoders)
    return Timing(steps, compiles, ft_step, ft_eval, ft_compile, ft_part, encoders,
                  time.perf_counter() - start)


def task_rows(study: ml_collections.ConfigDict, task: str) -> tuple[int, int]:
    """(training examples the study uses, dev examples) of a GLUE task."""
    spec = glue.examples.get_task(study_config.GLUE_TASKS[task])
    train = len(glue.examples.read_tsv(study.glue_dir, spec, "train"))
    limit = study.finetune.max_train_examples
    dev = len(glue.examples.read_tsv(study.glue_dir, spec, "dev"))
    return (min(train, limit) if limit else train), dev


def predict(study: ml_collections.ConfigDict, timing: Timing, steps: dict[str, int],
            rows: dict[str, tuple[int, int]], trained: int) -> dict[str, float]:
    """The timing model: predicted seconds of each part of the study ({"pretrain",
    "rank", "finetune", "compile", "overhead", "total"}), for `steps` of pretraining per
    model, tasks of `rows` (train, dev examples) and `trained` fine-tuned per task (the
    models and the control)."""
    p, f = study.pretrain, study.finetune
    pretrain = sum(steps[m] * timing.pretrain_step[m]
                   # one evaluation at the end, a forward pass per batch
                   + p.train.eval_batches * timing.pretrain_step[m] / 3
                   for m in steps)
    rank = 0.0
    if study.rank:
        tokens = study.rank_tokens or 100 * p.model.d_model
        batches = math.ceil(tokens / p.data.seq_len / p.train.batch_size)
        # With and without [MASK], a forward pass per batch.
        rank = sum(2 * batches * timing.pretrain_step[m] / 3 for m in steps)
    groups = math.ceil(len(study.seeds) / f.seeds_per_program)
    finetune = 0.0
    for train_rows, dev_rows in rows.values():
        per_group = (f.num_epochs * math.ceil(train_rows / f.batch_size) * timing.finetune_step
                     + f.num_epochs * math.ceil(dev_rows / 64) * timing.finetune_eval
                     * f.seeds_per_program + timing.finetune_part)
        finetune += trained * groups * per_group
    out = {"pretrain": pretrain, "rank": rank, "finetune": finetune,
           "compile": compile_seconds(study, timing, rows),
           "overhead": study.sizing.overhead_seconds}
    out["total"] = sum(out.values())
    return out


# Compiling what the measurement did not, as a share of what it did: per model its
# initialisation, evaluation and rank-analysis programs beside its train step; per
# fine-tuning program (an encoder and a head kind) its initialisation beside the train and
# eval steps. Both agree with the first one-call study on an H200 (pretraining and the rank
# analysis 179 s predicted, 178 s taken; a fine-tuning program not in the cache ~1.4x the
# measured compile).
PRETRAIN_OTHER_PROGRAMS = 0.8
FINETUNE_OTHER_PROGRAMS = 0.5


def compile_seconds(study: ml_collections.ConfigDict, timing: Timing,
                    rows: dict[str, tuple[int, int]]) -> float:
    """Compiling the study's programs after the measurement. With JAX's compilation cache
    (main.py turns it on) the measured ones are found again, the others compile once: per
    model its other programs as a share of its train step's; per fine-tuning program (each
    distinct encoder for each head kind: a regression task, STS-B, has its own) the train
    and eval steps less the one measured, and their other programs. Without a cache every
    program compiles again, and each fine-tuning part's share is in timing.finetune_part."""
    cached = bool(jax.config.jax_compilation_cache_dir)
    pretrain = sum(timing.pretrain_compile.values())
    kinds = len({glue.examples.get_task(study_config.GLUE_TASKS[t]).is_regression for t in rows})
    programs = timing.finetune_encoders * kinds
    if not cached:
        return pretrain * (1 + PRETRAIN_OTHER_PROGRAMS)
    return (PRETRAIN_OTHER_PROGRAMS * pretrain
            + timing.finetune_compile * (max(programs - 1, 0)
                                         + FINETUNE_OTHER_PROGRAMS * programs))


def apply(configs: dict[str, ml_collections.ConfigDict], steps: dict[str, int]) -> None:
    """Sets each model's pretraining to its planned steps: warmup in proportion, one
    evaluation and one checkpoint at the end (a stop request saves too)."""
    for name, c in configs.items():
        t = c.train
        t.warmup_steps = round(t.warmup_steps * steps[name] / t.num_steps)
        t.num_steps = steps[name]
        t.eval_every = t.checkpoint_every = steps[name]
        t.log_every = min(t.log_every, steps[name])


def plan(study: ml_collections.ConfigDict, configs: dict[str, ml_collections.ConfigDict],
         tasks_found: list[str], tok: tokenizer_lib.Tokenizer, root: paths.Path,
         trained: int, sweep_config: Callable[[str], ml_collections.ConfigDict]) -> dict:
    """The sizing of this study (measured now, or read back from <root>/sizing.json when
    the study resumes), applied to `configs`; what study.json records of it. `trained`:
    what is fine-tuned per task (the models and the control); `sweep_config(task)`:
    the study's fine-tuning config of a task."""
    path = root / layout.STUDY_SIZING_FILE
    if path.is_file():
        planned = json.loads(paths.read_text(path))
        apply(configs, planned["steps"])
        logging.info("study sizing: reusing %s (steps %s)", path, planned["steps"])
        return planned
    s = study.sizing
    budget = min(preemption.time_left(), s.budget_seconds or math.inf)
    if math.isinf(budget):
        raise SizingError("config.sizing.enabled: the study is sized to a time limit; give "
                          "--time_limit_minutes or config.sizing.budget_seconds")
    timing = measure(study, configs, tasks_found, tok, sweep_config)
    rows = {t: task_rows(study, t) for t in tasks_found}
    configured = study.pretrain.train.num_steps
    fixed = predict(study, timing, dict.fromkeys(configs, 0), rows, trained)
    # Time per base step of pretraining: every model's share of it.
    per_step = sum(study.step_scale.get(m, 1.0) * timing.pretrain_step[m] for m in configs)
    left = budget - timing.measuring - study.reserve_seconds - fixed["total"]
    base = min(configured, int(left / per_step) // s.step_multiple * s.step_multiple)
    if base < s.min_steps:
        raise SizingError(
            f"config.sizing: {budget:.0f} s leave time for {max(base, 0)} pretraining steps, "
            f"fewer than config.sizing.min_steps={s.min_steps} (fine-tuning and the rest are "
            f"predicted to take {fixed['total']:.0f} s); give more time, fewer tasks or seeds")
    steps = {m: study_config.scaled_steps(study, m, base) for m in configs}
    predicted = predict(study, timing, steps, rows, trained)
    predicted["measuring"] = timing.measuring
    predicted["total"] += timing.measuring
    planned = {"budget_seconds": budget, "base_steps": base, "steps": steps,
               "timing": dataclasses.asdict(timing), "task_rows": rows,
               "predicted_seconds": predicted}
    paths.write_text(path, json.dumps(planned, indent=2))
    apply(configs, steps)
    logging.info("study sizing: %d base pretraining steps (%s) predicted to take %.0f s of "
                 "%.0f", base, ", ".join(f"{m} {n}" for m, n in steps.items()),
                 predicted["total"], budget)
    return planned
