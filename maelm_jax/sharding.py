"""Device mesh and the logical-to-mesh sharding rules.

Every parameter and key activation carries logical axis names (``embed``, ``heads``,
``mlp``, ``vocab``, ``batch``, ...). One rules table in the config maps them to mesh axes:

* ``data``   pure data parallelism: the batch is split, parameters are replicated;
* ``fsdp``   the batch is split too, and parameters and optimiser state are sharded
             along ``embed`` (gathered just in time by XLA);
* ``tensor`` heads, the MLP and the vocabulary are split (Megatron-style).

The same config runs on one CPU or on a pod by changing ``mesh.shape`` only.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from maelm_jax import errors

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# logical axis -> mesh axis (or axes, or None = replicated). Flax uses a mesh axis at most
# once per array, so ('dec_embed', 'embed') kernels shard only their first axis on fsdp.
DEFAULT_RULES = (
    ("batch", BATCH_AXES),
    ("length", None),
    ("embed", "fsdp"),
    ("dec_embed", "fsdp"),
    ("heads", "tensor"),
    ("kv", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("positions", None),
    ("rel_buckets", None),
    ("layers", None),  # the stacked layers of model.scan_layers
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_mlp", "tensor"),
)


class MeshError(errors.UserError):
    """A mesh that does not fit the devices or the batch."""


def resolve_shape(shape: Sequence[int], num_devices: int) -> tuple[int, ...]:
    """Replaces one -1 by what the other axes leave of num_devices; checks the product."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != len(MESH_AXES):
        raise MeshError(f"config.mesh.shape: expected {len(MESH_AXES)} sizes for axes "
                        f"{MESH_AXES}, got {shape}")
    if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
        raise MeshError(f"config.mesh.shape: expected positive sizes and at most one -1, "
                        f"got {shape}")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if num_devices % known:
            raise MeshError(f"config.mesh.shape={shape}: {num_devices} devices are not "
                            f"divisible by {known}")
        shape = tuple(num_devices // known if s == -1 else s for s in shape)
    if math.prod(shape) != num_devices:
        raise MeshError(f"config.mesh.shape={shape} needs {math.prod(shape)} devices, but "
                        f"{num_devices} are available; use -1 for 'the rest'")
    return shape


def make_mesh(shape: Sequence[int], devices: Sequence[Any] | None = None) -> Mesh:
    """A mesh over all (or the given) devices with classic automatic sharding axes."""
    devices = list(devices if devices is not None else jax.devices())
    shape = resolve_shape(shape, len(devices))
    if devices == list(jax.devices()):
        # make_mesh orders devices for the physical topology (ICI rings on TPU).
        return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(shape))
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES,
                axis_types=(AxisType.Auto,) * len(shape))


def fixed_mesh(shape: Sequence[int]) -> Mesh:
    """A mesh of exactly the sizes given, on the first devices: fine-tuning and the
    analyses use a few devices of a larger host when asked to. All devices when a size is
    -1 or the job has several processes (each must hold part of the mesh)."""
    shape = tuple(int(s) for s in shape)
    if -1 in shape or jax.process_count() > 1:
        return make_mesh(shape)
    return make_mesh(shape, jax.devices()[: max(math.prod(shape), 1)])


def data_parallel_size(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def check_batch(mesh: Mesh, batch_size: int, grad_accum_steps: int) -> None:
    """Every micro-batch is split evenly over the data-parallel devices."""
    dp = data_parallel_size(mesh)
    micro = batch_size // grad_accum_steps
    if micro % dp:
        raise MeshError(f"config.train.batch_size={batch_size} / grad_accum_steps="
                        f"{grad_accum_steps} = {micro} sequences per micro-batch is not "
                        f"divisible by the data-parallel size {dp} (mesh data x fsdp)")


def rules_from_config(rules) -> tuple:
    """The config's rules as a tuple of (logical name, mesh axes) pairs."""
    out = []
    for logical, mesh_axes in rules:
        if isinstance(mesh_axes, list):
            mesh_axes = tuple(mesh_axes)
        out.append((logical, mesh_axes))
    return tuple(out)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """[batch, ...] arrays split over data x fsdp."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def stacked_batch_sharding(mesh: Mesh) -> NamedSharding:
    """[runs, batch, ...] arrays (a seed group's batches, one per run): the runs axis
    whole on every device, the batch split as batch_sharding splits it."""
    return NamedSharding(mesh, PartitionSpec(None, BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def process_rows(mesh: Mesh, batch_size: int) -> tuple[int, int]:
    """(first row, number of rows) of the global batch held by this process's devices."""
    index_map = batch_sharding(mesh).addressable_devices_indices_map((batch_size,))
    starts = [idx[0].start or 0 for idx in index_map.values()]
    stops = [batch_size if idx[0].stop is None else idx[0].stop for idx in index_map.values()]
    start, stop = min(starts), max(stops)
    rows = {r for a, b in zip(starts, stops, strict=False) for r in range(a, b)}
    if len(rows) != stop - start:
        raise MeshError("this process's devices hold non-contiguous rows of the batch; order "
                        "the mesh's devices by process (jax.make_mesh does)")
    return start, stop - start


def global_batch(local_rows: np.ndarray, mesh: Mesh) -> jax.Array:
    """A global [batch, L] array from this process's rows (its share of the batch)."""
    return jax.make_array_from_process_local_data(batch_sharding(mesh), local_rows)


def global_batch_from_full(rows: np.ndarray, mesh: Mesh,
                           layout: NamedSharding | None = None) -> jax.Array:
    """A global array from data every process holds in full (the validation batches), laid
    out by `layout` (default batch_sharding)."""
    layout = layout if layout is not None else batch_sharding(mesh)
    return jax.make_array_from_callback(rows.shape, layout, lambda index: rows[index])


def optimizer_specs(tx: optax.GradientTransformation, opt_state: Any, param_specs: Any) -> Any:
    """Logical PartitionSpecs of an optimiser state (shapes from jax.eval_shape): every
    moment takes its parameter's axes, counts and other scalars replicate. Pretraining and
    fine-tuning shard their optimiser states through this one rule."""
    return optax.tree_map_params(
        tx,
        lambda _, spec: spec,
        opt_state,
        param_specs,
        transform_non_params=lambda _: PartitionSpec(),
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


@contextlib.contextmanager
def activate(mesh: Mesh, rules: tuple):
    """Mesh and rules in context while tracing, so the models' logical constraints apply."""
    # Flax only here: config files read DEFAULT_RULES and must not import Flax.
    import flax.linen as nn

    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield
