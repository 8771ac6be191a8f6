"""How a train state, or a bare parameter tree, is laid out on a mesh: `build`.

Every leaf's sharding comes from logical axis names and one rules table (the config's
sharding_rules; sharding.DEFAULT_RULES by default), in three moves:

1. `jax.eval_shape` of the initialisation gives every leaf's shape and dtype without
   allocating anything, so a model too large for one device is laid out before any of it
   exists;
2. each parameter takes the logical axes its module boxed it with (nn.LogicallyPartitioned,
   e.g. a query kernel [embed, heads, kv]); the optimiser's moments take their parameter's
   (sharding.optimizer_specs); every other leaf (the step, key data) is replicated;
3. the rules turn those logical specs into a NamedSharding per leaf.

The initialisation is then compiled with those shardings as its out_shardings, so each
device computes only its own shards. Pretraining (pretrain/steps.py), fine-tuning
(finetune/train.py) and the analyses that only read an encoder's parameters all lay out
their states here, so a parameter is sharded alike in each, and a checkpoint restores
straight into the `abstract` tree of any mesh.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import optax
from jax.sharding import Mesh, PartitionSpec

from maelm_jax.infra import sharding


class StateSetup(NamedTuple):
    """A state's layout on a mesh, and how to build it fresh. The trees have the state's
    structure, one entry per array leaf."""

    init: Callable[..., Any]  # returns the initial state, each leaf in its sharding
    abstract: Any  # jax.ShapeDtypeStruct leaves carrying their shardings (a restore target)
    shardings: Any  # a NamedSharding per leaf
    logical_specs: Any  # a PartitionSpec of logical axis names per leaf


def abstract_params(init_params: Callable[[], Any]) -> Any:
    """The parameters `init_params()` would create, as unboxed jax.ShapeDtypeStruct leaves
    (no sharding, nothing allocated)."""
    return nn.meta.unbox(jax.eval_shape(init_params))


def build(init_params: Callable[[], Any], mesh: Mesh, rules: tuple,
          make_state: Callable[[Any], Any] | None = None,
          tx: optax.GradientTransformation | None = None,
          compiler_options: dict | None = None) -> StateSetup:
    """The layout of the state `make_state` builds around fresh parameters.

    init_params() -> the model's parameters, boxed with their logical axes
        (`model.init(key, ...)["params"]`); traced, never run eagerly.
    make_state(params) -> the train state holding the unboxed `params`: a flax struct
        dataclass with a `params` field and, when `tx` is given, an `opt_state` field (the
        moments get their parameters' axes); its other leaves are replicated. None: the
        state is the parameter tree itself.
    compiler_options: XLA options for the compiled initialisation.
    """

    def init() -> Any:
        params = nn.meta.unbox(init_params())
        return params if make_state is None else make_state(params)

    with sharding.activate(mesh, rules):
        param_specs = nn.get_partition_spec(jax.eval_shape(init_params))
        shapes = jax.eval_shape(init)
    if make_state is None:
        logical_specs = param_specs
    else:
        logical_specs = jax.tree.map(lambda _: PartitionSpec(), shapes).replace(params=param_specs)
        if tx is not None:
            logical_specs = logical_specs.replace(
                opt_state=sharding.optimizer_specs(tx, shapes.opt_state, param_specs))
    shardings = nn.logical_to_mesh_sharding(logical_specs, mesh, rules)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            shapes, shardings)
    jitted = jax.jit(init, out_shardings=shardings, compiler_options=compiler_options)

    def sharded_init() -> Any:
        with sharding.activate(mesh, rules):  # the models' logical constraints apply
            return jitted()

    return StateSetup(sharded_init, abstract, shardings, logical_specs)
