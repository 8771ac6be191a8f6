"""Device mesh and the logical-to-mesh sharding rules.

Every parameter and key activation carries logical axis names (``embed``, ``heads``,
``mlp``, ``vocab``, ``batch``, ...). One rules table in the config maps them to mesh axes:

* ``data``   pure data parallelism: the batch is split, parameters are replicated;
* ``fsdp``   the batch is split too, and parameters and optimiser state are sharded
             along ``embed`` (gathered just in time by XLA);
* ``tensor`` heads, the MLP and the vocabulary are split (Megatron-style).

The same config runs on one CPU or on a pod by changing ``mesh.shape`` only; a multislice
TPU job adds ``mesh.dcn_shape``, how the slices lay out along the same axes (data parallel
across slices by default).

Devices are in the order of the hardware's links (`jax.make_mesh`), not of the processes,
so the batch rows a host feeds are spans of the batch, not always one range
(`process_spans`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from maelm_jax.infra import errors

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


def resolve_shape(shape: Sequence[int], num_devices: int, field: str = "config.mesh.shape",
                  what: str = "devices") -> tuple[int, ...]:
    """Replaces one -1 by what the other axes leave of num_devices; checks the product.
    `field` and `what` name the config field and its unit in the errors (the DCN shape
    counts slices)."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != len(MESH_AXES):
        raise MeshError(f"{field}: expected {len(MESH_AXES)} sizes for axes "
                        f"{MESH_AXES}, got {shape}")
    if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
        raise MeshError(f"{field}: expected positive sizes and at most one -1, "
                        f"got {shape}")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if num_devices % known:
            raise MeshError(f"{field}={shape}: {num_devices} {what} are not "
                            f"divisible by {known}")
        shape = tuple(num_devices // known if s == -1 else s for s in shape)
    if math.prod(shape) != num_devices:
        raise MeshError(f"{field}={shape} needs {math.prod(shape)} {what}, but "
                        f"{num_devices} are available; use -1 for 'the rest'")
    return shape


def slice_count(devices: Sequence[Any]) -> int:
    """The TPU slices the devices span (a multislice job joins slices over the data-center
    network, DCN); 1 where devices have no slice index (one slice, GPUs, CPUs)."""
    return len({getattr(d, "slice_index", None) or 0 for d in devices})


def make_mesh(shape: Sequence[int], devices: Sequence[Any] | None = None,
              dcn_shape: Sequence[int] = (-1, 1, 1)) -> Mesh:
    """A mesh over all (or the given) devices with classic automatic sharding axes.

    `shape` is the mesh within one slice (its axes ride the fast ICI links), `dcn_shape`
    how the slices are laid out along the same axes (default: data parallel across
    slices); each mesh axis is their product. With one slice `dcn_shape` resolves to
    ones. A job without TPU slices may still ask for a DCN layout (`dcn_shape` other than
    ones): its processes (hosts) are then the granules, as on a GPU cluster."""
    devices = list(devices if devices is not None else jax.devices())
    slices = slice_count(devices)
    granules = slices if slices > 1 else None
    dcn = tuple(int(s) for s in dcn_shape)
    if granules is None and any(s > 1 for s in dcn):
        granules = len({d.process_index for d in devices})
    dcn = resolve_shape(dcn, granules or 1, "config.mesh.dcn_shape", "slices" if slices > 1
                        else "processes")
    if len(devices) % (granules or 1):
        raise MeshError(f"config.mesh.dcn_shape={dcn}: {len(devices)} devices do not split "
                        f"evenly over {granules} processes")
    ici = resolve_shape(shape, len(devices) // (granules or 1))
    types = (AxisType.Auto,) * len(ici)
    if granules and granules > 1:
        # Each slice (or process) a block of the mesh in ICI order, the blocks along the
        # DCN axes: only collectives over those axes cross the slower network.
        grid = mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices, process_is_granule=slices == 1)
        return Mesh(grid, MESH_AXES, axis_types=types)
    if devices == list(jax.devices()) or _whole_topology(devices):
        # make_mesh orders devices for the physical topology (ICI rings on TPU), not by
        # process: a process's batch rows need not be contiguous (process_spans).
        try:
            return jax.make_mesh(ici, MESH_AXES, axis_types=types, devices=devices)
        except (NotImplementedError, ValueError) as e:  # no way to lay the axes on the links
            chips = "x".join(str(max(d.coords[i] for d in devices) + 1) for i in range(3)) \
                if all(hasattr(d, "coords") for d in devices) else f"{len(devices)} devices"
            raise MeshError(f"config.mesh.shape={ici} does not fit the slice's {chips} "
                            "chips: each axis must be a product of some of its axis sizes "
                            "(try the sizes in another order)") from e
    return Mesh(np.asarray(devices).reshape(ici), MESH_AXES, axis_types=types)


def _whole_topology(devices: Sequence[Any]) -> bool:
    """Compile-only TPU devices of a topology description (maelm_jax/infra/topology.py): a
    whole slice, which jax.make_mesh lays out as on the hardware."""
    return bool(devices) and all(d.platform == "tpu" for d in devices) and \
        jax.default_backend() != "tpu"


def fixed_mesh(shape: Sequence[int], dcn_shape: Sequence[int] = (-1, 1, 1)) -> Mesh:
    """A mesh of exactly the sizes given, on the first devices: fine-tuning and the
    analyses use a few devices of a larger host when asked to. All devices when a size is
    -1 or the job has several processes (each must hold part of the mesh)."""
    shape = tuple(int(s) for s in shape)
    if -1 in shape or jax.process_count() > 1 or slice_count(jax.devices()) > 1:
        return make_mesh(shape, dcn_shape=dcn_shape)
    return make_mesh(shape, jax.devices()[: max(math.prod(shape), 1)], dcn_shape)


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


def process_spans(mesh: Mesh, batch_size: int,
                  process: int | None = None) -> list[tuple[int, int]]:
    """The rows of the global batch that `process` (default: this one) holds, as sorted
    [start, stop) spans: the union of its devices' shards. A TPU mesh lays its devices out
    for the ICI torus, not by process, so the spans of a host need not be contiguous; every
    process holds as many rows as the others (jax.make_array_from_process_local_data
    places a process's rows in this order)."""
    process = jax.process_index() if process is None else process
    index_map = batch_sharding(mesh).devices_indices_map((batch_size,))
    held = {p: set() for p in {d.process_index for d in mesh.devices.flat}}
    for device, (rows,) in index_map.items():
        held[device.process_index].update(range(*rows.indices(batch_size)))
    counts = {len(rows) for rows in held.values()}
    if len(counts) != 1:
        raise MeshError(f"config.mesh.shape: the processes hold unequal shares of the batch "
                        f"of {batch_size} ({sorted(counts)} rows); give every host the same "
                        "number of devices")
    spans: list[tuple[int, int]] = []
    for row in sorted(held[process]):
        if spans and spans[-1][1] == row:
            spans[-1] = (spans[-1][0], row + 1)
        else:
            spans.append((row, row + 1))
    return spans


def describe_spans(spans: Sequence[tuple[int, int]]) -> str:
    """'[0, 4) + [8, 12)': spans for the logs."""
    return " + ".join(f"[{a}, {b})" for a, b in spans)


def global_batch(local_rows: np.ndarray, mesh: Mesh) -> jax.Array:
    """A global [batch, ...] array from this process's rows: those of its process_spans,
    in order (contiguous or not)."""
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
