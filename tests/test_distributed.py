"""distributed: processes of one job wait for each other and agree, however late one is."""

import subprocess
import sys

import pytest

from conftest import HANG_SECONDS, REPO_ROOT, subprocess_env
from support import free_port, log_tail

# Process 1 reaches the calls that hold a collective LATE seconds after process 0: longer
# than a CPU collective waits for a peer (30 s), so one that started on arrival would fail.
# Then a barrier's name is used twice, process 1 reaching the second 6 s late; then a
# block of `as_one` fails in process 0, in none, and in process 1.
_PROGRAM = """
import sys, time
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from maelm_jax import distributed, errors
pid, port, late = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
distributed.initialize(f"127.0.0.1:{port}", 2, pid)
def arrive(seconds):
    if pid == 1:
        time.sleep(seconds)
arrive(late)
said = distributed.leader_says_ok(pid == 0)  # process 0 says yes, process 1 would say no
mesh = jax.make_mesh((jax.device_count(),), ("data",))
rows = np.arange(4 * jax.device_count(), dtype=np.int32).reshape(jax.device_count(), 4)
whole = jax.make_array_from_callback(rows.shape, NamedSharding(mesh, P("data")),
                                     lambda index: rows[index])
arrive(late)
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


def _job(late: float) -> list[str]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _PROGRAM, str(i), str(port), str(late)],
                              cwd=REPO_ROOT, env=subprocess_env(2), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = [p.communicate(timeout=HANG_SECONDS)[0] for p in procs]
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log_tail(log)
    return [next(line for line in log.splitlines() if line.startswith("RESULT"))
            for log in logs]


@pytest.mark.slow
def test_a_process_far_behind_the_others_is_waited_for():
    stopped = ["config.x: process 0 refuses", "on", "config.x: process 1 refuses"]
    assert _job(late=32) == [f"RESULT True True True {stopped}"] * 2
