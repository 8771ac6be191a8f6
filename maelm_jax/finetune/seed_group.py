"""Several runs of one fine-tuning setting trained as one program: seeds of one model
(`run(config, seeds, workdir, seed_workdirs)`), or several models x seeds of one task
(`run_members(members, workdir)`).

A sweep runs every setting of its grid with every seed (sweep.py). Next to an accelerator
each such run is small: at the study's sizes a step is a few milliseconds, much of it
fixed cost (kernel launches, the host's dispatch, the optimiser's many small updates).
With grid.seeds_per_program = K the sweep trains K seeds of a setting together: one state
with a leading runs axis ([K, ...] on every leaf), one compiled step that vmaps the single
run's step over it (setup.build with `runs`), so every kernel does K runs' work and the
host dispatches one step for K. The evaluations share their batches: one eval step scores
every run's parameters on the same sequences.

The runs of a group may also start from different encoders of one architecture (models
pretrained differently, and the from-scratch control) at different peak learning rates:
what differs between them is data (each run's initial encoder and its learning-rate
schedule in its state), not the program. The study fine-tunes every model and every seed
of a task this way, as one program (sweep.run_models): runs with the same seed draw the
same head initialisation, batches and dropout whichever encoder they start from, so the
models' differences are paired. A run's config may differ from the others' only in
MEMBER_FIELDS.

Each run stays its own run. Its head's initialisation, its data order (seed, epoch) and
its dropout (seed, step) are drawn as the single run's are; its evaluations are scored and
its best selected on their own; it gets its own config.json and results.json in its own
directory (a sweep's runs/<setting>/seed_<s>/), so the sweep reuses and aggregates it as
any run. One thing differs: at each step the batches are padded to the longest one's
bucket, and dropout draws its bits for the padded shape, so a run's numbers depend on the
runs it trains with: equally valid draws, not the same ones as alone.

The group's own directory (a seed group's runs/<setting>/seeds_<a>_<b>.../) holds its
config.json (the first run's), group.json (every run's key, seed, encoder and learning
rate: a group of other runs starts over), metrics.jsonl (each run's metrics as
"<key>/<name>", the key "seed_<s>" or "<model>/seed_<s>") and, until it finishes, its
resume checkpoints, which carry every run's state and best parameters: a stopped group
continues exactly, as a single run does.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from maelm_jax.data import digests
from maelm_jax.finetune import config as finetune_config
from maelm_jax.finetune import encoder, inputs, loading, tasks, train
from maelm_jax.finetune import setup as setup_lib
from maelm_jax.infra import distributed, paths
from maelm_jax.training import lifecycle
from maelm_jax.workdirs import layout

# What the runs of one group may differ in (and the sweep's grid each came from, which a
# single run does not read): the rest (the task, its data, the batch size, the epochs,
# the model's settings) makes the program and the steps, which they share.
MEMBER_FIELDS = ("seed", "init_from", "init_weights", "train.learning_rate")


@dataclasses.dataclass(frozen=True)
class Member:
    """One run of a group: its metrics' key in the group's record ("seed_<s>", or
    "<model>/seed_<s>"), its single run's config, and the directory that gets its
    config.json and results.json."""

    key: str
    config: ml_collections.ConfigDict
    workdir: str


def group_name(seeds: Sequence[int]) -> str:
    """The group's directory name in a sweep's runs/<setting>/."""
    return "seeds_" + "_".join(str(s) for s in seeds)


def stacked_batches(split: tasks.Split, batch_size: int, buckets: tuple[int, ...],
                    seeds: Sequence[int], num_epochs: int, start: int) -> Iterator[dict]:
    """Every step's batches of all runs after the first `start` steps ({name: [runs, B,
    n]}): run i's as the single run of seeds[i] draws them (train.train_batches), padded to
    the longest one's bucket n. Runs of one seed get the same batch (drawn once)."""
    distinct = list(dict.fromkeys(seeds))
    per_seed = [train.train_batches(split, batch_size, buckets, s, num_epochs, start)
                for s in distinct]
    which = [distinct.index(s) for s in seeds]
    for step_batches in zip(*per_seed, strict=True):
        n = max(batch.tokens.shape[1] for _, batch in step_batches)
        arrays = [batch.padded(n).arrays() for _, batch in step_batches]
        yield {name: np.stack([arrays[k][name] for k in which]) for name in arrays[0]}


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


