"""A study sized to the time there is: `plan(...)`, and the timing model behind it.

A lent accelerator is held for minutes, so a study that is to finish in one command must
know, before it starts, how long its parts take on that machine. `plan` measures them
(maelm_jax/study/timing.py: each model's pretraining, the rank analysis and a task's
fine-tuning program, built as the parts build them, so JAX's compilation cache finds them
again), predicts the study's wall time with `predict`, and sets every model's pretraining
steps (config.pretrain.train.num_steps at most, each model's config.step_scale applied,
rounded down to sizing.step_multiple; the warmup the same share of them as configured) so
that the prediction ends within the time left. The plan is written to
<workdir>/sizing.json and reused when the study resumes.

The timing model (`predict`), every term measured on this machine:
* each model's pretraining: its steps times its step, plus what its part adds (its
  program built, its compiled steps from the cache, the final evaluation and checkpoint);
* the rank analysis: its measured time per model, and reading each model back from its
  checkpoint (measured on a checkpoint written and read at the start);
* each task: one fine-tuning part per program instance (`finetune_programs`: the models
  and the control whose encoders are one, per seed group, as sweep.run_models groups
  them), each its steps times the program's step (scaled by its runs where they differ
  from the measured program's) plus its evaluations (an eval batch scores every run at
  once) plus what a part adds;
* compiling each distinct fine-tuning program other than the measured one;
* config.sizing.overhead_seconds for what no measurement covers (the reports and plots).
What happened before the plan (start-up, the tokenizer, reading and packing the corpus)
is already spent: the time left is what the plan divides. The reserve kept at the end is
at least the longest stretch that cannot be stopped once started (the rank analysis, a
pretraining part's end, a fine-tuning part's evaluation), so a part that starts in time
ends in time. study.json records the prediction beside the seconds the call took.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable

import jax
import ml_collections
from absl import logging

from maelm_jax.finetune.tasks import glue
from maelm_jax.infra import errors, paths
from maelm_jax.study import config as study_config
from maelm_jax.study import timing as timing_lib
from maelm_jax.text import tokenizer as tokenizer_lib
from maelm_jax.training import budget as budget_lib
from maelm_jax.training import preemption
from maelm_jax.workdirs import layout


class SizingError(errors.UserError):
    """A study that cannot be sized (no time limit, or too little time)."""


def head_kind(task: str) -> str:
    """What of a GLUE task makes its own fine-tuning program: its head's outputs."""
    spec = glue.examples.get_task(study_config.GLUE_TASKS[task])
    return "regression" if spec.is_regression else f"{spec.num_outputs} classes"


def finetune_programs(study: ml_collections.ConfigDict,
                      configs: dict[str, ml_collections.ConfigDict], tasks_found: list[str],
                      controls: list[str], vocab_size: int,
                      sweep_config: Callable[[str], ml_collections.ConfigDict]) -> list[dict]:
    """The distinct fine-tuning programs the study's parts build, as sweep.run_models
    groups their runs: the models (and the controls, in the first model's architecture)
    whose encoders as fine-tuning rebuilds them are one train together, a program per
    seed group (finetune.seeds_per_program) and head kind. Each: {"models", "seeds" (the
    first group's), "runs", "head", "tasks", "instances" (parts per task that run it),
    "encoder_of" (the model whose pretraining gives its encoder)}."""
    if not tasks_found:
        return []
    c = sweep_config(tasks_found[0])
    first = next(iter(configs))
    kinds: dict[str, list[str]] = {}
    for name in [*configs, *controls]:
        encoder = timing_lib.finetune_encoder(configs.get(name, configs[first]), c, vocab_size)
        kinds.setdefault(repr(encoder), []).append(name)
    seeds = tuple(study.seeds)
    size = study.finetune.seeds_per_program
    chunks = [seeds[i:i + size] for i in range(0, len(seeds), size)]
    programs: dict[tuple, dict] = {}
    for task in tasks_found:
        for together in kinds.values():
            for chunk in chunks:
                key = (tuple(together), len(chunk), head_kind(task))
                p = programs.setdefault(key, {
                    "models": together, "seeds": list(chunk), "runs": len(together) * len(chunk),
                    "head": head_kind(task), "tasks": [], "instances": 0,
                    "encoder_of": together[0] if together[0] in configs else first})
                if task not in p["tasks"]:
                    p["tasks"].append(task)
                p["instances"] += 1
    return list(programs.values())


def task_rows(study: ml_collections.ConfigDict, task: str) -> tuple[int, int]:
    """(training examples the study uses, examples of its evaluation splits) of a task."""
    spec = glue.examples.get_task(study_config.GLUE_TASKS[task])
    train = len(glue.examples.read_tsv(study.glue_dir, spec, "train"))
    limit = study.finetune.max_train_examples
    dev = sum(len(glue.examples.read_tsv(study.glue_dir, spec, split))
              for split in spec.eval_splits)
    return (min(train, limit) if limit else train), dev


