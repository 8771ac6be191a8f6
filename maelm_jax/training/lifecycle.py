"""A run's lifecycle in its workdir, under one policy for every mode that trains
(pretraining, a fine-tuning run, a seed group): what the workdir records decides whether
the run starts, continues or is found finished, and a config that differs from the
recorded one is refused in the same words everywhere.

    config.json          the run          ->  decision
    absent                                    START
    another mode's                            refused: use another --workdir
    this config          not finished         CONTINUE (from its latest checkpoint, if any)
    this config          finished             FINISHED: found, not trained again
    a changed config                          refused, one line naming the fields; with
                                              --allow_config_change, the mode's override

"This config" means equal to the record but for the mode's own harmless fields (those
that change how a run proceeds, not what it computes: logging cadence, the mesh, the
kernel), with a field the record lacks (a workdir from before the field existed) counted
at its default. Each mode names its policy once (`Policy`), beside its run.

Every mode's run goes through its workdir in one order:

    decided(...)        process 0 reads the record; every process gets the decision
    (FINISHED)          found: the mode reports its record and trains nothing
    the mode's inputs   read and checked (a mode may cache prepared inputs in the
                        workdir, whole or not at all); a refusal leaves the workdir as it was
    session(...)        process 0 makes way for the run (the mode's `make_way`); every
                        process's stacks go to stacks/ on SIGUSR1 (infra/stacks.py); the
                        latest checkpoint is restored (or the state initialised); process
                        0 writes config.json and the mode's own records (a run whose
                        checkpoints cannot restore leaves them as they were); the metrics
                        writer opens
    the loop            engine.train
    the session closes  pending checkpoint saves finish (or fail loudly), the writer closes
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import ml_collections
from absl import logging

from maelm_jax.infra import distributed, paths, stacks
from maelm_jax.training import checkpoint as checkpoint_lib
from maelm_jax.training import engine
from maelm_jax.training import metrics as metrics_lib
from maelm_jax.workdirs import layout


class Decision(enum.Enum):
    START = "start"  # nothing of this run yet (or the override of a changed config)
    CONTINUE = "continue"  # an unfinished run of this config: from its latest checkpoint
    FINISHED = "finished"  # a finished run of this config: found, not trained again


@dataclasses.dataclass(frozen=True)
class Policy:
    """What differs between the modes that train: the rest is `decide`'s."""

    mode: str  # config.mode as config.json records it ("pretrain", "finetune")
    noun: str  # the run in words, for errors ("pretraining", "fine-tuning")
    defaults: Callable[[], ml_collections.ConfigDict]  # the mode's defaults
    # Its config with absolute paths (how a record is compared: relative paths recorded
    # by older versions meant the current directory, as they do now).
    resolve_paths: Callable[[ml_collections.ConfigDict], ml_collections.ConfigDict]
    harmless: tuple[str, ...]  # dotted field prefixes that may change between attempts
    # Whether the workdir holds a finished run of the config (paths absolute).
    finished: Callable[[paths.Path, ml_collections.ConfigDict], bool]
    # What --allow_config_change does with a changed config: CONTINUE the recorded run
    # under it, or START again (the recorded run's files make way).
    override: Decision
    override_words: str  # the same, for the error ("continue it with the new config")


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flatten(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], tree


# Maps whose keys the user names: the defaults' entries are examples, not fields.
_NAMED_BY_USER = ("data.sources.",)


def config_changes(old: dict, new: dict, defaults: dict | None = None,
                   harmless: tuple[str, ...] = ()) -> list[str]:
    """Dotted fields whose values differ, other than the `harmless` ones.

    A field missing from `old` (a workdir written before the field existed) counts as its
    value in `defaults`, which is what that run used; not inside maps whose keys the user
    names (the corpus sources: a run with sources "books" and "web" never had the
    default "main").
    """
    old_flat, new_flat = dict(_flatten(old)), dict(_flatten(new))
    for key, value in _flatten(defaults or {}):
        if not key.startswith(_NAMED_BY_USER):
            old_flat.setdefault(key, value)
    changed = sorted(k for k in old_flat.keys() | new_flat.keys()
                     if old_flat.get(k) != new_flat.get(k))
    return [k for k in changed if not any(k == p or k.startswith(p + ".") for p in harmless)]


def _as_recorded(config: ml_collections.ConfigDict) -> dict:
    """The config as config.json holds it after a round trip (tuples as lists)."""
    return json.loads(layout.config_json(config))


def changes(policy: Policy, config: ml_collections.ConfigDict, recorded: dict) -> list[str]:
    """The fields of `config` (paths absolute) that differ from the recorded run's and are
    not harmless to `policy`."""
    try:
        recorded = _as_recorded(policy.resolve_paths(ml_collections.ConfigDict(recorded)))
    except Exception:  # noqa: BLE001 - an odd record (hand-edited, older): as it is
        recorded = json.loads(json.dumps(recorded))
    return config_changes(recorded, _as_recorded(config), _as_recorded(policy.defaults()),
                          policy.harmless)


