"""Orbax checkpoints: the train state (model, optimiser, step, RNG) and a JSON record of
the data position, saved asynchronously every N steps, keeping the last K.

Orbax writes each step into a temporary directory and renames it when complete, so a
checkpoint interrupted by a crash is never listed as the latest.
"""

from __future__ import annotations

import contextlib
import pathlib
from typing import Any, Optional

import jax
from absl import logging
import orbax.checkpoint as ocp

from maelm_jax import errors


class CheckpointError(errors.UserError):
    """A checkpoint that could not be written (full or read-only disk, ...)."""


class Checkpointer:
    def __init__(self, directory: pathlib.Path, every: int, keep: int, async_save: bool = True):
        self.directory = directory.absolute()
        self.manager = ocp.CheckpointManager(
            directory.absolute(),
            options=ocp.CheckpointManagerOptions(
                save_interval_steps=every,
                max_to_keep=keep,
                create=True,
                enable_async_checkpointing=async_save,
            ),
            item_names=("state", "meta"),
        )

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict, force: bool = False) -> bool:
        """Starts saving `state` at `step` if the interval says so (or `force`).

        A failed write (also one of the previous asynchronous save, which surfaces here)
        raises CheckpointError; the checkpoints already complete stay untouched.
        """
        with self._reported("save the checkpoint of step", step):
            return self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
                ),
                force=force,
            )

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
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
            ),
        )
        return restored.state, restored.meta

    def wait(self, step: int | None = None) -> None:
        with self._reported("finish writing the checkpoint of step", step or -1):
            self.manager.wait_until_finished()

    def _latest_complete(self) -> int | None:
        """The newest finalised step on disk (orbax renames a step's temporary directory
        only once every file is written, so a half-written one never counts)."""
        steps = [int(p.name) for p in self.directory.iterdir() if p.name.isdigit()] \
            if self.directory.exists() else []
        return max(steps, default=None)

    def close(self) -> None:
        self.manager.close()
