"""The run's working directory: a path that can be one, and changes that are
all-or-nothing. (What a workdir's recorded run means for the next one: lifecycle.py.)
"""

from __future__ import annotations

import contextlib
import glob
import os

from maelm_jax.infra import paths
from maelm_jax.workdirs import layout


def check_directory(workdir: paths.Path) -> None:
    """Refuses a workdir path that is, or lies under, something other than a directory,
    one in a bucket that does not exist (nothing here creates buckets), and one that reads
    as a glob pattern (`check_name`)."""
    check_name(workdir)
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


def check_name(workdir: paths.Path) -> None:
    """Refuses a workdir whose path holds a glob's special characters (``[`` ``]`` ``*``
    ``?``), before anything is written. Orbax finds a checkpoint's per-process stores, to
    merge them at commit, with a glob of the checkpoint's path: ``sweep[lr=3e-3]`` is a
    character class there, nothing matches, and every checkpoint commits without its
    metadata (intact to its digests, yet not restorable); ``*`` and ``?`` could match a
    neighbour's stores. Reading such a path (fill-mask, export, init_from) is not refused:
    only a commit globs."""
    text = os.fspath(workdir)
    if glob.escape(text) != text:
        suggested = os.path.basename(text.rstrip("/"))
        for char in "[]*?":
            suggested = suggested.replace(char, "_")
        raise layout.WorkdirError(
            f"--workdir {workdir}: its path holds a glob character ([ ] * ?), which the "
            "checkpoint library reads as a pattern (its checkpoints would not restore); "
            f"name it without them, e.g. {suggested.strip('_') or 'run'}")


def claim(workdir: paths.Path, kind: str, noun: str) -> None:
    """Refuses, before anything is written, a workdir that cannot be one (check_directory)
    or that holds another mode's run (its config.json names another mode): every mode
    writes only into a new directory or one of its own kind (layout.KINDS). `noun`: what
    the mode does, for the message ("prepare", "pool the calls")."""
    check_directory(workdir)
    recorded = layout.mode(workdir) if workdir.is_dir() else None
    if recorded is not None and recorded != kind:
        raise layout.WorkdirError(f"--workdir {workdir} holds a {recorded} run; {noun} into "
                                  "another directory")


@contextlib.contextmanager
def all_or_nothing(workdir: paths.Path):
    """Removes whatever the block created in `workdir` (and the workdir itself, if it did
    not exist) when the block fails, so a rejected run leaves the workdir as it was.

    In a bucket the removal is object by object, so a process killed during it can leave
    part of what the block wrote (never anything that was there before)."""
    before = snapshot(workdir)
    try:
        yield
    except BaseException:
        restore(workdir, before)
        raise


def snapshot(workdir: paths.Path) -> set | None:
    """What `workdir` holds now (its top-level entries; None: it does not exist)."""
    return set(workdir.iterdir()) if workdir.exists() else None


def restore(workdir: paths.Path, before: set | None) -> None:
    """Removes what was created in `workdir` since `snapshot` gave `before` (the workdir
    itself if it did not exist then)."""
    if before is None:
        paths.remove(workdir)
    elif workdir.exists():
        for path in set(workdir.iterdir()) - before:
            paths.remove(path)
