"""Fine-tuning, top to bottom: `run(config, workdir)`, one run. (A sweep, `config.sweep`,
is sweep.run_sweep, which calls `run` per setting and seed, or seed_group.run for several
seeds at once; main.py picks between them.)

config -> encoder (+ tokenizer) from init_from, or fresh -> task data, encoded once ->
model = encoder + new head -> epochs of shuffled static-shape batches, evaluating on dev
after each (fraction of an) epoch -> the selected evaluation's parameters give the
predictions files and the checkpoint -> results.json.

The workdir gets config.json, metrics.jsonl + tensorboard/, results.json,
predictions/ (GLUE <TASK>.tsv test files; SQuAD predictions.json, null_odds.json), and,
with save_checkpoint, checkpoints/<step>/ + encoder.json + tokenizer.model, so it can be
another run's init_from (MNLI -> RTE, MRPC, STS-B).

Until the run finishes, checkpoints/ holds resume states instead: orbax checkpoints of the
whole train state, written at every evaluation but the last, every
train.checkpoint_every steps and on SIGTERM. Running the same command again continues
from the latest one exactly as if the run had not stopped: epoch e's data order is drawn
from (seed, e) and dropout from (seed, step), and the checkpoint carries the evaluations
so far, the best one's parameters (select="best") and the train metrics since the last
log line. They are deleted once results.json is written (finetune/loading.py: the order
that keeps a finish cut short resumable). The workdir's lifecycle is
every mode's (training/lifecycle.py): the same command again finds a finished run
(its results.json, nothing trained), and a changed config is refused with one line
naming the fields (--allow_config_change: start the run again with the new config).

Several processes (jax.distributed, as in pretraining) run it as one job on one mesh:
each builds the same whole batches (from the seed) and gives the mesh only its own rows;
eval outputs come back replicated, so every process scores them alike. Process 0 alone
prepares the workdir and writes config.json, the metrics, results.json, the predictions
and the files beside the final checkpoint; orbax's saves are made by every process.
"""

from __future__ import annotations

import itertools
import json
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax
import jax
import ml_collections
import numpy as np
from absl import logging

from maelm_jax.finetune import data, inputs, loading, tasks
from maelm_jax.finetune import setup as setup_lib
from maelm_jax.infra import distributed, paths, sharding
from maelm_jax.training import engine, lifecycle
from maelm_jax.workdirs import layout

# The newest resume checkpoint, and the one before it in case the newest is damaged.
KEEP_RESUME = 2


@flax.struct.dataclass
class ResumeState:
    """The arrays of a resume checkpoint: the train state and, with select="best", the
    best evaluation's parameters so far (before the first evaluation a stand-in, the
    current ones, which nothing reads)."""

    train: Any  # setup.FinetuneState
    best_params: Any  # None with select="final"

    @property
    def step(self) -> jax.Array:
        """The step, which the Checkpointer checks against the step it names; a seed
        group's state (seed_group.py) holds one per seed, all equal."""
        return self.train.step.reshape(-1)[0]


def start_over(workdir: paths.Path) -> None:
    """Removes what an earlier run left that this one could take for its own: results.json
    (a finished run) and checkpoints (resume states or a final one, in either layout).
    metrics.jsonl is emptied by the writer."""
    paths.make_dirs(workdir)
    paths.remove(workdir / layout.OLD_RESUME_DIR)
    paths.remove(workdir / layout.CHECKPOINTS)
    paths.remove(workdir / layout.RESULTS_FILE)


def _eval_steps(steps_per_epoch: int, num_epochs: int, evals_per_epoch: int) -> set[int]:
    """Steps after which to evaluate: evals_per_epoch times per epoch, always at the end."""
    k = min(evals_per_epoch, steps_per_epoch)
    return {max(1, round(steps_per_epoch * (epoch + i / k)))
            for epoch in range(num_epochs) for i in range(1, k + 1)}


def train_batches(train: tasks.Split, batch_size: int, buckets, seed: int, num_epochs: int,
                  start: int) -> Iterator[tuple[int, data.Batch]]:
    """(epoch, batch) for each step after the first `start` steps, to the last epoch's end.

    Epoch e's order is a permutation drawn from (seed, e) alone, so a resumed run draws
    the orders again and skips the batches it has already trained on.
    """
    first, done = divmod(start, data.steps_per_epoch(len(train), batch_size))
    for epoch in range(first, num_epochs):
        batches = data.train_batches(train.sequences, train.targets, batch_size, buckets,
                                     np.random.default_rng((seed, epoch)))
        for batch in itertools.islice(batches, done if epoch == first else 0, None):
            yield epoch, batch