def run_scores(record: dict, key: str) -> dict:
    """One run's part of a group's evaluation record ("<key>/<name>" -> "<name>"), with
    the record's own "step" and "epoch"."""
    prefix = f"{key}/"
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
    """What a group supplies to the shared loop: FineTuning's cadence, its step on stacked
    batches, and evaluations scored per run, each run's best kept here (the loop's one
    "best" is not used: `better` is never true)."""

    def __init__(self, config: ml_collections.ConfigDict, program: setup_lib.Program, task,
                 run_eval_with, steps_per_epoch: int, started: float, keys: Sequence[str],
                 evals: list[dict], best_params: Any):
        super().__init__(config, program, task, run_eval_with, steps_per_epoch, started)
        self.keys = tuple(keys)
        self.runs_keep_best, self.keeps_best = self.keeps_best, False
        primary = task.primary_metric
        # Each run's best so far, from the evaluations a resumed group carries.
        self.best = []
        for key in self.keys:
            own = [run_scores(e, key) for e in evals]
            index = best_index(own, primary)
            self.best.append(None if index is None else own[index])
        # select="best": every run's best parameters, on the host, [runs, ...] per leaf.
        self.best_params = None if best_params is None else jax.tree.map(np.array, best_params)

    def train_step(self, state, batch: dict):
        return self.program.train_step(state, self.program.stacked_on_mesh(batch))

    def log_line(self, step, means, steps, seconds):
        return {**means, "examples_per_sec": steps * self.t.batch_size * len(self.keys) / seconds,
                "epoch": (step - 1) // self.steps_per_epoch + 1}

    def evaluate(self, state, step: int) -> dict[str, float]:
        primary = self.task.primary_metric
        scores, improved = {}, []
        for i, (key, run_eval) in enumerate(zip(self.keys, per_run(
                self.run_eval_with(state.params), len(self.keys)), strict=True)):
            own = self.task.score(run_eval)
            if self.best[i] is None or own[primary] > self.best[i][primary]:
                self.best[i] = own
                improved.append(i)
            scores.update({f"{key}/{k}": v for k, v in own.items()})
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
    seed_workdirs[i] and returns the results, in the order of `seeds` (run_members)."""
    seeds = tuple(int(s) for s in seeds)
    if len(set(seeds)) != len(seeds) or len(seed_workdirs) != len(seeds):
        raise ValueError(f"a seed group needs distinct seeds and a directory for each, got "
                         f"{seeds} and {len(seed_workdirs)} directories")
    members = []
    for seed, seed_dir in zip(seeds, seed_workdirs, strict=True):
        own = config.copy_and_resolve_references()
        own.seed = seed
        members.append(Member(f"seed_{seed}", own, seed_dir))
    return run_members(members, workdir, allow_config_change)


def _check_members(members: Sequence[Member]) -> list[ml_collections.ConfigDict]:
    """The members' configs validated (paths absolute), or one line naming the first
    field in which a run differs from the first run other than MEMBER_FIELDS."""
    keys = [m.key for m in members]
    if not members or len(set(keys)) != len(keys):
        raise ValueError(f"a group needs runs with distinct keys, got {keys}")
    first = members[0].config
    if first.save_checkpoint or first.predict_test:
        raise finetune_config.FinetuneConfigError(
            "config.save_checkpoint, config.predict_test: expected False for a seed group "
            "(it keeps no run's checkpoint and writes no predictions)")
    configs = [finetune_config.validated(m.config, m.workdir)[0] for m in members]
    recorded = json.loads(layout.config_json(configs[0]))
    for m, c in zip(members[1:], configs[1:], strict=True):
        differ = [f for f in lifecycle.changes(inputs.FINE_TUNING, c, recorded)
                  if f not in MEMBER_FIELDS and not f.startswith("grid.")]
        if differ:
            raise finetune_config.FinetuneConfigError(
                f"config.{differ[0]}: run {m.key} of a group differs from run {members[0].key} "
                f"in it; the runs of one program may differ only in "
                f"{', '.join(MEMBER_FIELDS)}")
    return configs


def _roster(members: Sequence[Member], configs: Sequence[ml_collections.ConfigDict]) -> list:
    """group.json's record of the runs: what makes each one."""
    return [{"key": m.key, "seed": c.seed, "init_from": c.init_from,
             "init_weights": c.init_weights, "learning_rate": c.train.learning_rate}
            for m, c in zip(members, configs, strict=True)]


def _encoders(p: inputs.Inputs, configs: Sequence[ml_collections.ConfigDict],
              keys: Sequence[str]) -> tuple[list, list[str]]:
    """(each run's initial encoder parameters, numpy or None for random weights; where
    each comes from, in words): the first run's as prepared, the others read and checked
    to be of its architecture and tokenizer."""
    params, sources = [p.encoder_params], [p.source]
    tokenizer = digests.sha256_of(p.tokenizer.model_path)
    for key, c in zip(keys[1:], configs[1:], strict=True):
        cfg, own, tok, source = encoder.encoder_and_tokenizer(c)
        if cfg != p.encoder_cfg:
            raise finetune_config.FinetuneConfigError(
                f"config.init_from: run {key} of a group starts from {c.init_from}, whose "
                f"encoder differs from run {keys[0]}'s ({p.source}); the runs of one program "
                f"need one architecture")
        if digests.sha256_of(tok.model_path) != tokenizer:
            raise finetune_config.FinetuneConfigError(
                f"config.init_from: run {key} of a group uses the tokenizer {tok.model_path}, "
                f"not run {keys[0]}'s {p.tokenizer.model_path}; the runs of one program "
                f"read the same sequences")
        params.append(own)
        sources.append(source)
    return params, sources


# What a group may measure of its runs at its end (the study's rank of each fine-tuned
# encoder, analysis/finetuned.py): (encoder config, encoder parameters with a leading runs
# axis, the task's dev sequences, their length) -> a record per run, kept in its results
# under "rank".
Measure = Callable[[Any, Any, list, int], list[dict]]


def _reported_params(p: inputs.Inputs, state, made: GroupFineTuning | None) -> Any:
    """Every run's parameters its results report, [runs, ...] on the host: its best
    evaluation's (select="best"), else the last."""
    best = made.best_params if made is not None else None
    if p.config.train.select == "best" and best is not None:
        return best
    return jax.tree.map(np.asarray, distributed.host_copy(state.params))


def run_members(members: Sequence[Member], workdir: str,
                allow_config_change: bool = False, measure: Measure | None = None) -> list[dict]:
    """Fine-tunes every member's run as one program in `workdir`; writes each one's
    config.json and results.json to its own directory and returns the results, in the
    order of `members`. Their configs may differ only in MEMBER_FIELDS; their encoders
    must share an architecture and a tokenizer.

    As train.run: an unfinished group of the same runs in `workdir` continues from its
    latest resume checkpoint; on a stop request it saves one and raises
    preemption.Preempted (TimeLimit). A group writes no predictions and no checkpoint
    (config.predict_test and save_checkpoint must be False, as a sweep's runs have them).
    With `measure`, each run's results also hold what it measures of the runs' encoders
    ("rank").
    """
    started = time.perf_counter()
    configs = _check_members(members)
    keys = [m.key for m in members]
    roster = _roster(members, configs)
    config, group_dir, decision = inputs.check_run(configs[0], workdir, allow_config_change)
    if decision is lifecycle.Decision.FINISHED:  # a single run's: a group never finishes there
        raise layout.WorkdirError(f"{group_dir} holds a finished fine-tuning run; a group "
                                  "needs a workdir of its own")
    if decision is lifecycle.Decision.CONTINUE:
        recorded = group_dir / layout.GROUP_FILE
        same = (recorded.is_file()
                and json.loads(paths.read_text(recorded)).get("runs") == roster)
        if not distributed.leader_says_ok(same):
            logging.info("%s holds a group of other runs: starting over", group_dir)
            decision = lifecycle.Decision.START
    p = inputs.read_inputs(config, group_dir, decision)
    config, t = p.config, p.config.train
    num_steps = p.steps_per_epoch * t.num_epochs
    params, sources = _encoders(p, configs, keys)
    runs = setup_lib.Runs(tuple(int(c.seed) for c in configs), tuple(keys),
                          tuple(setup_lib.schedule_of(c.train, num_steps) for c in configs))
    program = setup_lib.build(config, p.encoder_cfg, p.task, num_steps, p.buckets[0],
                              runs=runs)
    # The group keeps every run's best parameters itself (GroupFineTuning).
    made: list[GroupFineTuning] = []

    def make_run(run_eval_with, progress, best_params) -> GroupFineTuning:
        made.append(GroupFineTuning(config, program, p.task, run_eval_with, p.steps_per_epoch,
                                    started, keys, progress.evals, best_params))
        return made[-1]

    state, progress, _, _ = train.train_prepared(
        dataclasses.replace(p, encoder_params=params), program, make_run,
        lambda start: stacked_batches(p.task.train, t.batch_size, p.buckets, runs.seeds,
                                      t.num_epochs, start),
        records=[lambda: paths.write_text(group_dir / layout.GROUP_FILE,
                                          json.dumps({"runs": roster}, indent=2))])

    seconds = progress.seconds + time.perf_counter() - started
    primary = p.task.primary_metric
    ranks = [None] * len(members)
    if measure is not None:
        ranks = measure(p.encoder_cfg, _reported_params(p, state, made[-1] if made else None)
                        ["encoder"], list(p.task.eval_splits()[0].sequences), p.max_len)
    results = []
    for key, c, source, found in zip(keys, configs, sources, ranks, strict=True):
        evals = [run_scores(e, key) for e in progress.evals]
        record = train.results_record(dataclasses.replace(p, config=c, source=source),
                                      c.seed, evals, best_index(evals, primary), [],
                                      seconds / len(members))
        # wall_seconds is the run's share, so a sweep's sums count the group's time once.
        record["seed_group"] = {"runs": keys, "seeds": list(runs.seeds),
                                "workdir": str(p.workdir), "wall_seconds": seconds}
        if found is not None:
            record["rank"] = found
        results.append(record)
    if distributed.is_leader():
        for m, c, record in zip(members, configs, results, strict=True):
            run_dir = paths.resolve(m.workdir, "run directory")
            _clear_run(run_dir)
            layout.write_config(run_dir, c)
            paths.write_text(run_dir / layout.RESULTS_FILE, json.dumps(record, indent=2))
        loading.drop_resume(p.workdir, None)  # finished: nothing to resume, nothing kept
    logging.info("%s dev %s (%s) per run: %s; %.0fs for %d runs", p.task.name, primary,
                 t.select, ", ".join(f"{k}: {r['dev'][primary]:.2f}"
                                     for k, r in zip(keys, results, strict=True)),
                 seconds, len(members))
    return results