def decide(policy: Policy, config: ml_collections.ConfigDict, workdir: paths.Path,
           allow_config_change: bool = False) -> Decision:
    """What the run of `config` (validated, paths absolute) does in `workdir`; raises
    layout.WorkdirError (one line) for another mode's workdir and, unless
    `allow_config_change`, for a changed config. Reads only."""
    recorded = layout.recorded_config(workdir)
    if recorded is None:
        return Decision.START
    mode = recorded.get("mode", "pretrain")
    if mode != policy.mode:
        raise layout.WorkdirError(f"{workdir} holds a {mode} run, not a {policy.noun} run; "
                                  "use another --workdir")
    changed = changes(policy, config, recorded)
    if changed:
        if not allow_config_change:
            shown = ", ".join(f"config.{k}" for k in changed[:5])
            more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
            raise layout.WorkdirError(
                f"{workdir} holds a run with a different {shown}{more}; use another "
                f"--workdir, or pass --allow_config_change to {policy.override_words} "
                "anyway")
        return policy.override
    return Decision.FINISHED if policy.finished(workdir, config) else Decision.CONTINUE


def restore_or_init(ckpt: checkpoint_lib.Checkpointer, target: Any, init: Callable[[], Any],
                    resume: bool = True) -> tuple[int, Any, engine.Progress]:
    """(start step, state, progress): the latest checkpoint restored into `target`'s
    shapes and shardings (whatever mesh saved it; a damaged newest checkpoint gives way to
    the one before it) with the evaluations, skipped updates and step metrics it carried,
    or `init()` at step 0 when there is none (or not `resume`)."""
    restored = ckpt.restore_latest(target) if resume else None
    if restored is None:
        return 0, init(), engine.Progress()
    step, state, meta = restored
    logging.info("resumed from checkpoint at step %d (%s/%d)", step, ckpt.directory, step)
    return step, state, engine.Progress.from_meta(meta)


def decided(policy: Policy, config: ml_collections.ConfigDict, workdir: paths.Path,
            allow_config_change: bool = False) -> Decision:
    """`decide` on process 0 (the others wait), its decision on every process."""
    decision = Decision.START
    with distributed.as_one(f"{policy.noun} workdir"):
        if distributed.is_leader():
            decision = decide(policy, config, workdir, allow_config_change)
    if distributed.leader_says_ok(decision is Decision.FINISHED):
        return Decision.FINISHED
    if distributed.leader_says_ok(decision is Decision.CONTINUE):
        return Decision.CONTINUE
    return Decision.START


@dataclasses.dataclass
class Session:
    """An open run in its workdir: where the loop starts and what it writes to."""

    start: int  # the step the loop resumes after (0: a fresh state)
    state: Any
    progress: engine.Progress  # what the checkpoint at `start` carried
    ckpt: checkpoint_lib.Checkpointer
    writer: metrics_lib.MetricWriter


@contextlib.contextmanager
def session(workdir: paths.Path, config: ml_collections.ConfigDict, target: Any,
            init: Callable[[], Any], keep: int | checkpoint_lib.Keep, resume: bool,
            make_way: Callable[[], None] | None = None,
            records: Sequence[Callable[[], None]] = (),
            trackers: tuple[str, ...] = ("tensorboard",),
            tracked: dict | None = None) -> Iterator[Session]:
    """Opens the run of `config` in `workdir`, in the one order of every mode (above):
    process 0, while the others wait, calls `make_way()` (what a new run must not find);
    the latest checkpoint of workdir/checkpoints (keeping `keep`: the latest N, or
    a checkpoint_lib.Keep with milestones) is restored into
    `target`'s shapes and shardings when `resume`, else `init()` is the state at step 0;
    process 0 writes config.json and calls each of `records` (the mode's own files); the
    metrics writer opens at the start step, with `trackers` (metrics.TRACKERS' names)
    told `tracked` (the run's config and data fingerprint). However the block ends, the
    checkpointer (its pending saves) and the writer are closed."""
    with distributed.as_one("workdir made ready"):
        if distributed.is_leader():
            paths.make_dirs(workdir)
            if make_way is not None:
                make_way()
    dump = stacks.on_signal(workdir / layout.STACKS_DIR, jax.process_index())
    logging.info("%s", stacks.describe(dump))
    with contextlib.closing(checkpoint_lib.Checkpointer(workdir / layout.CHECKPOINTS,
                                                        keep)) as ckpt:
        start, state, progress = restore_or_init(ckpt, target, init, resume)
        with distributed.as_one("run records"):
            if distributed.is_leader():
                layout.write_config(workdir, config)
                for record in records:
                    record()
        with contextlib.closing(metrics_lib.MetricWriter(
                workdir, resume_step=start, enabled=distributed.is_leader(),
                trackers=trackers, record=tracked)) as writer:
            yield Session(start, state, progress, ckpt, writer)
