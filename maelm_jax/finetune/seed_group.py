"""Several seeds of one fine-tuning setting trained as one program:
`run(config, seeds, workdir, seed_workdirs)`.

A sweep runs every setting of its grid with every seed (sweep.py). Next to an accelerator
each such run is small: at the study's sizes a step is a few milliseconds, much of it
fixed cost (kernel launches, the host's dispatch, the optimiser's many small updates).
With grid.seeds_per_program = K the sweep trains K seeds of a setting together: one state
with a leading runs axis ([K, ...] on every leaf), one compiled step that vmaps the single
run's step over it (setup.build with `seeds`), so every kernel does K runs' work and the
host dispatches one step for K. The evaluations share their batches: one eval step scores
every run's parameters on the same sequences.

Each seed stays its own run. Its head's initialisation, its data order (seed, epoch) and
its dropout (seed, step) are drawn as the single run's are; its evaluations are scored and
its best selected on their own; it gets its own config.json and results.json in its own
directory (the sweep's runs/<setting>/seed_<s>/), so the sweep reuses and aggregates it as
any run. One thing differs: at each step the K batches are padded to the longest one's
bucket, and dropout draws its bits for the padded shape, so a seed's numbers depend on the
seeds it runs with: equally valid draws, not the same ones as alone. The groups follow
from grid.seeds and grid.seeds_per_program, which every run's config records.

The group's own directory (runs/<setting>/seeds_<a>_<b>.../) holds its config.json (the
first seed's), metrics.jsonl (each run's metrics as "seed_<s>/<name>") and, until it
finishes, its resume checkpoints, which carry every run's state and best parameters: a
stopped group continues exactly, as a single run does.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from maelm_jax import distributed, layout, paths
from maelm_jax.finetune import config as finetune_config
from maelm_jax.finetune import loading, tasks, train
from maelm_jax.finetune import setup as setup_lib
from maelm_jax.training import lifecycle


def group_name(seeds: Sequence[int]) -> str:
    """The group's directory name in a sweep's runs/<setting>/."""
    return "seeds_" + "_".join(str(s) for s in seeds)


def stacked_batches(split: tasks.Split, batch_size: int, buckets: tuple[int, ...],
                    seeds: Sequence[int], num_epochs: int, start: int) -> Iterator[dict]:
    """Every step's batches of all runs after the first `start` steps ({name: [runs, B,
    n]}): run i's as the single run of seeds[i] draws them (train.train_batches), padded to
    the longest one's bucket n."""
    per_run = [train.train_batches(split, batch_size, buckets, s, num_epochs, start)
               for s in seeds]
    for step_batches in zip(*per_run, strict=True):
        n = max(batch.tokens.shape[1] for _, batch in step_batches)
        arrays = [batch.padded(n).arrays() for _, batch in step_batches]
        yield {name: np.stack([a[name] for a in arrays]) for name in arrays[0]}


def per_run(run_eval: tasks.RunEval, runs: int) -> list[tasks.RunEval]:
    """Each run's RunEval, from one whose outputs hold every run's ([runs, B, ...]): the
    eval step runs once per set of sequences for all runs."""
    computed: list[tuple[Sequence, tasks.BatchOutputs]] = []

    def outputs(sequences, targets) -> tasks.BatchOutputs:
        for seen, out in computed:
            if seen is sequences:
                return out
        computed.append((sequences, run_eval(sequences, targets)))
        return computed[-1][1]

    def run_i(i: int) -> tasks.RunEval:
        return lambda sequences, targets: [
            (rows, {name: values[i] for name, values in out.items()})
            for rows, out in outputs(sequences, targets)]

    return [run_i(i) for i in range(runs)]


def run_scores(record: dict, seed: int) -> dict:
    """One run's part of a group's evaluation record ("seed_<s>/<name>" -> "<name>"),
    with the record's own "step" and "epoch"."""
    prefix = f"seed_{seed}/"
    own = {k[len(prefix):]: v for k, v in record.items() if k.startswith(prefix)}
    shared = {k: v for k, v in record.items() if k in ("step", "epoch")}
    return {**own, **shared}


def best_index(evals: list[dict], primary: str) -> int | None:
    """The best of `evals` by `primary`, the first on ties (the rule engine.train applies
    with FineTuning.better)."""
    best = None
    for i, scores in enumerate(evals):
        if best is None or scores[primary] > evals[best][primary]:
            best = i
    return best


