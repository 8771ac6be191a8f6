"""Orbax checkpoints: the train state (model, optimiser, step, RNG) and a JSON record of
the data position, saved asynchronously every N steps, keeping the last K.

Orbax writes each step into a temporary directory and renames it when complete, so a
checkpoint interrupted by a crash is never listed as the latest.
"""

from __future__ import annotations

import pathlib
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    def __init__(self, directory: pathlib.Path, every: int, keep: int, async_save: bool = True):
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
        """Starts saving `state` at `step` if the interval says so (or `force`)."""
        return self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=force,
        )

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

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()
