"""Stopping a training loop cleanly on request, shared by pretraining and fine-tuning.

Most schedulers send SIGTERM some time before they kill a job (a preemption notice). The
loops check `StopRequest.received` after every step; when it is set they save a
checkpoint at the step just finished and stop, so rerunning the same command continues
from there.
"""

from __future__ import annotations

import signal
import threading

from absl import logging


class StopRequest:
    """Within its `with` block, SIGTERM sets `received` instead of ending the process
    (only in the main thread, where Python delivers signals); the previous handler comes
    back when the block ends."""

    def __init__(self):
        self.received = False
        self._previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame):
        logging.warning("SIGTERM received: saving a checkpoint after this step")
        self.received = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


class Preempted(Exception):
    """A run that saved a checkpoint and stopped on request (not a failure: main.py logs
    the message and exits with status 0). Raised through the callers (a sweep, the study)
    so that they stop too; the same command continues them all."""
