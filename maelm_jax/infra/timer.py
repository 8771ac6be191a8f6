"""The one timer of what the project measures on the machine at hand (a run's steps before it
plans to a time budget, the study's parts, the benchmarks' calls, the matmul a record's
machine is measured by): a call's first run, which compiles, apart from the runs after it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax


def timed(step: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(the first call's seconds less one step's: its compile, the median of `repeats`
    calls after it) of `step`, which returns what to wait for."""
    start = time.perf_counter()
    jax.block_until_ready(step())
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step())
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return max(first - median, 0.0), median
