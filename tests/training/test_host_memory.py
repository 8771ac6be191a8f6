"""host_memory.keep_freed_memory: repeated runs of a compiled program stop faulting in
fresh pages for XLA's scratch buffer once glibc keeps freed memory.

Each case runs in its own process: the allocator settings are process-wide and must be made
before JAX's backend starts its threads.
"""

import json
import platform
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, subprocess_env

# A program whose [4096, 4096] f32 intermediate (64 MB, 16,384 pages) lives in XLA's
# scratch buffer, run six times; prints the minor page faults of runs 2-6.
_PROGRAM = """
import json, resource, sys
from maelm_jax import host_memory
kept = host_memory.keep_freed_memory() if sys.argv[1] == "keep" else False
import jax, jax.numpy as jnp
f = jax.jit(lambda x, w1, w2: (x @ w1) @ w2)
x, w1, w2 = jnp.ones((4096, 64)), jnp.ones((64, 4096)), jnp.ones((4096, 8))
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x, w1, w2).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": kept, "faults": faults[1:]}))
"""
_SCRATCH_PAGES = 4096 * 4096 * 4 // 4096


def _faults(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROGRAM, mode], cwd=REPO_ROOT,
                         env=subprocess_env(1), capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="the tuning is for glibc's malloc on Linux")
def test_scratch_memory_is_reused_only_when_kept():
    kept, default = _faults("keep"), _faults("default")
    assert kept["kept"] and not default["kept"]
    # Without the tuning every run maps and zeroes the scratch buffer afresh (the control,
    # which shows the measurement can see it); with it, earlier runs' pages are reused. Not
    # by every run: a small block left inside the freed space can make the heap grow once
    # more (seen on a loaded machine: 19028, 16410, 0, 18853, 0 faults), so the claim is
    # that reuse happens at all, which never happens without the tuning.
    assert min(default["faults"]) > _SCRATCH_PAGES // 2, default
    assert min(kept["faults"]) < _SCRATCH_PAGES // 10, kept


def test_other_platforms_are_left_alone(monkeypatch):
    from maelm_jax import host_memory

    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    assert host_memory.keep_freed_memory() is False
