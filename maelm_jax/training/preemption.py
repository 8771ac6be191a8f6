"""Stopping a training loop cleanly on request, shared by pretraining and fine-tuning.

Two kinds of request:

* **Preemption.** Most schedulers send SIGTERM some time before they kill a job (a
  preemption notice); JAX's preemption sync point tells every process of a job at once.
* **A time limit** (`time_limit`, main.py's --time_limit_minutes): a job that may hold its
  machine only so long (a lent GPU's 10-minute commands, a batch slot) stops itself.

The loops check after every step (training/engine.py); when a request is in, they save a
checkpoint at the step just finished and raise `Preempted` (or its kind `TimeLimit`)
through their callers (a sweep, the study), so nothing else starts; rerunning the same
command continues from there.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from collections.abc import Iterator

from absl import logging

# The monotonic time at which a time limit ends (None: no limit).
_deadline: float | None = None


class StopRequest:
    """Within its `with` block, SIGTERM sets `received` instead of ending the process
    (only in the main thread, where Python delivers signals); the previous handler comes
    back when the block ends.

    install=False leaves SIGTERM to JAX: in a job of several processes, JAX's preemption
    service catches it and all processes agree on the step to stop at (the loop asks
    through Checkpointer.reached_preemption). A flag of this process's own would stop it
    alone, and the others would wait for it in their next collective forever."""

    def __init__(self, install: bool = True):
        self.received = False
        self._install = install
        self._previous = None

    def __enter__(self):
        if self._install and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame):
        logging.warning("SIGTERM received: saving a checkpoint after this step")
        self.received = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


class Preempted(Exception):
    """A run that saved a checkpoint and stopped on request. Raised through the callers (a
    sweep, the study) so that they stop too; the same command continues them all."""


class TimeLimit(Preempted):
    """A run (or a study, between its parts) that stopped at the time limit."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Within the block, loops stop (saving a checkpoint) once `seconds` have passed, and
    callers that start long uninterruptible work ask `time_left` first. None or 0: no
    limit."""
    global _deadline
    previous = _deadline
    _deadline = time.monotonic() + seconds if seconds else None
    try:
        yield
    finally:
        _deadline = previous


def time_left() -> float:
    """Seconds until the time limit (infinite without one)."""
    return math.inf if _deadline is None else _deadline - time.monotonic()


def limited() -> bool:
    """Whether a time limit is set."""
    return _deadline is not None