def evaluator(program: setup_lib.Program, batch_size: int, buckets: tuple[int, ...]
               ) -> Callable[[Any], tasks.RunEval]:
    """run_eval_with(params) -> the task's run_eval: the eval step over static-shape
    batches of the sequences it is given, outputs on the host."""
    def run_eval_with(params) -> tasks.RunEval:
        def run_eval(sequences, targets) -> tasks.BatchOutputs:
            with sharding.activate(program.mesh, program.rules):
                return [(b.rows, jax.device_get(program.eval_step(params, program.on_mesh(b))))
                        for b in data.eval_batches(sequences, targets, batch_size, buckets)]
        return run_eval
    return run_eval_with


class FineTuning:
    """What fine-tuning supplies to the shared loop (engine.Run): its train step on
    bucketed batches, evaluations on dev evals_per_epoch times per epoch scored by the
    task, the best by the task's primary metric, and resume checkpoints that carry the
    best evaluation's parameters (select="best") and the wall time so far."""

    eval_split = "dev"

    def __init__(self, config: ml_collections.ConfigDict, program: setup_lib.Program, task,
                 run_eval_with: Callable[[Any], tasks.RunEval], steps_per_epoch: int,
                 started: float):
        self.t, self.program, self.task = config.train, program, task
        self.run_eval_with, self.steps_per_epoch = run_eval_with, steps_per_epoch
        self.num_steps = steps_per_epoch * self.t.num_epochs
        self.nonfinite, self.keeps_best = self.t.nonfinite, self.t.select == "best"
        self.eval_at = _eval_steps(steps_per_epoch, self.t.num_epochs, self.t.evals_per_epoch)
        self.started = started

    def train_step(self, state, batch: data.Batch):
        return self.program.train_step(state, self.program.on_mesh(batch))

    def log_due(self, step: int) -> bool:
        return step % self.t.log_every == 0

    def eval_due(self, step: int) -> bool:
        return step in self.eval_at

    def after_log(self, step: int) -> None:
        """Fine-tuning's steps are its epochs': nothing moves them."""

    def checkpoint_due(self, step: int) -> bool:
        # Not at the last step: the results follow at once, nothing to resume from. A stop
        # request saves whatever this says.
        if self.t.resume_saves == "stop":
            return False
        return step != self.num_steps and (step in self.eval_at or bool(
            self.t.checkpoint_every and step % self.t.checkpoint_every == 0))

    def log_line(self, step, means, steps, seconds):
        return {**means, "examples_per_sec": steps * self.t.batch_size / seconds,
                "epoch": (step - 1) // self.steps_per_epoch + 1}

    def evaluate(self, state, step: int) -> dict[str, float]:
        return {**self.task.score(self.run_eval_with(state.params)),
                "epoch": step / self.steps_per_epoch}

    def better(self, scores, best) -> bool:
        return scores[self.task.primary_metric] > best[self.task.primary_metric]

    def save(self, ckpt, step, state, progress, best_params) -> None:
        """Starts writing the resume state checkpoints/<step> (asynchronously), with this
        attempt's seconds."""
        best = None
        if self.t.select == "best":  # before the first evaluation, the stand-in
            best = state.params if best_params is None else best_params
        ckpt.save(step, ResumeState(state, best),
                  progress.meta(step, time.perf_counter() - self.started))


def results_record(p: inputs.Inputs, seed: int, evals: list[dict], best: int,
                   files: list[str], seconds: float) -> dict:
    """A finished run's results.json: its evaluations, the best (index `best`) and the
    selected one, and what it ran on."""
    t = p.config.train
    selected = evals[best] if t.select == "best" else evals[-1]
    return {
        "task": p.task.name,
        "primary_metric": p.task.primary_metric,
        "select": t.select,
        "dev": dict(selected),
        "best": evals[best],
        "final": evals[-1],
        "evals": evals,
        "init_from": p.source,
        "train_examples": len(p.task.train),
        "num_steps": p.steps_per_epoch * t.num_epochs,
        "max_seq_len": p.max_len,
        "seed": seed,
        "hyperparameters": {k: t[k] for k in ("learning_rate", "batch_size", "num_epochs",
                                              "warmup_ratio")},
        "files": files,
        "wall_seconds": seconds,
    }


def train_prepared(p: inputs.Inputs, program: setup_lib.Program, make_run: Callable,
                   make_batches: Callable[[int], Iterator],
                   records: Sequence[Callable[[], None]] = ()):
    """The session of a prepared run or seed group (lifecycle.session): the workdir made
    ready (an unfinished run of this config kept to continue, anything else cleared),
    config.json and `records` written, its resume checkpoint restored (or a fresh state),
    then engine.train to the last step.

    make_run(run_eval_with, progress, best_params) -> the engine.Run (FineTuning or a seed
    group's), given what the checkpoint carried; make_batches(start) -> the train batches
    after step `start`. Returns (state, progress, best params on the host or None,
    run_eval_with)."""
    t = p.config.train
    sharding.check_batch(program.mesh, t.batch_size, 1)
    sharding.check_batch(program.mesh, t.eval_batch_size, 1)
    run_eval_with = evaluator(program, t.eval_batch_size, p.buckets)
    keeps_best = t.select == "best"
    target = ResumeState(program.state.abstract,
                         program.state.abstract.params if keeps_best else None)

    def make_way() -> None:
        if p.resume:
            loading.drop_final(p.workdir)  # a finish cut short: resumed, then written again
        else:
            start_over(p.workdir)

    with lifecycle.session(p.workdir, p.config, target,
                           lambda: ResumeState(program.state.init(p.encoder_params), None),
                           KEEP_RESUME, p.resume, make_way, records) as session:
        best_params = (distributed.host_copy(session.state.best_params)
                       if keeps_best and session.progress.best is not None else None)
        run = make_run(run_eval_with, session.progress, best_params)
        with sharding.activate(program.mesh, program.rules):
            state, progress, best_params = engine.train(
                run, session.state.train, session.start, make_batches(session.start),
                session.ckpt, session.writer, session.progress, best_params)
    return state, progress, best_params, run_eval_with


def run(config: ml_collections.ConfigDict, workdir: str,
        allow_config_change: bool = False) -> dict:
    """One fine-tuning run; returns the results (also written to results.json).

    A finished run of the same config in `workdir` is found (its results returned,
    nothing trained); an unfinished one continues from its latest resume checkpoint; a
    changed config is refused unless `allow_config_change` (then the run starts again).
    On a stop request (SIGTERM, the time limit), saves a resume checkpoint and raises
    preemption.Preempted (TimeLimit).
    """
    started = time.perf_counter()
    config, workdir, decision = inputs.check_run(config, workdir, allow_config_change)
    if decision is lifecycle.Decision.FINISHED:
        logging.info("%s holds this run, finished: its %s, nothing trained", workdir,
                     layout.RESULTS_FILE)
        return json.loads(paths.read_text(workdir / layout.RESULTS_FILE))
    p = inputs.read_inputs(config, workdir, decision)
    config, workdir, t = p.config, p.workdir, p.config.train
    steps_per_epoch = p.steps_per_epoch
    program = setup_lib.build(config, p.encoder_cfg, p.task, steps_per_epoch * t.num_epochs,
                              p.buckets[0])
    state, progress, best_params, run_eval_with = train_prepared(
        p, program,
        lambda run_eval_with, progress, best_params: FineTuning(
            config, program, p.task, run_eval_with, steps_per_epoch, started),
        lambda start: (batch for _, batch in train_batches(
            p.task.train, t.batch_size, p.buckets, config.seed, t.num_epochs, start)))

    best = progress.evals[progress.best]
    selected = best if t.select == "best" else progress.evals[-1]
    params = (jax.device_put(best_params, program.state.shardings.params)
              if t.select == "best" else state.params)
    with tempfile.TemporaryDirectory() as scratch:
        # Every process runs the evaluations (each is a step on the whole mesh); only
        # process 0's files are kept.
        written = p.task.write_outputs(workdir if distributed.is_leader()
                                       else paths.Path(scratch), run_eval_with(params))
    if config.save_checkpoint:
        path = loading.save_finetuned(workdir, selected["step"], distributed.host_copy(params),
                                      p.encoder_cfg, p.tokenizer)
        written.append(str(path))
    results = results_record(p, config.seed, progress.evals, progress.best, written,
                             progress.seconds + time.perf_counter() - started)
    if distributed.is_leader():
        paths.write_text(workdir / layout.RESULTS_FILE, json.dumps(results, indent=2))
        # Finished: nothing to resume; the final checkpoint alone stays.
        loading.drop_resume(workdir, selected["step"] if config.save_checkpoint else None)
    logging.info("%s dev %s = %.2f (%s, step %d); %.0fs", p.task.name, p.task.primary_metric,
                 selected[p.task.primary_metric], t.select, selected["step"],
                 results["wall_seconds"])
    return results
