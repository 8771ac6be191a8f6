"""Stopping a training loop cleanly on request, shared by pretraining and fine-tuning.

Three kinds of request:

* **Preemption.** Most schedulers send SIGTERM some time before they kill a job (a
  preemption notice); JAX's preemption sync point tells every process of a job at once.
* **A time limit** (`time_limit`, main.py's --time_limit_minutes): a job that may hold its
  machine only so long (a lent GPU's 10-minute commands, a batch slot) stops itself.
* **Ctrl-C** in a terminal (SIGINT), on one process: the first keeps the work done so far
  as a preemption does; a second stops at once, as Ctrl-C does anywhere else.

The loops check after every step (training/engine.py); when a request is in, they save a
checkpoint at the step just finished and raise `Preempted` (or its kinds `TimeLimit`,
`Interrupted`) through their callers (a sweep, the study), so nothing else starts;
rerunning the same command continues from there.
"""

from __future__ import annotations

import _thread
import contextlib
import gc
import math
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

from absl import logging

from maelm_jax.infra import errors

# The monotonic time at which a time limit ends (None: no limit).
_deadline: float | None = None


class StopRequest:
    """Within its `with` block, SIGTERM and the first Ctrl-C (SIGINT) set `received`
    instead of ending the process (only in the main thread, where Python delivers signals);
    the previous handlers come back when the block ends. After the first Ctrl-C the
    previous SIGINT handler is back at once, so a second one interrupts the save too
    (KeyboardInterrupt): someone at the keyboard may want out now. A SIGINT that was
    ignored (a job started in the background by a shell) stays ignored.

    install=False leaves both signals alone: in a job of several processes, JAX's
    preemption service catches SIGTERM and all processes agree on the step to stop at (the
    loop asks through Checkpointer.reached_preemption). A flag of this process's own would
    stop it alone, and the others would wait for it in their next collective forever."""

    def __init__(self, install: bool = True):
        self.received = False
        self.interrupted = False  # the request was a Ctrl-C
        self._install = install
        self._previous: dict[int, Any] = {}

    def __enter__(self):
        if self._install and threading.current_thread() is threading.main_thread():
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._handle)
            # None: a handler set outside Python, which could not be put back.
            if signal.getsignal(signal.SIGINT) not in (signal.SIG_IGN, None):
                self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, self._previous[signal.SIGINT])
            logging.warning("Ctrl-C: saving a checkpoint after this step (Ctrl-C again stops "
                            "at once, without it)")
            self.interrupted = True
        else:
            logging.warning("SIGTERM received: saving a checkpoint after this step")
        self.received = True

    def __exit__(self, *exc):
        for signum, previous in self._previous.items():
            if previous is not None:
                signal.signal(signum, previous)
        self._previous.clear()


def raise_on_ctrl_c() -> None:
    """Makes every Ctrl-C outside a training loop raise KeyboardInterrupt in the main
    thread's own code (main.py, for the whole run).

    Python runs a signal's handler in the first Python code that runs after the signal
    arrives. While C code allocates (parsing the built-in corpus, tokenising), that is
    often a garbage-collection callback (JAX registers one), where an exception is printed
    as "Exception ignored" and dropped: the Ctrl-C would be lost and the run go on. There
    the handler asks again a moment later, from a timer thread, in the main thread."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _ctrl_c)


def _ctrl_c(signum, frame):
    if _in_finaliser(frame):
        threading.Timer(0.05, _thread.interrupt_main).start()
        return
    raise KeyboardInterrupt


def _in_finaliser(frame) -> bool:
    """Whether `frame` runs inside a garbage-collection callback or a __del__, where an
    exception raised is dropped."""
    callbacks = {getattr(callback, "__code__", None) for callback in gc.callbacks}
    while frame is not None:
        if frame.f_code in callbacks or frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def raise_on_sigterm() -> None:
    """Makes SIGTERM raise errors.Terminated in the main thread (main.py, on one process: in a
    job of several, JAX's preemption service owns SIGTERM). A training loop's StopRequest
    takes SIGTERM over within the loop, and gives it back after."""
    signal.signal(signal.SIGTERM, _sigterm)


def _sigterm(signum, frame):
    if _in_finaliser(frame):  # as for Ctrl-C: an exception raised there would be dropped
        threading.Timer(0.05, _thread.interrupt_main, args=(signal.SIGTERM,)).start()
        return
    raise errors.Terminated


class Preempted(Exception):
    """A run that saved a checkpoint and stopped on request. Raised through the callers (a
    sweep, the study) so that they stop too; the same command continues them all."""


class TimeLimit(Preempted):
    """A run (or a study, between its parts) that stopped at the time limit."""


class Interrupted(Preempted):
    """A run that saved a checkpoint and stopped at a Ctrl-C."""


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
