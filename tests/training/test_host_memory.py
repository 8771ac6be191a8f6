"""host_memory.keep_freed_memory: a large block that a worker thread frees and allocates
again, as XLA's CPU runtime does with its scratch buffer at every execution of a compiled
program, stops costing fresh pages once glibc keeps freed memory.

Each case runs in its own process: the allocator settings are process-wide and must be made
before other threads start. The test asks glibc directly rather than timing an XLA program,
whose allocations also depend on its thread timing and the host; benchmarks/step_time.py
reports the page faults of real train steps.
"""

import json
import platform
import subprocess
import sys

import pytest

from maelm_jax.infra import host_memory

from conftest import REPO_ROOT, subprocess_env

pytestmark = pytest.mark.tier("unit")

# A 64 MB block (16,384 pages) malloc'ed, written and freed five times on a new thread;
# prints the minor page faults of each round.
_BLOCK = 64 << 20
_PROGRAM = f"""
import ctypes, json, resource, sys, threading
from maelm_jax.infra import host_memory
kept = host_memory.keep_freed_memory() if sys.argv[1] == "keep" else False
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
faults = []
def rounds():
    for _ in range(5):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc({_BLOCK})
        ctypes.memset(block, 1, {_BLOCK})
        libc.free(block)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
worker = threading.Thread(target=rounds)
worker.start()
worker.join()
print(json.dumps({{"kept": kept, "faults": faults}}))
"""
_PAGES = _BLOCK // 4096


def _faults(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROGRAM, mode], cwd=REPO_ROOT,
                         env=subprocess_env(1), capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not host_memory.applies(),
                    reason="the tuning is for glibc's own malloc on Linux")
def test_scratch_memory_is_reused_only_when_kept():
    kept, default = _faults("keep"), _faults("default")
    assert kept["kept"] and not default["kept"]
    # Without the tuning glibc maps every round's block afresh and the kernel zeroes its
    # pages (the control, which shows the measurement can see it); with it, the first round
    # grows the heap and the others reuse its pages.
    assert min(default["faults"]) > _PAGES // 2, default
    assert kept["faults"][0] > _PAGES // 2, kept
    assert max(kept["faults"][1:]) < _PAGES // 10, kept


def test_other_platforms_are_left_alone(monkeypatch):
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    assert host_memory.keep_freed_memory() is False