def predict(study: ml_collections.ConfigDict, timing: timing_lib.Timing, steps: dict[str, int],
            rows: dict[str, tuple[int, int]], programs: list[dict],
            eval_batch_size: int, evals_per_epoch: int) -> dict[str, float]:
    """The timing model: predicted seconds of each part of the study ({"pretrain",
    "rank", "finetune", "compile", "overhead", "total"}), for `steps` of pretraining per
    model, tasks of `rows` (train, evaluation examples) and the fine-tuning `programs`."""
    f = study.finetune
    pretrain = sum(steps[m] * timing.pretrain_step[m] + timing.pretrain_part[m] for m in steps)
    rank = (sum(timing.rank_model + timing.pretrain_restore[m] for m in steps)
            if study.rank else 0.0)
    finetune = 0.0
    restore = max(timing.pretrain_restore.values(), default=0.0)
    for p in programs:
        # A program of more runs than the measured one does proportionally more work.
        scale = p["runs"] / max(timing.finetune_runs, 1)
        # Every pretrained model's encoder read back (the control's has no weights).
        reads = sum(m in steps for m in p["models"]) * restore
        for task in p["tasks"]:
            train_rows, eval_rows = rows[task]
            per_part = (f.num_epochs * math.ceil(train_rows / f.batch_size)
                        * timing.finetune_step * scale
                        + f.num_epochs * evals_per_epoch * math.ceil(eval_rows / eval_batch_size)
                        * timing.finetune_eval * scale
                        + timing.finetune_part + reads)
            finetune += per_part * p["instances"] / len(p["tasks"])
    cached = bool(jax.config.jax_compilation_cache_dir)
    # With a cache the measured program is found again; the others compile once (without
    # one, every part compiles its programs, which the part's timing already holds).
    compile_seconds = (timing.finetune_compile * max(len(programs) - 1, 0) if cached else 0.0)
    out = {"pretrain": pretrain, "rank": rank, "finetune": finetune,
           "compile": compile_seconds, "overhead": study.sizing.overhead_seconds}
    out["total"] = sum(out.values())
    return out


def unstoppable(study: ml_collections.ConfigDict, timing: timing_lib.Timing,
                rows: dict[str, tuple[int, int]], eval_batch_size: int) -> float:
    """The longest stretch that cannot stop once started: the rank analysis, a
    pretraining part's end (its evaluation and checkpoint), a fine-tuning part's start
    and an evaluation, and the report."""
    longest_eval = max((math.ceil(dev / eval_batch_size) for _, dev in rows.values()),
                       default=0) * timing.finetune_eval
    rank = (sum(timing.rank_model + r for r in timing.pretrain_restore.values())
            if study.rank else 0.0)
    return max(rank, max(timing.pretrain_part.values(), default=0.0),
               timing.finetune_part + longest_eval) + study.sizing.overhead_seconds


def apply(configs: dict[str, ml_collections.ConfigDict], steps: dict[str, int]) -> None:
    """Sets each model's pretraining to its planned steps as a run to a time budget is
    (training/budget.py: warmup the same share of them), with one evaluation and one
    checkpoint at the end (a stop request saves too)."""
    for name, c in configs.items():
        budget_lib.scale_schedule(c.train, steps[name])
        c.train.eval_every = c.train.checkpoint_every = steps[name]


def plan(study: ml_collections.ConfigDict, configs: dict[str, ml_collections.ConfigDict],
         tasks_found: list[str], controls: list[str], tok: tokenizer_lib.Tokenizer,
         root: paths.Path, sweep_config: Callable[[str], ml_collections.ConfigDict]) -> dict:
    """The sizing of this study (measured now, or read back from <root>/sizing.json when
    the study resumes), applied to `configs`; what study.json records of it. `controls`:
    fine-tuned beside the models (in the first model's architecture); `sweep_config(task)`:
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
    programs = finetune_programs(study, configs, tasks_found, controls, tok.vocab_size,
                                 sweep_config)
    timing = timing_lib.measure(study, configs, tok, programs[0] if programs else None,
                                sweep_config)
    rows = {t: task_rows(study, t) for t in tasks_found}
    t = sweep_config(tasks_found[0]).train if tasks_found else None
    eval_batch_size, evals_per_epoch = (t.eval_batch_size, t.evals_per_epoch) if t else (1, 1)
    reserve = max(study.reserve_seconds, unstoppable(study, timing, rows, eval_batch_size))
    configured = study.pretrain.train.num_steps

    def predicted_for(steps):
        return predict(study, timing, steps, rows, programs, eval_batch_size, evals_per_epoch)

    fixed = predicted_for(dict.fromkeys(configs, 0))
    # Time per base step of pretraining: every model's share of it.
    per_step = sum(study.step_scale.get(m, 1.0) * timing.pretrain_step[m] for m in configs)
    left = budget - timing.measuring - reserve - fixed["total"]
    base = min(configured, int(left / per_step) // s.step_multiple * s.step_multiple)
    if base < s.min_steps:
        raise SizingError(
            f"config.sizing: {budget:.0f} s leave time for {max(base, 0)} pretraining steps, "
            f"fewer than config.sizing.min_steps={s.min_steps} (fine-tuning and the rest are "
            f"predicted to take {fixed['total']:.0f} s, the measurement took "
            f"{timing.measuring:.0f} s, the reserve is {reserve:.0f} s); give more time, fewer "
            f"tasks or seeds")
    steps = {m: study_config.scaled_steps(study, m, base) for m in configs}
    predicted = predicted_for(steps)
    predicted["measuring"] = timing.measuring
    predicted["total"] += timing.measuring
    planned = {"budget_seconds": budget, "reserve_seconds": reserve, "base_steps": base,
               "steps": steps, "timing": dataclasses.asdict(timing), "task_rows": rows,
               "programs": programs, "predicted_seconds": predicted}
    paths.write_text(path, json.dumps(planned, indent=2))
    apply(configs, steps)
    logging.info("study sizing: %d base pretraining steps (%s) predicted to take %.0f s of "
                 "%.0f (reserve %.0f s)", base, ", ".join(f"{m} {n}" for m, n in steps.items()),
                 predicted["total"], budget, reserve)
    return planned
