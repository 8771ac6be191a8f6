"""Orbax checkpoints: the train state (model, optimiser, step, RNG) and a JSON record of
the loop's progress, saved asynchronously at the steps the training loop chooses, keeping
the last K and milestones kept for good (`Keep`: every N steps, chosen steps).

Orbax writes each step into a temporary directory and renames it when complete, so a
checkpoint interrupted by a crash is never listed as the latest. A complete checkpoint can
still be damaged later (a bad disk, a partial copy). Orbax guarantees only the commit, and
a damaged byte in a file it does not read, or inside a compressed chunk, can pass its own
checks; so once a save has finished, process 0 writes ``digests.json`` into the step
(every file's size and SHA-256). `restore_latest` checks it, then orbax's restore, then
that the values are finite and the step is the one named; a step that fails is reported
with a warning naming it and the cause, set aside as ``<step>.damaged`` (never deleted),
and the run resumes from the newest step that passes.

The directory may be in a bucket (``gs://``): orbax then marks a finished step with a
commit file instead of a rename, the digests read every file of a step back once after
it is written, and setting a step aside is a copy and a delete, object by object (a
process killed during it leaves part of the step under each name; what is left under
``<step>`` then fails its checks, or lacks its commit file and is no longer a step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from maelm_jax.infra import distributed, errors, paths
from maelm_jax.models import layer_layout
from maelm_jax.workdirs import layout

DAMAGED_SUFFIX = ".damaged"
DIGEST_FILE = "digests.json"  # in each finished step: relative path -> [size, sha256]
_STATUS_CODE = re.compile(r"^[A-Z_]{4,}: ")  # tensorstore/absl status: "DATA_LOSS: ..."


class CheckpointError(errors.UserError):
    """A checkpoint that could not be written (full or read-only disk, ...)."""


@dataclasses.dataclass(frozen=True)
class Keep:
    """Which checkpoints the rotation keeps: the `latest` N, and milestones kept for good,
    every `period` steps (0: none) and at each of `steps`. A milestone is never rotated
    out (orbax's preservation policies: any of them keeps a step)."""

    latest: int
    period: int = 0
    steps: tuple[int, ...] = ()

    def milestone(self, step: int) -> bool:
        return (self.period > 0 and step % self.period == 0) or step in self.steps

    def policy(self) -> Any:
        kept = [ocp.checkpoint_managers.LatestN(self.latest)]
        if self.period:
            kept.append(ocp.checkpoint_managers.EveryNSteps(self.period))
        if self.steps:
            kept.append(ocp.checkpoint_managers.CustomSteps(list(self.steps)))
        return ocp.checkpoint_managers.AnyPreservationPolicy(kept)


class Checkpointer:
    def __init__(self, directory: paths.PathLike, keep: int | Keep, async_save: bool = True):
        """`keep`: the latest N checkpoints, or a `Keep` with milestones."""
        # Absolute, and a bucket's URI unchanged (orbax reads nothing from a relative path).
        self.directory = paths.resolve(directory, "checkpoint directory")
        self.keep = keep if isinstance(keep, Keep) else Keep(keep)
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                # The loop decides when to save (every save is forced); orbax's own
                # policy would also save at a run's first step.
                save_interval_steps=None,
                preservation_policy=self.keep.policy(),
                create=True,
                enable_async_checkpointing=async_save,
            ),
            item_names=(layout.STATE_ITEM, layout.META_ITEM),
        )
        self._undigested: list[int] = []  # saves started whose digests are not written

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Starts saving `state` at `step` (asynchronously).

        A failed write (also one of the previous asynchronous save, which surfaces here)
        raises CheckpointError; the checkpoints already complete stay untouched.
        """
        with self._reported("save the checkpoint of step", step):
            started = self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
                ),
                force=True,
            )
        if started:  # not when `step` is already saved
            # Orbax waited for the earlier saves before starting this one: they are final.
            self._write_digests(exclude=step)
            self._undigested.append(step)

    def _write_digests(self, exclude: int | None = None) -> None:
        """digests.json for every finished save (process 0; files on a shared disk)."""
        pending = [s for s in self._undigested if s != exclude]
        self._undigested = [s for s in self._undigested if s == exclude]
        if not distributed.is_leader():
            return
        for step in pending:
            step_dir = self.directory / str(step)
            try:
                digests = _digests(step_dir)
            except FileNotFoundError:  # a failed save, or one already rotated out
                continue
            paths.write_atomically(step_dir / DIGEST_FILE,
                                   json.dumps(digests, indent=0, sort_keys=True))

    def reached_preemption(self, step: int) -> bool:
        """JAX's preemption sync point (TPU maintenance events): all hosts agree to save."""
        return self.manager.reached_preemption(step)

    @contextlib.contextmanager
    def _reported(self, action: str, step: int):
        try:
            yield
        except errors.UserError:
            raise
        except Exception as e:  # orbax and tensorstore raise assorted OS/runtime errors
            if errors.interrupted(e):  # a Ctrl-C a library wrapped: not a disk's failure
                raise
            try:  # let earlier asynchronous saves finish, so they count as intact
                self.manager.wait_until_finished()
            except Exception as pending:  # noqa: BLE001 - report the first error, log this one
                logging.warning("an earlier checkpoint save also failed: %s", pending)
            latest = self._latest_complete()
            kept = (f"the checkpoint of step {latest} is intact" if latest is not None
                    else "no earlier checkpoint exists")
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(
                f"could not {action} {step} in {self.directory}: {reason} (is the disk full "
                f"or read-only?); {kept}") from e

    def restore(self, step: int, target: Any) -> tuple[Any, dict]:
        """Restores onto `target`'s structure, shapes and shardings (arrays or
        jax.ShapeDtypeStruct); without a target optax states would come back as lists."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        # A checkpoint of the other layer layout (model.scan_layers changed, or one written
        # before the option) restores in its own layout, then converts.
        saved = layer_layout.is_stacked(self._state_metadata(step))
        wanted = layer_layout.is_stacked(abstract)
        convert = None not in (saved, wanted) and saved != wanted
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(
                    layer_layout.to_layout(abstract, saved) if convert else abstract),
                meta=ocp.args.JsonRestore(),
            ),
        )
        state = restored.state
        if convert:
            shardings = jax.tree.map(lambda x: x.sharding, abstract)
            state = jax.device_put(layer_layout.to_layout(state, wanted), shardings)
        return state, restored.meta

    def _state_metadata(self, step: int) -> Any:
        """The saved state's tree of metadata (nested dicts), or None if unreadable."""
        try:
            return saved_tree(self.directory / str(step) / layout.STATE_ITEM)
        except Exception:  # unreadable metadata: the restore reports it
            return None

    def restore_latest(self, target: Any) -> tuple[int, Any, dict] | None:
        """(step, state, meta) of the newest checkpoint that restores and passes its checks
        (finite values, the step it claims), or None when there is no checkpoint.

        A checkpoint that fails is reported with a warning naming it and the cause, and is
        renamed to ``<step>.damaged`` once an older one has restored (so the run can write
        that step again); it is never deleted. When none restores, raises CheckpointError
        listing them and leaves them where they are.
        """
        failures: list[tuple[int, str]] = []
        self.manager.reload()  # what is on disk now
        for step in sorted(self.manager.all_steps(), reverse=True):
            intact = False
            try:
                check_digests(self.directory / str(step))
                intact = True
                state, meta = self.restore(step, target)
                _verify(step, state, meta)
            except Exception as e:  # orbax, tensorstore and JSON raise many types
                if errors.interrupted(e):  # a Ctrl-C a library wrapped: not damage
                    raise
                other = intact and model_mismatch(self._state_metadata(step), target)
                if other:  # intact, of another model: not damage, and nothing is set aside
                    raise CheckpointError(
                        f"checkpoint {self.directory / str(step)} holds another model than "
                        f"this config builds ({other}); continue the run with the config it "
                        "was written with (its config.json), or use another --workdir"
                    ) from None
                reason = failure_reason(e)
                failures.append((step, reason))
                logging.warning("checkpoint %s cannot be restored: %s; trying the previous "
                                "one", self.directory / str(step), reason)
                continue
            if failures:
                kept = self._set_aside([s for s, _ in failures])
                logging.warning("resuming from step %d: the newer checkpoint(s) %s could not be "
                                "restored and are kept as %s for inspection", step,
                                ", ".join(str(s) for s, _ in failures),
                                ", ".join(str(p) for p in kept))
            return step, state, meta
        if failures:
            steps = ", ".join(str(s) for s, _ in failures)
            raise CheckpointError(
                f"no checkpoint in {self.directory} can be restored (steps {steps}; the newest: "
                f"{failures[0][1]}); if they are damaged, move them out of {self.directory} "
                "to start this run again from step 0, or use another --workdir")
        return None

    def _set_aside(self, steps: list[int]) -> list[paths.Path]:
        """Renames damaged steps out of orbax's view (process 0; the others wait), so the
        resumed run can save those steps again. Returns the new names."""
        kept = []
        for step in steps:
            target, n = self.directory / f"{step}{DAMAGED_SUFFIX}", 1
            while target.exists():
                n += 1
                target = self.directory / f"{step}{DAMAGED_SUFFIX}{n}"
            if distributed.is_leader():
                (self.directory / str(step)).rename(target)
            kept.append(target)
        distributed.barrier("checkpoints set aside")
        self.manager.reload()
        return kept

    def wait(self, step: int | None = None) -> None:
        with self._reported("finish writing the checkpoint of step", step or -1):
            self.manager.wait_until_finished()
        self._write_digests()

    def _latest_complete(self) -> int | None:
        """The newest finalised step on disk (a half-written one never counts)."""
        return max(finished_steps(self.directory), default=None)

    def close(self) -> None:
        self.manager.close()
        if self._undigested:
            try:
                self._write_digests()
            except OSError as e:  # a digest is a check, not the checkpoint itself
                logging.warning("could not write checkpoint digests: %s", e)


