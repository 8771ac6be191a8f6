"""The one step loop of pretraining (pretrain/train.py) and fine-tuning (finetune/train.py):
`train(run, ...)`, where `run` (a `Run`) supplies what differs: its step, when to log,
evaluate and save, its log line, its evaluation, what a "best" evaluation is and what a
checkpoint holds. Everything else happens here, once, for both:

* The first step compiles the step (or loads it from the persistent compilation cache):
  its time is logged once, and kept out of the first log window's throughput unless that
  step closes the window itself (then it is all there is to report).
* Log windows: the steps and wall time since the last log line, and the means of the
  step metrics gathered over them.
* Non-finite updates: the step has dropped them (optimizer.finite_update) and flags them
  in its metrics; `check_finite` applies config.train.nonfinite when the flags are read
  back: "stop" names the first bad step and the last good checkpoint, "skip" warns.
* Stop requests: SIGTERM (a scheduler's notice) or Ctrl-C (preemption.StopRequest), JAX's
  preemption sync point, at which all processes agree to stop at the same step, or the
  time limit (preemption.time_limit; process 0's clock decides for all). The loop then
  saves a checkpoint at the step just finished and raises `stopped`'s exception.
* Evaluations: every one is written to the metrics and kept in `Progress.evals`, the best
  one's index in `Progress.best`, and its parameters on the host when the run keeps them.
* Checkpoints: at the steps the run asks for and at a stop request, with the `Progress`
  the loop carries (so a resumed run logs, counts and selects exactly as if it had not
  stopped); never past a step whose metrics have not been checked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any, Protocol

import jax
import numpy as np
from absl import logging

from maelm_jax.infra import compile_cache, distributed, errors
from maelm_jax.training import checkpoint as checkpoint_lib
from maelm_jax.training import preemption, profiler


class Loop:
    """The clock and the stop request of a loop that resumes after step `start`; a context
    manager around the loop (SIGTERM and a first Ctrl-C are caught inside it)."""

    def __init__(self, start: int, ckpt: checkpoint_lib.Checkpointer):
        self._first, self._ckpt = start + 1, ckpt
        # One process: our own flag for SIGTERM and Ctrl-C; several: JAX's preemption sync
        # point alone.
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
        if self._stop.interrupted:
            return preemption.Interrupted(
                f"interrupted: saved a checkpoint at step {step} in {where}; run the same "
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


@dataclasses.dataclass
class Progress:
    """What the loop carries besides the arrays; saved as JSON with every checkpoint."""

    # Every evaluation so far: {"step": step, <score>: value, ...}.
    evals: list[dict] = dataclasses.field(default_factory=list)
    best: int | None = None  # the index in evals of the best one (Run.better)
    # Each step's metrics (host floats) since the last log line, so a resumed run logs the
    # same means.
    window: list[dict] = dataclasses.field(default_factory=list)
    seconds: float = 0.0  # wall time of the run's earlier attempts
    skipped: int = 0  # updates dropped as non-finite (config.train.nonfinite="skip")

    def meta(self, step: int, seconds: float) -> dict:
        """The checkpoint's JSON record at `step`; `seconds`: this attempt's so far."""
        return {"step": step, **dataclasses.asdict(self), "seconds": self.seconds + seconds}

    @classmethod
    def from_meta(cls, meta: dict) -> Progress:
        """The progress a checkpoint's record describes; a field it lacks (an earlier
        version's record) takes its default. Pretraining records before the shared loop
        named two of them differently."""
        meta = {"skipped": meta.get("skipped_updates", 0),
                "window": meta.get("log_window", []), **meta}
        return cls(**{f.name: meta[f.name] for f in dataclasses.fields(cls) if f.name in meta})


class Run(Protocol):
    """What a trainer supplies to `train`: its step and its policies."""

    num_steps: int  # the run ends after this step
    nonfinite: str  # config.train.nonfinite: "stop" or "skip"
    eval_split: str  # the metrics' name for its evaluations ("eval", "dev")
    keeps_best: bool  # keep the best evaluation's parameters (on the host)

    def train_step(self, state: Any, batch: Any) -> tuple[Any, dict]:
        """One optimiser step (dispatched, not waited for): (state, metrics on device);
        the metrics include the step's "nonfinite" flag."""

    def log_due(self, step: int) -> bool:
        """Whether to log after `step` (the last step always logs)."""

    def eval_due(self, step: int) -> bool:
        """Whether to evaluate after `step` (the last step always evaluates)."""

    def after_log(self, step: int) -> None:
        """After the log line of `step` (not the last): the run may move num_steps, to
        `step` + 1 at the earliest (a time budget planned again from the loop's rate)."""

    def checkpoint_due(self, step: int) -> bool:
        """Whether to save after `step` (a stop request always saves)."""

    def log_line(self, step: int, means: dict[str, float], steps: int,
                 seconds: float) -> dict[str, float]:
        """The train log line of the window that `step` closes: `steps` steps in `seconds`,
        `means` their metrics' means."""

    def evaluate(self, state: Any, step: int) -> dict[str, float]:
        """Scores of the state after `step`, as host floats."""

    def better(self, scores: dict[str, float], best: dict[str, float]) -> bool:
        """Whether `scores` beat `best` (an earlier evaluation's record)."""

    def save(self, ckpt: checkpoint_lib.Checkpointer, step: int, state: Any,
             progress: Progress, best_params: Any) -> None:
        """Starts saving the checkpoint of `step` (forced: the loop decides when)."""


