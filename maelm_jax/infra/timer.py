"""The one timer of what the project measures on the machine at hand (a run's steps before it
plans to a time budget, the study's parts, the benchmarks' calls and sides, the matmul a
record's machine is measured by): each call waited for on the device, a call's first run,
which compiles, apart from the runs after it, and several sides timed in rotated rounds
whose paired medians shrug off a slow phase of a shared machine.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable

import jax


class Samples:
    """Per-call records of one side: wall seconds (the device waited for), process CPU
    seconds (all threads) and minor page faults (fresh memory the kernel had to map and
    zero). `call` runs one call and returns what to wait for."""

    def __init__(self, call: Callable[[], object] | None = None):
        self.call = call
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.faults: list[int] = []

    def step_once(self) -> object:
        """One call (a subclass may define its own instead of passing `call`)."""
        return self.call()

    def run(self, count: int) -> None:
        """`count` calls, each recorded. Waiting after every call costs a dispatch round
        trip (microseconds against steps of milliseconds or more) and gives per-call
        samples whose median shrugs off bursts of other load."""
        for _ in range(count):
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            wall, cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(self.step_once())
            self.wall.append(time.perf_counter() - wall)
            self.cpu.append(time.process_time() - cpu)
            self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)

    def clear(self) -> None:
        for record in (self.wall, self.cpu, self.faults):
            record.clear()


def timed(step: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(the first call's seconds less one step's: its compile, the median of `repeats`
    calls after it) of `step`, which returns what to wait for."""
    samples = Samples(step)
    samples.run(1 + repeats)
    first, rest = samples.wall[0], samples.wall[1:]
    median = statistics.median(rest)
    return max(first - median, 0.0), median


def rotated(sides: dict[str, Samples], warmup: int, repeats: int, steps: int) -> None:
    """Untimed warm-up calls for each side, then `repeats` rounds of `steps` recorded calls
    each, rotating which side goes first every round so that a slow phase of the machine
    is shared."""
    for side in sides.values():
        if warmup:
            side.run(warmup)
            side.clear()
    order = list(sides)
    for r in range(repeats if order else 0):
        for name in order[r % len(order):] + order[:r % len(order)]:
            sides[name].run(steps)


def round_ratios(slow: list[float], fast: list[float], steps: int) -> list[float]:
    """Per-round time ratios slow / fast (median call of each in that round) from two
    `rotated` records of `steps` calls per round.

    The two sides of a round ran next to each other, so a slow phase of the machine that
    spans a round hits both; the median of these paired ratios moves less from run to run
    than the ratio of the overall medians.
    """
    rounds = min(len(slow), len(fast)) // steps
    return [statistics.median(slow[r * steps:(r + 1) * steps])
            / statistics.median(fast[r * steps:(r + 1) * steps]) for r in range(rounds)]