def finished_steps(directory: paths.Path) -> list[int]:
    """The steps in `directory` whose save orbax finished: a step being written is a
    temporary directory locally, but in a bucket it has its final name and no commit file
    yet."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir()
                  if p.name.isdigit() and ocp.utils.is_checkpoint_finalized(p))


def _size_and_sha256(path: paths.Path) -> tuple[int, str]:
    size, sha = 0, hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            size += len(chunk)
            sha.update(chunk)
    return size, sha.hexdigest()


def _digests(step_dir: paths.Path) -> dict[str, list]:
    if not step_dir.is_dir():
        raise FileNotFoundError(step_dir)
    out = {}
    for path in paths.files_under(step_dir):
        # digests.json itself, and a temporary one an interrupted write left.
        if not path.name.startswith((DIGEST_FILE, f".{DIGEST_FILE}.")):
            out[str(path.relative_to(step_dir))] = list(_size_and_sha256(path))
    return out


def check_digests(step_dir: paths.Path) -> None:
    """Raises ValueError naming the first file that differs from digests.json (a step
    without one, e.g. written by an older version, is left to orbax's own checks).
    Process 0 reads the files and tells the others."""
    problem = ""
    if distributed.is_leader() and (step_dir / DIGEST_FILE).is_file():
        try:
            problem = _unmerged(step_dir) or _digest_mismatch(step_dir)
        except Exception as e:  # noqa: BLE001 - whatever it is, the others must hear of it
            problem = f"its {DIGEST_FILE} cannot be checked ({type(e).__name__}: {e})"
    if not distributed.leader_says_ok(not problem):
        raise ValueError(problem or "process 0 found a file that differs from what was written")


def _unmerged(step_dir: paths.Path) -> str:
    """Why a step's state, committed, cannot be intact: orbax merges its per-process
    stores into one (manifest.ocdbt) at commit, and a merge that found nothing (its glob
    missed them) only warns, so the digests of what was written would pass."""
    state = step_dir / layout.STATE_ITEM
    names = {p.name for p in state.iterdir()} if state.is_dir() else set()
    if any(n.startswith("ocdbt.process_") for n in names) and "manifest.ocdbt" not in names:
        return (f"{layout.STATE_ITEM}/ was committed without its metadata (manifest.ocdbt: "
                "its per-process stores were never merged)")
    return ""


def _digest_mismatch(step_dir: paths.Path) -> str:
    for name, (size, digest) in json.loads(paths.read_text(step_dir / DIGEST_FILE)).items():
        path = step_dir / name
        if not path.is_file():
            return f"{name} is missing"
        found_size, found_digest = _size_and_sha256(path)
        if found_size != size:
            return f"{name} has {found_size} bytes, {size} were written"
        if found_digest != digest:
            return f"{name} differs from what was written (SHA-256 mismatch)"
    return ""


def saved_tree(item_dir: paths.Path) -> Any:
    """A saved item's tree of metadata (nested dicts of orbax's array metadata); raises
    what orbax raises for a directory it cannot read. Read through the item's handler: a
    CheckpointManager without a registry of handlers, or a Checkpointer, warns on every
    good checkpoint (an item "could not be restored", a metadata file "does not exist")."""
    handler = ocp.PyTreeCheckpointHandler()
    try:
        meta = handler.metadata(item_dir)
    finally:
        handler.close()
    return getattr(meta, "tree", meta)


def model_mismatch(saved: Any, target: Any) -> str | None:
    """The first parameter that a checkpoint's saved tree (orbax's metadata, nested dicts)
    and `target` (a train state) do not share, or share with another shape, compared in
    one layer layout; None when they agree or either has no params."""
    saved = saved.get("params") if isinstance(saved, dict) else None
    wanted = getattr(target, "params", None)
    if not isinstance(saved, dict) or wanted is None:
        return None

    def shapes(tree: Any) -> dict[str, tuple[int, ...]]:
        tree = jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype), tree)
        return {jax.tree_util.keystr(k): v.shape for k, v in
                jax.tree_util.tree_leaves_with_path(layer_layout.to_layout(tree, False))}

    have, want = shapes(saved), shapes(wanted)
    for name in sorted(have.keys() | want.keys()):
        if name not in have:
            return f"params{name} is not in the checkpoint"
        if name not in want:
            return f"params{name} is not in this model"
        if have[name] != want[name]:
            return f"params{name} is {have[name]} there, {want[name]} here"
    return None


def _verify(step: int, state: Any, meta: dict) -> None:
    """Checks that go beyond orbax's own: the step the checkpoint claims, and that every
    floating-point value is finite (the loop never saves a non-finite update)."""
    if int(meta.get("step", step)) != step or int(jax.device_get(state.step)) != step:
        raise ValueError(f"it records step {meta.get('step')} / {int(jax.device_get(state.step))}")
    floats = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
    finite = jax.jit(lambda xs: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs])))
    if floats and not bool(np.asarray(jax.device_get(finite(floats)))):
        raise ValueError("it holds non-finite values")


def failure_reason(error: BaseException) -> str:
    """One line from an exception chain: the innermost status message (tensorstore says
    which file and what is wrong), without the long tensorstore spec."""
    chain = []
    while error is not None and len(chain) < 10:
        chain.append(error)
        error = error.__cause__ or error.__context__
    text = next((str(e) for e in chain if _STATUS_CODE.match(str(e))), None)
    if text is None:
        first = chain[0]
        text = f"{type(first).__name__}: {first}" if str(first) else type(first).__name__
    line = text.strip().splitlines()[0] if text.strip() else text
    line = line.split(" [tensorstore_spec=")[0].split(" See full TensorStore details")[0]
    return line if len(line) <= 300 else line[:297] + "..."
