"""TPU slices without a TPU: compile-only devices of a named topology, and each TPU
generation's chip facts (peak FLOP/s, HBM) from JAX's own table.

libtpu (the version ``jax[tpu]`` pins, requirements-tpu-check.txt) describes any slice on
any host: `devices("v5e:8x8")` are the 64 chips of a v5e-64 in 16 hosts of 4, with the
device order, process indices and HBM of the real slice. A mesh over them compiles the
train step with XLA:TPU for real (its SPMD partitioner, collectives, memory planner and
Mosaic), so a step that does not fit the chip's HBM fails here as it would on the pod,
and `process_spans` can be checked for every host. Nothing runs: speed, the hardware
PRNG and the ICI bandwidth need a TPU.

A topology name is ``<generation>:<chips per axis>``, as Cloud TPU spells slice shapes:
``v5e:2x4``, ``v5e:8x8``, ``v6e:4x4``, ``v4:2x2x4``, ``v5p:4x4x4``, ``tpu7x:2x2x1``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os

import jax

from maelm_jax.infra import errors

# Generation as written in a topology name -> (libtpu's name, chip configuration). The
# chips of v4 and v5p pair their two TensorCores as one device ("megacore").
GENERATIONS = {
    "v4": ("v4", "megacore"),
    "v5p": ("v5", "megacore"),
    "v5e": ("v5e", "default"),
    "v6e": ("v6e", "default"),
    "tpu7x": ("tpu7x", "default"),
}
# Chips per host along each axis: 4 per VM in every multi-host slice.
CHIPS_PER_HOST = (2, 2, 1)


class TopologyError(errors.UserError):
    """A topology name that does not describe a slice libtpu knows."""


@dataclasses.dataclass(frozen=True)
class Topology:
    """A parsed topology name: the generation and the chips along each axis."""

    generation: str
    chips: tuple[int, ...]

    @property
    def name(self) -> str:
        return f"{self.generation}:{'x'.join(map(str, self.chips))}"

    @property
    def num_chips(self) -> int:
        return math.prod(self.chips)

    def wrap(self) -> tuple[bool, bool, bool]:
        """Which axes close into a ring (torus links): on the 2D lite chips an axis of 16
        chips; on the 3D chips every axis once the slice is a whole cube of 4 or more."""
        chips = (*self.chips, 1, 1)[:3]
        if len(self.chips) == 2:
            return tuple(c == 16 for c in chips)  # type: ignore[return-value]
        cube = all(c >= 4 and c % 4 == 0 for c in self.chips)
        return (cube, cube, cube)


def parse(name: str, field: str = "--topology") -> Topology:
    """`Topology` of a name such as ``v5e:8x8``; a TopologyError naming `field` else."""
    generation, _, shape = name.strip().lower().partition(":")
    try:
        chips = tuple(int(c) for c in shape.split("x"))
    except ValueError:
        chips = ()
    if generation not in GENERATIONS or len(chips) not in (2, 3) or min(chips, default=0) < 1:
        raise TopologyError(
            f"{field}: expected <generation>:<chips per axis> with a generation of "
            f"{', '.join(GENERATIONS)} (e.g. v5e:8x8, v4:2x2x4), got {name!r}")
    return Topology(generation, chips)


@contextlib.contextmanager
def _libtpu_without_a_tpu():
    """On a host without TPUs: JAX's CPU platform alone, and, while libtpu loads, the
    facts it would ask the (absent) TPU VM's metadata for, so that it prints no pages of
    warnings, and leave to share libtpu with other processes (tests compile in several
    at once; compile-only devices hold no chip). Its topology descriptions need no TPU
    runtime. The environment is restored afterwards (subprocesses must not inherit a
    TPU VM's settings); a TPU VM keeps its own."""
    from jax._src import hardware_utils

    if hardware_utils.num_available_tpu_chips_and_device_id()[0]:
        yield
        return
    if jax.config.jax_platforms is None:  # read when JAX's backends first start
        jax.config.update("jax_platforms", "cpu")
    settings = {"TPU_ACCELERATOR_TYPE": "v5litepod-1", "TPU_WORKER_HOSTNAMES": "localhost",
                "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    saved = {k: os.environ.get(k) for k in settings}
    os.environ.update({k: v for k, v in settings.items() if saved[k] is None})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)


def devices(name: str, num_slices: int = 1, field: str = "--topology") -> list:
    """The compile-only devices of `num_slices` slices of topology `name`, in the order
    libtpu gives (slice by slice). TopologyError if libtpu is absent or refuses the name."""
    topo = parse(name, field)
    try:
        import libtpu  # noqa: F401  (only to say what is missing)
    except ImportError:
        raise TopologyError(f"{field}: compiling for TPU topologies needs libtpu; "
                            "pip install -r requirements-tpu-check.txt") from None
    from jax.experimental import topologies

    libtpu_name, chip_config = GENERATIONS[topo.generation]
    try:
        with _libtpu_without_a_tpu():
            description = topologies.get_topology_desc(
                f"{libtpu_name}:{'x'.join(map(str, topo.chips))}", "tpu",
                chip_config_name=chip_config, chips_per_host_bounds=CHIPS_PER_HOST,
                num_slices=num_slices, wrap=topo.wrap())
    except Exception as e:  # libtpu reports an unknown or odd shape as a runtime error
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TopologyError(f"{field}: libtpu does not take {topo.name!r} "
                            f"({reason})") from None
    return list(description.devices)


@dataclasses.dataclass(frozen=True)
class ChipFacts:
    """What one JAX device of a TPU kind offers (a megacore chip counts both cores)."""

    peak_bf16_tflops: float
    hbm_bytes: int


def chip_facts(device_kind: str) -> ChipFacts | None:
    """Peak dense bf16 TFLOP/s and HBM of one device of `device_kind` ("TPU v5 lite",
    "TPU v5e", "TPU v4", "TPU7x", ...) from JAX's table of TPU chips
    (`jax.experimental.pallas.tpu.get_tpu_info_for_chip`); None for a kind it does not
    know (not a TPU, or a JAX without the table)."""
    try:
        from jax._src.pallas.mosaic import tpu_info
    except ImportError:
        return None
    version = tpu_info.chip_version_from_device_kind(device_kind.strip())
    if version is None:
        return None
    cores = 2 if version.supports_megacore else 1  # a megacore device is the whole chip
    info = tpu_info.get_tpu_info_for_chip(version, cores)
    return ChipFacts(info.bf16_ops_per_second * cores / 1e12, info.hbm_capacity_bytes * cores)

