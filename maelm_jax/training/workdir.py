"""The run's working directory: its config record, and changes that are all-or-nothing.

A workdir belongs to one run. Starting again with a config that would change what the
checkpoints mean (another model, tokenizer, corpus, masking, seed or batch) is refused
unless explicitly allowed; settings that only change how the run proceeds (steps, logging,
checkpoint cadence, mesh) may change, since checkpoints restore onto any mesh.
"""

from __future__ import annotations

import contextlib
import json

import ml_collections

from maelm_jax import config as config_lib
from maelm_jax import layout, paths

# Fields that may differ between a run and its resumption (dotted prefixes).
_RESUMABLE_CHANGES = (
    "train.num_steps",
    "train.log_every",
    "train.eval_every",
    "train.eval_batches",
    "train.checkpoint_every",
    "train.resume_saves",
    "train.keep_checkpoints",
    "train.nonfinite",
    "data.prefetch",
    "data.prepared_cache_gb",
    "data.cache_dir",
    "data.encoding_errors",
    "mesh",
    "sharding_rules",
    "model.dtype",
    "model.attention_impl",
    "model.pallas",
    "model.scan_layers",  # the checkpoint converts between the layouts on restore
    "model.remat_policy",
    "train.peak_tflops_per_device",
)


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flatten(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], tree


# Maps whose keys the user names: the defaults' entries are examples, not fields.
_NAMED_BY_USER = ("data.sources.",)


def config_changes(old: dict, new: dict, defaults: dict | None = None) -> list[str]:
    """Dotted fields whose values differ and that a resumed run may not change.

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
    return [k for k in changed
            if not any(k == p or k.startswith(p + ".") for p in _RESUMABLE_CHANGES)]


def check_directory(workdir: paths.Path) -> None:
    """Refuses a workdir path that is, or lies under, something other than a directory,
    and one in a bucket that does not exist (nothing here creates buckets)."""
    for path in paths.lineage(workdir):
        if path.exists():
            if not path.is_dir():
                raise layout.WorkdirError(
                    f"--workdir {workdir}: {path} exists and is not a directory; "
                    "give a new or existing directory")
            return
    raise layout.WorkdirError(
        f"--workdir {workdir}: the bucket {paths.lineage(workdir)[-1]} does not exist or "
        "cannot be read; create it, or check the name and your credentials")


def _with_absolute_paths(recorded: dict) -> dict:
    """The recorded config with its paths made absolute; a record that does not resolve
    (hand-edited, an older layout) is compared as it is."""
    try:
        return config_lib.resolve_paths(ml_collections.ConfigDict(recorded)).to_dict()
    except Exception:  # noqa: BLE001 - any odd record: compare it unchanged
        return recorded


def check_compatible(config: ml_collections.ConfigDict, workdir: paths.Path,
                     allow_config_change: bool) -> None:
    """Refuses a workdir whose recorded run used a config this one cannot continue."""
    if allow_config_change:
        return
    recorded = layout.recorded_config(workdir)
    if recorded is None:
        return
    if recorded.get("mode", "pretrain") != "pretrain":
        raise layout.WorkdirError(
            f"{workdir} holds a {recorded.get('mode')} run, not a pretraining run; use "
            "another --workdir")
    # A round trip through JSON makes tuples lists on both sides. Relative paths recorded
    # by older versions meant the current directory, as they do now.
    new = json.loads(config_lib.to_json(config))
    defaults = json.loads(config_lib.to_json(config_lib.pretrain_defaults()))
    changed = config_changes(json.loads(json.dumps(_with_absolute_paths(recorded))), new,
                             defaults)
    if changed:
        shown = ", ".join(f"config.{k}" for k in changed[:5])
        more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
        raise layout.WorkdirError(
            f"{workdir} holds a run with a different {shown}{more}; use another --workdir, "
            "or pass --allow_config_change to continue it with the new config anyway")


@contextlib.contextmanager
def all_or_nothing(workdir: paths.Path):
    """Removes whatever the block created in `workdir` (and the workdir itself, if it did
    not exist) when the block fails, so a rejected run leaves the workdir as it was.

    In a bucket the removal is object by object, so a process killed during it can leave
    part of what the block wrote (never anything that was there before)."""
    existed = workdir.exists()
    before = set(workdir.iterdir()) if existed else set()
    try:
        yield
    except BaseException:
        if not existed:
            paths.remove(workdir)
        elif workdir.exists():
            for path in set(workdir.iterdir()) - before:
                paths.remove(path)
        raise
