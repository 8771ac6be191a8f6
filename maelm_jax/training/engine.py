"""What a training loop does around its steps, the same for pretraining (training/loop.py)
and fine-tuning (finetune/train.py): `Loop`.

* The first step compiles the step (or loads it from the persistent compilation cache):
  its time is logged once, and kept out of the first log window's throughput unless that
  step closes the window itself (then it is all there is to report).
* Log windows: the steps and wall time since the last log line, and the means of the
  step metrics gathered over them.
* Non-finite updates: the step has dropped them (optimizer.finite_update) and flags them
  in its metrics; `check_finite` applies config.train.nonfinite when the flags are read
  back: "stop" names the first bad step and the last good checkpoint, "skip" warns.
* Stop requests: SIGTERM (a scheduler's notice; preemption.StopRequest), JAX's
  preemption sync point, at which all processes agree to stop at the same step, or the
  time limit (preemption.time_limit; process 0's clock decides for all). The loop then
  saves a checkpoint at the step just finished and raises `stopped`'s exception.

Each loop keeps its own policy: when to log, evaluate and save, and what a stop does.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np
from absl import logging

from maelm_jax import compile_cache, distributed, errors
from maelm_jax.training import checkpoint as checkpoint_lib
from maelm_jax.training import preemption


class Loop:
    """The clock and the stop request of a loop that resumes after step `start`; a context
    manager around the loop (SIGTERM is caught inside it)."""

    def __init__(self, start: int, ckpt: checkpoint_lib.Checkpointer):
        self._first, self._ckpt = start + 1, ckpt
        # One process: our own SIGTERM flag; several: JAX's preemption sync point alone.
        self._stop = preemption.StopRequest(install=jax.process_count() == 1)
        self._out_of_time = False
        self._step, self._time = start, time.perf_counter()  # where the window began

    def __enter__(self) -> Loop:
        self._stop.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.__exit__(*exc)

    def after_step(self, step: int, state: Any, closes_window: bool) -> None:
        """Call after each step is dispatched: the first one is waited for and its
        compilation logged."""
        if step != self._first:
            return
        jax.block_until_ready(state)
        logging.info("%s in %.1fs", compile_cache.first_step_message(),
                     time.perf_counter() - self._time)
        if not closes_window:
            self._step, self._time = step, time.perf_counter()

    def lap(self, step: int) -> tuple[int, float]:
        """(steps, seconds) of the window that `step` closes; the next one begins."""
        now = time.perf_counter()
        steps, seconds = step - self._step, max(now - self._time, 1e-9)
        self._step, self._time = step, now
        return steps, seconds

    def stop_requested(self, step: int) -> bool:
        """Whether to save at `step` and stop. Every process asks at the same steps (the
        preemption sync point and the time limit's broadcast are collective)."""
        if self._stop.received or self._ckpt.reached_preemption(step):
            return True
        self._out_of_time = preemption.limited() and distributed.leader_says_ok(
            preemption.time_left() <= 0)
        return self._out_of_time

    def stopped(self, step: int, where: str) -> preemption.Preempted:
        """What to raise once the checkpoint of `step` (in `where`) is saved after a stop
        request: TimeLimit at the time limit, else Preempted."""
        if self._out_of_time:
            return preemption.TimeLimit(
                f"time limit: saved a checkpoint at step {step} in {where}; run the same "
                "command to continue")
        return preemption.Preempted(
            f"preempted: saved a checkpoint at step {step} in {where}; run the same command "
            "to continue")


def window_means(window: list[dict[str, float]]) -> dict[str, float]:
    """The mean of each metric over a log window's steps (host floats)."""
    return {k: float(np.mean([m[k] for m in window])) for k in window[0]}


class NonFiniteError(errors.UserError):
    """A non-finite loss or gradient under train.nonfinite="stop"."""


def check_finite(steps: list[int], metrics: list[dict[str, Any]], policy: str,
                 ckpt: checkpoint_lib.Checkpointer) -> int:
    """Applies the non-finite policy to the host metrics of `steps` (each with the step's
    "nonfinite" flag): "stop" raises NonFiniteError naming the first bad step, "skip" warns
    for each (the step has already dropped its update). Returns how many were dropped."""
    dropped = 0
    for step, step_metrics in zip(steps, metrics, strict=True):
        if step_metrics["nonfinite"] > 0:
            if policy == "stop":
                ckpt.wait()
                raise NonFiniteError(
                    f"step {step}: non-finite loss or gradients; stopped, the last good "
                    f"checkpoint is step {ckpt.latest_step()} (config.train.nonfinite="
                    "'skip' skips such updates instead)")
            logging.warning("step %d: non-finite loss or gradients, update skipped", step)
            dropped += 1
    return dropped