def train(run: Run, state: Any, start: int, batches: Iterator, ckpt: checkpoint_lib.Checkpointer,
          writer: Any, progress: Progress, best_params: Any = None,
          profile: profiler.Window | None = None) -> tuple[Any, Progress, Any]:
    """Steps `start + 1` to `run.num_steps` with logs, evaluations, checkpoints and the
    non-finite and stop policies. Returns (state, progress, the best evaluation's
    parameters on the host, or None unless `run.keeps_best`). `progress` and `best_params`:
    what the checkpoint at `start` carried (fresh ones at step 0); `profile`: a window of
    steps to trace (config.train.profile_steps).

    Between logging, evaluation and checkpoint steps nothing is read back from the device:
    the host dispatches step after step while the accelerator runs them. Step metrics pile
    up on the device and are fetched together at the next of those steps, which is also
    when the non-finite flags are checked (the step itself has dropped any non-finite
    update, so checking late loses nothing, and no checkpoint is saved past an unchecked
    step). On a stop request the checkpoint of the step just finished is saved and
    `Loop.stopped`'s exception raised.
    """
    unchecked: list[tuple[int, Any]] = []  # (step, metrics on device) not yet fetched

    def fetch() -> None:
        """Reads the unchecked steps' metrics back and applies the non-finite policy."""
        nonlocal unchecked
        fetched = jax.device_get([m for _, m in unchecked])
        progress.skipped += check_finite([s for s, _ in unchecked], fetched, run.nonfinite,
                                         ckpt)
        progress.window += [{k: float(v) for k, v in m.items()} for m in fetched]
        unchecked = []

    with Loop(start, ckpt) as clock, profile or contextlib.nullcontext():
        step = start
        while step < run.num_steps:  # which a run may move at a log step (Run.after_log)
            step += 1
            if profile is not None:
                profile.before(step, state)
            state, step_metrics = run.train_step(state, next(batches))
            if profile is not None:
                profile.after(step, state)
            unchecked.append((step, step_metrics))
            last = step == run.num_steps
            log = last or run.log_due(step)
            clock.after_step(step, state, closes_window=log)
            evaluate = last or run.eval_due(step)
            if log or evaluate:
                fetch()
            if log:
                means = {**window_means(progress.window), "skipped_updates": progress.skipped}
                writer.write("train", step, run.log_line(step, means, *clock.lap(step)))
                progress.window = []
                if not last:
                    run.after_log(step)
            if evaluate:
                scores = run.evaluate(state, step)
                writer.write(run.eval_split, step, scores)
                progress.evals.append({"step": step, **scores})
                if progress.best is None or run.better(scores, progress.evals[progress.best]):
                    progress.best = len(progress.evals) - 1
                    if run.keeps_best:
                        best_params = distributed.host_copy(state.params)
            # After the evaluation, which can take a while: a request that came during it
            # saves this step, not the next one.
            stop = clock.stop_requested(step)
            if stop or run.checkpoint_due(step):
                if unchecked:
                    fetch()
                run.save(ckpt, step, state, progress, best_params)
                writer.flush()  # a resumed run finds every metrics line up to its checkpoint
            if stop:
                ckpt.wait()
                raise clock.stopped(step, str(ckpt.directory))
    ckpt.wait()
    return state, progress, best_params