class GroupFineTuning(train.FineTuning):
    """What a seed group supplies to the shared loop: FineTuning's cadence, its step on
    stacked batches, and evaluations scored per run, each run's best kept here (the loop's
    one "best" is not used: `better` is never true)."""

    def __init__(self, config: ml_collections.ConfigDict, trainer: setup_lib.Trainer, task,
                 run_eval_with, steps_per_epoch: int, started: float, seeds: Sequence[int],
                 evals: list[dict], best_params: Any):
        super().__init__(config, trainer, task, run_eval_with, steps_per_epoch, started)
        self.seeds = tuple(seeds)
        self.runs_keep_best, self.keeps_best = self.keeps_best, False
        primary = task.primary_metric
        # Each run's best so far, from the evaluations a resumed group carries.
        self.best = []
        for seed in self.seeds:
            own = [run_scores(e, seed) for e in evals]
            index = best_index(own, primary)
            self.best.append(None if index is None else own[index])
        # select="best": every run's best parameters, on the host, [runs, ...] per leaf.
        self.best_params = None if best_params is None else jax.tree.map(np.array, best_params)

    def train_step(self, state, batch: dict):
        return self.trainer.train_step(state, self.trainer.stacked_on_mesh(batch))

    def log_line(self, step, means, steps, seconds):
        return {**means, "examples_per_sec": steps * self.t.batch_size * len(self.seeds) / seconds,
                "epoch": (step - 1) // self.steps_per_epoch + 1}

    def evaluate(self, state, step: int) -> dict[str, float]:
        primary = self.task.primary_metric
        scores, improved = {}, []
        for i, (seed, run_eval) in enumerate(zip(self.seeds, per_run(
                self.run_eval_with(state.params), len(self.seeds)), strict=True)):
            own = self.task.score(run_eval)
            if self.best[i] is None or own[primary] > self.best[i][primary]:
                self.best[i] = own
                improved.append(i)
            scores.update({f"seed_{seed}/{k}": v for k, v in own.items()})
        if self.runs_keep_best and improved:
            params = distributed.host_copy(state.params)
            if self.best_params is None:
                self.best_params = jax.tree.map(np.array, params)
            for i in improved:
                jax.tree.map(lambda best, now, i=i: best.__setitem__(i, now[i]),
                             self.best_params, params)
        return {**scores, "epoch": step / self.steps_per_epoch}

    def better(self, scores, best) -> bool:
        return False

    def save(self, ckpt, step, state, progress, best_params) -> None:
        super().save(ckpt, step, state, progress, self.best_params)


def _clear_run(workdir: paths.Path) -> None:
    """Removes what an earlier run of this seed left in its directory (a single run's
    metrics, checkpoints and results): the group writes its record there afresh."""
    train.start_over(workdir)
    for name in (layout.METRICS_FILE, layout.TENSORBOARD_DIR, layout.PREDICTIONS_DIR):
        paths.remove(workdir / name)


def run(config: ml_collections.ConfigDict, seeds: Sequence[int], workdir: str,
        seed_workdirs: Sequence[str], allow_config_change: bool = False) -> list[dict]:
    """Fine-tunes `config`'s setting with every seed of `seeds` as one program in
    `workdir`; writes run i's config.json (config with seed=seeds[i]) and results.json to
    seed_workdirs[i] and returns the results, in the order of `seeds`.

    As train.run: an unfinished group of the same config in `workdir` continues from its
    latest resume checkpoint; on a stop request it saves one and raises
    preemption.Preempted (TimeLimit). A group writes no predictions and no checkpoint
    (config.predict_test and save_checkpoint must be False, as a sweep's runs have them).
    """
    started = time.perf_counter()
    seeds = tuple(int(s) for s in seeds)
    if len(set(seeds)) != len(seeds) or len(seed_workdirs) != len(seeds):
        raise ValueError(f"a seed group needs distinct seeds and a directory for each, got "
                         f"{seeds} and {len(seed_workdirs)} directories")
    if config.save_checkpoint or config.predict_test:
        raise finetune_config.FinetuneConfigError(
            "config.save_checkpoint, config.predict_test: expected False for a seed group "
            "(it keeps no run's checkpoint and writes no predictions)")
    config, group_dir, decision = train.check_run(config, workdir, allow_config_change)
    if decision is lifecycle.Decision.FINISHED:  # a single run's: a group never finishes there
        raise layout.WorkdirError(f"{group_dir} holds a finished fine-tuning run; a seed "
                                  "group needs a workdir of its own")
    p = train.prepare_run(config, group_dir, decision)
    config, t = p.config, p.config.train
    num_steps = p.steps_per_epoch * t.num_epochs
    trainer = setup_lib.build(config, p.encoder_cfg, p.task, num_steps, p.buckets[0],
                              seeds=seeds)
    # The group keeps every run's best parameters itself (GroupFineTuning).
    _, progress, _, _ = train.train_prepared(
        p, trainer,
        lambda run_eval_with, progress, best_params: GroupFineTuning(
            config, trainer, p.task, run_eval_with, p.steps_per_epoch, started, seeds,
            progress.evals, best_params),
        lambda start: stacked_batches(p.task.train, t.batch_size, p.buckets, seeds,
                                      t.num_epochs, start))

    seconds = progress.seconds + time.perf_counter() - started
    primary = p.task.primary_metric
    results = []
    for seed in seeds:
        evals = [run_scores(e, seed) for e in progress.evals]
        record = train.results_record(p, seed, evals, best_index(evals, primary), [],
                                      seconds / len(seeds))
        # wall_seconds is the run's share, so a sweep's sums count the group's time once.
        record["seed_group"] = {"seeds": list(seeds), "workdir": str(p.workdir),
                                "wall_seconds": seconds}
        results.append(record)
    if distributed.is_leader():
        for seed, seed_dir, record in zip(seeds, seed_workdirs, results, strict=True):
            seed_dir = paths.resolve(seed_dir, "seed directory")
            _clear_run(seed_dir)
            own = config.copy_and_resolve_references()
            own.seed = seed
            layout.write_config(seed_dir, own)
            paths.write_text(seed_dir / layout.RESULTS_FILE, json.dumps(record, indent=2))
        loading.drop_resume(p.workdir, None)  # finished: nothing to resume, nothing kept
    logging.info("%s dev %s (%s) per seed: %s; %.0fs for %d runs", p.task.name, primary,
                 t.select, ", ".join(f"{r['seed']}: {r['dev'][primary]:.2f}" for r in results),
                 seconds, len(seeds))
    return results
