"""The jitted steps every trainer compiles the same way (pretraining's, fine-tuning's, a
seed group's): the train step with its state donated and its batch split over data x fsdp,
the eval step with its outputs replicated. Fixed shardings in and out, so each compiles
once per batch shape.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import Mesh

from maelm_jax.infra import sharding
from maelm_jax.training import state as state_lib


def jit_train_step(train_step: Callable, setup: state_lib.StateSetup, mesh: Mesh,
                   compiler_options: dict | None = None,
                   batch_layout: jax.sharding.NamedSharding | None = None,
                   replicated_args: int = 0) -> Callable:
    """A train step (pretraining's or fine-tuning's: state, batch, *args -> state, metrics)
    compiled for the mesh: state in its shardings (donated), every array of the batch split
    over data x fsdp (or as `batch_layout` says), the `replicated_args` further arguments
    (pretraining's schedule) and the metrics replicated. Fixed shardings in and out, so it
    compiles once per batch shape."""
    return jax.jit(
        train_step,
        in_shardings=(setup.shardings, batch_layout or sharding.batch_sharding(mesh),
                      *[sharding.replicated(mesh)] * replicated_args),
        out_shardings=(setup.shardings, sharding.replicated(mesh)),
        donate_argnums=0,
        compiler_options=compiler_options,
    )


def jit_eval_step(eval_step: Callable, setup: state_lib.StateSetup, mesh: Mesh,
                  compiler_options: dict | None = None, replicated_args: int = 0) -> Callable:
    """An eval step (pretraining's or fine-tuning's: params, batch, *args -> sums or
    outputs) compiled for the mesh: parameters in the state's shardings, every array of the
    batch split over data x fsdp, the `replicated_args` further arguments (an eval key) and
    the outputs replicated, so every process reads whole results."""
    return jax.jit(
        eval_step,
        in_shardings=(setup.shardings.params, sharding.batch_sharding(mesh),
                      *[sharding.replicated(mesh)] * replicated_args),
        out_shardings=sharding.replicated(mesh),
        compiler_options=compiler_options,
    )
