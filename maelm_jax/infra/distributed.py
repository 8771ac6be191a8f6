"""Multi-host runs through JAX's own multi-controller runtime.

Every host runs the same command. `initialize` calls ``jax.distributed.initialize``:
with explicit coordinator/process flags when given, and with no arguments on every Cloud
TPU VM (GCE or GKE, one host or a slice; JAX reads the slice from the VM's metadata or
environment) and in SLURM or Open MPI jobs, so a pod or cluster job needs no extra flags.
A single process elsewhere needs nothing.

Processes wait for each other at the coordination service's barriers, and a collective
(process 0's decision broadcast, a gather) starts only once every process has reached it:
a process may arrive long after the others (process 0 alone prepares data, writes files,
checks a checkpoint), and on CPU a collective gives up when a peer is 30 s late (Gloo's
rendezvous). A process that dies is reported by the service's heartbeats, so the long
wait below does not hang a job whose peer is gone. A process that refuses to go on (a
UserError, typically from a check process 0 alone makes) stops the others with it where
the block that raised it is `as_one`.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import os

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from maelm_jax.infra import environment, errors


def tpu_chips(root: str = "/") -> int:
    """TPU chips attached to this host, as JAX's Cloud TPU start-up counts them: PCI
    devices with Google's vendor id and a TPU's device id (v2 to TPU7x), else the
    /dev/accel<n> files of v2-v4 and v5p. (A VFIO group, /dev/vfio/<n>, alone is no sign:
    any host with a passed-through device has one; a v5e or v6e VM shows its chips on the
    PCI bus.) `root`: where the file system starts (tests)."""
    from jax._src import hardware_utils

    tpu_ids = getattr(hardware_utils, "_TPU_PCI_DEVICE_IDS", {})
    count = 0
    for vendor in glob.glob(os.path.join(root, "sys/bus/pci/devices/*/vendor")):
        device = os.path.join(os.path.dirname(vendor), "device")
        try:
            with open(vendor) as v, open(device) as d:
                count += v.read().strip() == "0x1ae0" and d.read().strip() in tpu_ids
        except OSError:
            continue
    return count or len(glob.glob(os.path.join(root, "dev/accel[0-9]*")))


def cluster_detected(env: dict | None = None, root: str = "/") -> str | None:
    """The kind of multi-controller environment this process runs in ("slurm", "openmpi",
    "cloud tpu"), whose launcher JAX reads the job's shape from; None for a lone process
    that needs no runtime. Every Cloud TPU VM counts: a slice's hosts learn their peers
    from the VM's metadata server (GCE, the `gcloud ... tpu-vm ssh --worker=all` launch)
    or the environment (GKE), and even one host gets the coordination service that
    preemption notices go through."""
    if environment.integer("SLURM_NTASKS", 1, 1, env) > 1:
        return "slurm"
    if environment.integer("OMPI_COMM_WORLD_SIZE", 1, 1, env) > 1:
        return "openmpi"
    # GKE lists a multi-host slice's workers; any Cloud TPU VM shows its chips.
    if len(environment.names("TPU_WORKER_HOSTNAMES", env)) > 1 or tpu_chips(root):
        return "cloud tpu"
    return None


def launcher_size(env: dict | None = None) -> tuple[str, int] | None:
    """(the variable, the processes) a launcher gave this job, or None."""
    for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        size = environment.integer(name, 0, 1, env) if environment.text(name, env) else 0
        if size:
            return name, size
    return None


def check_process_flags(coordinator_address: str, num_processes: int, process_id: int,
                        env: dict | None = None) -> None:
    """One line naming the flag, before JAX sees them: --coordinator_address host:port
    with a port in 1-65535, --num_processes >= 1, --process_id in [0, --num_processes)
    (ids count from 0), the count the launcher's environment gives if it gives one; the
    two counts given without an address mean nothing and are refused."""
    if not coordinator_address:
        if num_processes or process_id != -1:
            flag = "--num_processes" if num_processes else "--process_id"
            raise errors.UserError(f"{flag}: only with --coordinator_address (host:port of "
                                   "process 0); without it the job's shape is detected")
        return
    host, _, port = coordinator_address.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise errors.UserError(f"--coordinator_address: expected host:port with a port in "
                               f"1-65535, got {coordinator_address!r}")
    if num_processes < 1:
        raise errors.UserError(f"--num_processes: expected at least 1 with "
                               f"--coordinator_address, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise errors.UserError(f"--process_id: expected 0 to {num_processes - 1} (ids count "
                               f"from 0, below --num_processes={num_processes}), got "
                               f"{process_id}")
    given = launcher_size(env)
    if given and given[1] != num_processes:
        raise errors.UserError(f"--num_processes: {num_processes}, but the launcher's "
                               f"{given[0]}={given[1]} says otherwise; give the same count "
                               "or leave the flags out")


def initialize(coordinator_address: str = "", num_processes: int = 0,
               process_id: int = -1) -> None:
    """Joins the multi-process job, if there is one; a job of several processes that has
    no coordination service (nothing to meet at: no barrier, no preemption agreement)
    stops with one line."""
    check_process_flags(coordinator_address, num_processes, process_id)
    if coordinator_address:
        jax.distributed.initialize(coordinator_address, num_processes, process_id)
    elif kind := cluster_detected():
        try:
            jax.distributed.initialize()  # JAX's own cluster detection fills in the rest
        except (RuntimeError, ValueError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise errors.UserError(
                f"this host looks like part of a {kind} job, but JAX could not join it "
                f"({reason}); give --coordinator_address, --num_processes and "
                "--process_id") from None
    if jax.process_count() > 1 and _client() is None:
        raise errors.UserError(
            f"this job has {jax.process_count()} processes but no coordination service "
            "(jax.distributed was not initialised); start every process with "
            "--coordinator_address, --num_processes and --process_id, or on a Cloud TPU VM "
            "with JAX's TPU support installed (jax[tpu])")
    if jax.process_count() > 1 or _client() is not None:
        logging.info("process %d of %d; %d local / %d global devices", jax.process_index(),
                     jax.process_count(), jax.local_device_count(), jax.device_count())


# How long a process waits for the others: a week, as data preparation by process 0 alone
# may take hours (milliseconds; the service takes a 32-bit count).
_WAIT_MS = 7 * 24 * 3600 * 1000


def _client():
    return jax._src.distributed.global_state.client  # no public accessor


def barrier(name: str) -> None:
    """Waits for every process (no-op for one). Every process passes the same names in the
    same order; a name may be used again once its barrier is passed."""
    if jax.process_count() > 1:
        _client().wait_at_barrier(f"maelm_jax/{name}", _WAIT_MS)


# How often each name of `as_one` has been used in this process: its keys in the service
# are per use, as a fast process may reach the next use before a slow one read the last.
_uses: collections.Counter = collections.Counter()


@contextlib.contextmanager
def as_one(name: str):
    """A block the processes leave together, at a barrier: all go on, or, when the block
    raised a UserError in any of them (typically a check process 0 alone makes), all raise
    it, so that the job stops at once with the same one line everywhere. (Otherwise the
    others would wait at their next barrier until the failed process's exit gave up
    waiting for them, minutes later, and abort them.)"""
    if jax.process_count() == 1:
        yield
        return
    _uses[name] += 1
    key = f"maelm_jax/{name}/{_uses[name]}/failed"
    failed = None
    try:
        yield
    except errors.UserError as e:
        failed = e
    client = _client()
    client.key_value_set(f"{key}/{jax.process_index()}", "" if failed is None else str(failed))
    barrier(name)
    if failed is not None:
        raise failed
    for process in range(jax.process_count()):
        message = client.blocking_key_value_get(f"{key}/{process}", _WAIT_MS)
        if message:
            raise errors.UserError(message)


def leader_says_ok(ok: bool) -> bool:
    """Process 0's `ok`, on every process (checks only process 0 makes, e.g. of files)."""
    if jax.process_count() == 1:
        return ok
    barrier("leader says")  # the broadcast is a collective: every process at it, none late
    return bool(multihost_utils.broadcast_one_to_all(np.int32(ok)))


def leader_number(value: float) -> float:
    """Process 0's `value`, on every process (a decision from a measurement each process
    makes a little differently, such as a time budget's planned steps)."""
    if jax.process_count() == 1:
        return value
    barrier("leader number")  # as in leader_says_ok
    return float(multihost_utils.broadcast_one_to_all(np.float64(value)))


def host_copy(tree):
    """Every array of `tree` whole, as numpy, on every process, whatever its sharding (an
    array split over several processes' devices cannot be fetched by one alone)."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    barrier("host copy")  # as in leader_says_ok
    return multihost_utils.process_allgather(tree, tiled=True)


def is_leader() -> bool:
    """Process 0 alone writes logs, metrics and TensorBoard events."""
    return jax.process_index() == 0
