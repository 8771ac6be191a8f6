"""Keep the C allocator from handing each step's scratch memory back to the kernel.

On CPU, XLA allocates one scratch buffer for every execution of a compiled program and
frees it when the program ends: hundreds of MB per train step even at a small encoder's
sizes. glibc's malloc serves any request above 32 MB with a fresh `mmap` and unmaps it on
`free`, so every step touches that many new pages, each faulted in and zeroed by the
kernel: a sizable share of the process's CPU time and of a step's wall time on a machine
of few cores (benchmarks/step_time.py measures it). Requests made on XLA's worker threads
come from glibc's per-thread arenas, which fall back to `mmap` for anything larger than
their 64 MB heaps whatever the mmap settings say.

`keep_freed_memory` makes glibc serve large requests from its main heap (one arena for all
threads, no `mmap` for large blocks) and never trim that heap, so the second step reuses
the first step's pages. The price: the process keeps its peak memory until it exits
(a trainer's peak is its steady state anyway), and threads share one arena's lock (small
requests go through glibc's per-thread caches and do not take it). It must run before
JAX's backend starts its threads: a thread keeps the arena it first allocated from.
Other C libraries and platforms, and a process whose malloc is another allocator's
(LD_PRELOAD), are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

# mallopt parameters, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8


def _glibc():
    """glibc, when it is the C library and its malloc the process's; else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    used = ctypes.CDLL(None).malloc  # the malloc symbol the process resolves to
    address = lambda function: ctypes.cast(function, ctypes.c_void_p).value  # noqa: E731
    return libc if address(used) == address(libc.malloc) else None


def applies() -> bool:
    """Whether `keep_freed_memory` can tune this process's allocator."""
    return _glibc() is not None


def keep_freed_memory() -> bool:
    """Tunes glibc's malloc as described above; True if it did (see `applies`)."""
    libc = _glibc()
    if libc is None:
        return False
    # mallopt takes an int; -1 becomes SIZE_MAX inside glibc: never trim the heap's top.
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1))
    return all(libc.mallopt(param, value) == 1 for param, value in settings)
