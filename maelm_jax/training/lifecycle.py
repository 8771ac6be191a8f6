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
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Callable
from typing import Any

import ml_collections
from absl import logging

from maelm_jax import layout, paths
from maelm_jax.training import checkpoint as checkpoint_lib
from maelm_jax.training import engine


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
