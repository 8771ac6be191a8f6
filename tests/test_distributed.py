"""distributed: which jobs join JAX's runtime (every Cloud TPU VM, clusters), and processes
of one job wait for each other and agree, however late one is."""

import subprocess
import sys

import jax
import pytest

from conftest import HANG_SECONDS, REPO_ROOT, subprocess_env
from support import free_port, log_tail

pytestmark = pytest.mark.tier("unit")

# Process 1 reaches each call that holds a collective (the leader's word, a host copy) LATE
# seconds after process 0, where argv says so: longer than a CPU collective waits for a peer
# (30 s), so one that started on arrival would fail. Then a barrier's name is used twice,
# process 1 reaching the second 6 s late; then a block of `as_one` fails in process 0, in
# none, and in process 1.
_PROGRAM = """
import sys, time
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from maelm_jax.infra import distributed, errors
pid, port, late_to_leader, late_to_copy = int(sys.argv[1]), sys.argv[2], *map(float, sys.argv[3:])
distributed.initialize(f"127.0.0.1:{port}", 2, pid)
def arrive(seconds):
    if pid == 1:
        time.sleep(seconds)
arrive(late_to_leader)
said = distributed.leader_says_ok(pid == 0)  # process 0 says yes, process 1 would say no
mesh = jax.make_mesh((jax.device_count(),), ("data",))
rows = np.arange(4 * jax.device_count(), dtype=np.int32).reshape(jax.device_count(), 4)
whole = jax.make_array_from_callback(rows.shape, NamedSharding(mesh, P("data")),
                                     lambda index: rows[index])
arrive(late_to_copy)
copied = distributed.host_copy(whole)
distributed.barrier("twice")
arrive(6)
start = time.monotonic()
distributed.barrier("twice")
waited = pid == 1 or time.monotonic() - start > 3
stopped = []  # a UserError in one process's block is raised in every process, at once
for failing in (0, None, 1):
    try:
        with distributed.as_one("check"):
            if pid == failing:
                raise errors.UserError(f"config.x: process {pid} refuses")
        stopped.append("on")
    except errors.UserError as e:
        stopped.append(str(e))
print("RESULT", said, bool((copied == rows).all()), waited, stopped, flush=True)
"""


def _jobs(*lateness: tuple[float, float]) -> list[list[str]]:
    """Each job's two processes' RESULT lines; the jobs run at once (process 1 of each
    sleeps its lateness, (to the leader's word, to the host copy), in seconds)."""
    jobs = []
    for late in lateness:
        port = free_port()
        jobs.append([subprocess.Popen([sys.executable, "-c", _PROGRAM, str(i), str(port),
                                       *map(str, late)],
                                      cwd=REPO_ROOT, env=subprocess_env(2),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                     for i in range(2)])
    results = []
    for procs in jobs:
        logs = [p.communicate(timeout=HANG_SECONDS)[0] for p in procs]
        for p, log in zip(procs, logs, strict=True):
            assert p.returncode == 0, log_tail(log)
        results.append([next(line for line in log.splitlines() if line.startswith("RESULT"))
                        for log in logs])
    return results


@pytest.mark.slow
def test_a_process_far_behind_the_others_is_waited_for():
    """Late to the leader's word in one job, late to a host copy in the other: two jobs at
    once, since their processes mostly sleep."""
    stopped = ["config.x: process 0 refuses", "on", "config.x: process 1 refuses"]
    assert _jobs((32, 0), (0, 32)) == [[f"RESULT True True True {stopped}"] * 2] * 2


# ------------------------------------------------- which jobs join a distributed runtime

def _host(tmp_path, *files: str) -> str:
    """A stand-in for / holding `files` ("path=content" or an empty "path")."""
    for spec in files:
        name, _, content = spec.partition("=")
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(content + "\n" if content else "")
    return str(tmp_path)


_PCI = "sys/bus/pci/devices/0000:00:{slot}.0/{what}"


def _pci(slot: int, vendor: str, device: str) -> tuple[str, str]:
    return (_PCI.format(slot=slot, what="vendor") + f"={vendor}",
            _PCI.format(slot=slot, what="device") + f"={device}")


@pytest.mark.parametrize("env, files, kind", [
    ({}, (), None),
    ({"SLURM_NTASKS": "1", "OMPI_COMM_WORLD_SIZE": "1"}, (), None),
    ({"SLURM_NTASKS": "4"}, (), "slurm"),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, (), "openmpi"),
    ({"TPU_WORKER_HOSTNAMES": "t1k-w-0,t1k-w-1"}, (), "cloud tpu"),  # GKE
    ({"TPU_WORKER_HOSTNAMES": "localhost"}, (), None),  # one name, no chip: not a TPU VM
    ({}, (*_pci(4, "0x1ae0", "0x0063"), *_pci(5, "0x1ae0", "0x0063")), "cloud tpu"),  # v5e
    ({}, _pci(4, "0x1ae0", "0x006f"), "cloud tpu"),  # v6e
    ({}, ("dev/accel0", "dev/accel1"), "cloud tpu"),  # a v4 VM's device files
    ({}, _pci(3, "0x1ae0", "0x0042"), None),  # Google's network card (gVNIC): no TPU
    ({}, ("dev/vfio/0", "dev/vfio/vfio"), None),  # a VFIO group alone: no TPU
])
def test_every_cloud_tpu_vm_and_cluster_is_detected(tmp_path, env, files, kind):
    from maelm_jax.infra import distributed

    assert distributed.cluster_detected(env, _host(tmp_path, *files)) == kind


def test_a_tpu_vm_joins_through_jax_own_detection(monkeypatch):
    from maelm_jax.infra import distributed, errors

    calls = []
    monkeypatch.setattr(distributed, "cluster_detected", lambda: "cloud tpu")
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
    distributed.initialize()
    assert calls == [((), {})]  # no arguments: JAX reads the VM's metadata or environment

    def refuse(*args, **kwargs):
        raise RuntimeError("Getting metadata['agent-worker-number'] failed for 6 tries\nmore")

    monkeypatch.setattr(jax.distributed, "initialize", refuse)
    with pytest.raises(errors.UserError) as e:
        distributed.initialize()
    assert str(e.value) == (
        "this host looks like part of a cloud tpu job, but JAX could not join it (Getting "
        "metadata['agent-worker-number'] failed for 6 tries); give --coordinator_address, "
        "--num_processes and --process_id")


def test_several_processes_without_a_coordination_service_stop_with_one_line(monkeypatch):
    from maelm_jax.infra import distributed, errors

    monkeypatch.setattr(distributed, "cluster_detected", lambda: None)
    monkeypatch.setattr(jax, "process_count", lambda: 4)
    monkeypatch.setattr(distributed, "_client", lambda: None)
    with pytest.raises(errors.UserError, match="this job has 4 processes but no coordination "
                                               "service") as e:
        distributed.initialize()
    assert "\n" not in str(e.value)
