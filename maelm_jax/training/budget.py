"""Training to a time budget: how many steps fit the time there is, from what was measured.

A run given `train.time_budget_minutes` measures, on the devices at hand, a train step, an
evaluation and a checkpoint (`Costs`), then plans the largest number of steps (at most
`train.num_steps`, the cap) whose steps, periodic evaluations and checkpoints and the final
evaluation and save end within the budget less a margin (`plan_steps`). The schedule is
scaled to the plan (`scale_schedule`: the warmup keeps its share of the steps, the decay
reaches its floor at the planned end), and the plan is recorded (`Plan`, the workdir's
plan.json) so that a resumed run keeps it exactly. The study sizes its pretraining parts
with the same arithmetic (study/sizing.py).

A few steps timed before the run can be far from the rate the loop keeps (a shared or
throttled machine, a loader that competes with the step for the cores), so the run plans
again as it goes (`Replanner`): at each log step it measures its own rate and moves the
planned end to what the time left holds. The learning rate has no jump at a re-plan
(optimizer.with_decay_end: the decay goes on from the rate it had reached), and every
re-plan is written to plan.json before any later checkpoint, so that a resumed run
replays them at their steps and trains exactly as the run it resumes would have.

    wall time = what the run spent before the plan (start-up, data, compiling, measuring)
              + steps x step
              + evaluations(steps) x evaluation + checkpoints(steps) x checkpoint
              (the final evaluation and save included: the loop runs both at the last step)
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import ml_collections

from maelm_jax.infra import distributed, errors, paths
from maelm_jax.training import optimizer
from maelm_jax.workdirs import layout


class BudgetError(errors.UserError):
    """A budget that cannot hold a run (one line naming the field)."""


FIELD = "config.train.time_budget_minutes"


def process_age() -> float:
    """Seconds since this process started (Python and JAX starting, before any of our code
    runs; 0 where /proc does not say)."""
    try:
        with open("/proc/self/stat") as f:
            # Field 22, after the command's parenthesised name: start time in clock ticks.
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)


@dataclasses.dataclass(frozen=True)
class Costs:
    """Seconds measured on this machine."""

    step: float  # one train step (the median, after warm-up)
    evaluation: float  # one evaluation: every eval batch
    checkpoint: float  # one checkpoint written (to the point the loop goes on)


def evaluations(steps: int, eval_every: int) -> int:
    """Evaluations in a run of `steps`: every eval_every steps and at the last step."""
    return steps // eval_every + (steps % eval_every > 0)


def checkpoints(steps: int, checkpoint_every: int) -> int:
    """Checkpoints in a run of `steps`: the first step's (which shows at once that the
    workdir can hold one), every checkpoint_every steps and the last step's."""
    periodic = steps // checkpoint_every + (steps % checkpoint_every > 0)
    return periodic + (checkpoint_every > 1 and steps > 1)


def seconds_after(step: int, end: int, costs: Costs, eval_every: int,
                  checkpoint_every: int) -> float:
    """Predicted seconds of steps `step` + 1 to `end` with their evaluations and periodic
    saves (the last step's included; the first step's save is counted by `seconds`)."""
    evals = evaluations(end, eval_every) - step // eval_every
    saves = checkpoints(end, checkpoint_every) - (checkpoint_every > 1 and end > 1)
    saves -= step // checkpoint_every
    return (end - step) * costs.step + evals * costs.evaluation + saves * costs.checkpoint


def seconds(steps: int, costs: Costs, eval_every: int, checkpoint_every: int) -> float:
    """Predicted seconds of `steps` training steps with their evaluations and saves."""
    return (seconds_after(0, steps, costs, eval_every, checkpoint_every)
            + (checkpoint_every > 1 and steps > 1) * costs.checkpoint)


def _most(fits: Callable[[int], bool], low: int, high: int) -> int:
    """The largest n in [low, high] with fits(n), given fits(low) and that fits holds up to
    some n and not after it."""
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def plan_steps(available: float, costs: Costs, eval_every: int, checkpoint_every: int,
               cap: int) -> int:
    """The most steps (at most `cap`) whose predicted seconds fit `available`; raises
    BudgetError when not even one step with its evaluation and save does."""
    if seconds(1, costs, eval_every, checkpoint_every) > available:
        raise BudgetError(
            f"{FIELD}: {max(available, 0):.0f} s are left for training after the start, which "
            f"cannot hold one step ({costs.step:.2f} s), an evaluation ({costs.evaluation:.1f}"
            f" s) and a checkpoint ({costs.checkpoint:.1f} s); give more time or fewer "
            "train.eval_batches")
    return _most(lambda n: seconds(n, costs, eval_every, checkpoint_every) <= available, 1,
                 cap)


def replan_steps(available: float, costs: Costs, step: int, eval_every: int,
                 checkpoint_every: int, cap: int) -> int:
    """The last step (at most `cap`, at least `step` + 1: a run ends with a step) of a run
    at `step` whose remaining steps, evaluations and saves fit `available` seconds."""
    return _most(lambda end: seconds_after(step, end, costs, eval_every,
                                           checkpoint_every) <= available,
                 step + 1, max(cap, step + 1))


def scale_schedule(train: ml_collections.ConfigDict, steps: int,
                   cap: int | None = None) -> None:
    """Sets `train` to run `steps` steps with the schedule's shape kept: the warmup the
    same share of them as configured (of `cap`, the train.num_steps the plan was made
    under: a resumed command's own is only a cap for plans not yet made, and must not move
    the warmup of a plan made), the decay ending at the last step; evaluations and
    checkpoints no rarer than one at the end."""
    cap = train.num_steps if cap is None else cap
    train.warmup_steps = round(train.warmup_steps * steps / cap)
    train.num_steps = steps
    train.eval_every = min(train.eval_every, steps)
    train.checkpoint_every = min(train.checkpoint_every, steps)
    train.log_every = min(train.log_every, steps)


@dataclasses.dataclass(frozen=True)
class Revision:
    """A re-plan made as the run went: from `step` on, the run ends at `steps`."""

    step: int  # a log step: the revision applies to the updates after it
    steps: int  # the planned last step from here on
    step_seconds: float  # the loop's own rate that it was planned from
    elapsed_seconds: float  # since the start, when it was made
    predicted_seconds: float  # elapsed + the remaining steps with evaluations and saves


@dataclasses.dataclass(frozen=True)
class Plan:
    """A budgeted run's plan, as plan.json records it: kept by every resumption."""

    steps: int  # the first plan's, made before the loop (`end` is the run's last step)
    budget_seconds: float
    margin_seconds: float
    spent_seconds: float  # before the plan: start-up, data, compiling and measuring
    costs: Costs
    predicted_seconds: float  # spent + the planned steps with evaluations and saves
    device: str  # the device kind the costs were measured on, and how many
    tokens: int  # planned tokens (steps x batch x length)
    flops: float  # planned training FLOPs (model FLOPs, pretrain/flops.py)
    revisions: tuple[Revision, ...] = ()  # the re-plans made as the run went, in order
    # train.num_steps when the plan was made (the warmup's share is of it); None in plans
    # of earlier versions, whose run's config.json records it.
    cap: int | None = None

    @property
    def end(self) -> int:
        """The step the run ends at: its last re-plan's, else the first plan's."""
        return self.revisions[-1].steps if self.revisions else self.steps

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> Plan:
        """The plan `record` holds; ValueError naming the first field of the wrong type."""
        if not isinstance(record, dict):
            raise ValueError(f"it holds {json.dumps(record)[:40]}, not an object")
        plain = _typed(record, cls, "")
        costs = record.get("costs")
        costs = Costs(**_typed(costs if isinstance(costs, dict) else _not_object("costs"),
                               Costs, "costs."))
        revisions = tuple(Revision(**_typed(r, Revision, f"revisions[{i}].") if
                                   isinstance(r, dict) else _not_object(f"revisions[{i}]"))
                          for i, r in enumerate(_list(record.get("revisions", []))))
        return cls(**plain, costs=costs, revisions=revisions)


def _not_object(field: str):
    raise ValueError(f"{field} is not an object")


def _list(value: Any) -> list:
    if not isinstance(value, list):
        raise ValueError("revisions is not a list")
    return value


# What a plan's field may hold, by its annotation (a JSON number may be an int or not).
_KINDS = {"int": (int,), "float": (int, float), "str": (str,)}


def _typed(record: dict, cls: type, prefix: str) -> dict:
    """`record`'s plain fields of `cls`, each checked against its annotation (None where
    the field's default is None); ValueError naming the first that is missing or wrong."""
    out = {}
    for field in dataclasses.fields(cls):
        name, kind = f"{prefix}{field.name}", str(field.type).split(" |")[0]
        if field.name in ("costs", "revisions") or (
                field.name not in record and field.default is not dataclasses.MISSING):
            continue
        if field.name not in record:
            raise ValueError(f"{name} is missing")
        value = record[field.name]
        if not (value is None and field.default is None) and (
                isinstance(value, bool) or not isinstance(value, _KINDS[kind])):
            raise ValueError(f"{name} is {json.dumps(value)}, expected {kind}")
        out[field.name] = value
    return out


def read(workdir: paths.Path) -> Plan | None:
    """The workdir's plan; one line when plan.json is damaged or not a plan, whose advice
    leads to this run again (its plan fixes the run's steps and schedule: another plan
    made for checkpoints trained under this one would change them)."""
    path = workdir / layout.PLAN_FILE
    if not path.is_file():
        return None
    try:
        return Plan.from_dict(json.loads(paths.read_text(path)))
    except (ValueError, TypeError, KeyError, UnicodeDecodeError) as e:
        reason = (f"line {e.lineno} column {e.colno}: {e.msg}"
                  if isinstance(e, json.JSONDecodeError) else str(e))
        raise BudgetError(f"{path}: not a plan this version reads ({reason}); {lost_plan(workdir)}"
                          ) from None


def lost_plan(workdir: paths.Path) -> str:
    """The way back to a run whose plan.json is lost or damaged: its plan fixes the steps
    and the schedule its checkpoints were trained under, so put it back; without a copy,
    the run can only start again, planned anew from the same budget."""
    return (f"it fixes the steps and schedule of this run's checkpoints: put back a copy of "
            f"it, or, without one, move {workdir / layout.CHECKPOINTS} out as well and run "
            "the same command, which plans this run again from its time budget")


def make(budget_seconds: float, margin: float, spent: float, costs: Costs,
         train: ml_collections.ConfigDict, device: str, tokens_per_step: int,
         flops_per_step: float, steps: int | None = None) -> Plan:
    """The plan of a run of `train` (its cap train.num_steps) given `budget_seconds` in
    all, `spent` of them gone, a `margin` (a fraction of the budget) kept in reserve;
    with `steps`, the plan of those steps (another process's decision)."""
    margin_seconds = margin * budget_seconds
    available = budget_seconds - margin_seconds - spent
    if steps is None and seconds(1, costs, 1, 1) > available:
        raise BudgetError(
            f"{FIELD}: {budget_seconds:.0f} s less the margin ({margin_seconds:.0f} s) and the "
            f"{spent:.0f} s the start took (data, compiling, measuring) leave "
            f"{max(available, 0):.0f} s, which cannot hold one step ({costs.step:.2f} s), an "
            f"evaluation ({costs.evaluation:.1f} s) and a checkpoint ({costs.checkpoint:.1f} "
            "s); give more minutes")
    if steps is None:
        steps = plan_steps(available, costs, train.eval_every, train.checkpoint_every,
                           train.num_steps)
    predicted = spent + seconds(steps, costs, min(train.eval_every, steps),
                                min(train.checkpoint_every, steps))
    return Plan(steps=steps, budget_seconds=budget_seconds, margin_seconds=margin_seconds,
                spent_seconds=spent, costs=costs, predicted_seconds=predicted, device=device,
                tokens=steps * tokens_per_step, flops=steps * flops_per_step,
                cap=train.num_steps)


def describe(plan: Plan) -> str:
    """The plan in one log line."""
    line = (f"{plan.steps} steps, {plan.tokens / 1e6:.1f}M tokens, {plan.flops:.3g} FLOPs, "
            f"predicted to end {plan.predicted_seconds:.0f} s after the start "
            f"({plan.spent_seconds:.0f} s before the plan, {plan.costs.step * 1e3:.1f} ms a "
            f"step, {plan.costs.evaluation:.1f} s an evaluation, {plan.costs.checkpoint:.1f} "
            f"s a checkpoint, on {plan.device}), within {plan.budget_seconds:.0f} s less a "
            f"margin of {plan.margin_seconds:.0f} s")
    if plan.revisions:
        line += (f"; re-planned {len(plan.revisions)} times as it ran, to end at step "
                 f"{plan.end}")
    return line


# A re-plan is recorded when it moves the end by at least this share of the steps: the
# learning rate's line and plan.json are not rewritten for noise.
REPLAN_TOLERANCE = 0.01

# How the budget reads time (seconds, monotonic): a test gives a clock of its own.
clock = time.monotonic


class Replanner:
    """A budgeted run's plan as the loop goes: the learning-rate schedule and last step in
    force, re-planned at log steps from the loop's own rate (`at_log`).

    The run that made the plan re-plans; a resumed run replays the recorded revisions at
    their steps and makes none (its process started later: the budget it was given has no
    meaning for the plan of the run it continues). `paused`: the run reports the seconds
    it spent evaluating and saving, which are not steps."""

    def __init__(self, plan: Plan, schedule: tuple[float, ...], start: int, started: float,
                 train: ml_collections.ConfigDict, cap: int, replans: bool,
                 record: Callable[[Plan], None]):
        """`schedule`: the first plan's (optimizer.learning_rate_at's full form); `start`:
        the step the loop resumes after; `started`: the `clock()` the budget counts from;
        `train`: the run's cadence; `cap`: the given train.num_steps; `record(plan)`
        writes plan.json (process 0)."""
        self.plan, self.started, self.cap, self.replans = plan, started, cap, replans
        self.eval_every, self.checkpoint_every = train.eval_every, train.checkpoint_every
        self.record = record
        self.schedule, self.end = schedule, plan.steps
        for revision in plan.revisions:  # in force at `start`: those made at or before it
            if revision.step <= start:
                self._apply(revision)
        self._first: tuple[int, float] | None = None  # (step, clock) of the first log step
        self._last: tuple[int, float] | None = None
        self._paused = self._paused_since_last = 0.0
        self._evaluations: list[float] = []

    def _apply(self, revision: Revision) -> None:
        self.schedule = optimizer.with_decay_end(self.schedule, revision.step, revision.steps)
        self.end = revision.steps

    def paused(self, seconds: float, evaluation: bool) -> None:
        """`seconds` of the loop spent outside its steps (an evaluation, or a save)."""
        self._paused += seconds
        self._paused_since_last += seconds
        if evaluation:
            self._evaluations.append(seconds)

    def step_seconds(self, step: int, now: float) -> float | None:
        """The loop's seconds a step at `step`: the larger of its mean since the first log
        step and of the last log window (a machine slowing down is followed at once, one
        speeding up as the mean catches up); None at the first log step (the window
        before it holds the compile)."""
        paused_since_last, self._paused_since_last = self._paused_since_last, 0.0
        if self._first is None:
            self._first = self._last = (step, now)
            self._paused = 0.0
            return None
        (first, first_time), (last, last_time) = self._first, self._last
        self._last = (step, now)
        mean = (now - first_time - self._paused) / (step - first)
        window = (now - last_time - paused_since_last) / (step - last)
        return max(mean, window, 0.0)

    def at_log(self, step: int) -> Revision | None:
        """After the log line of `step`: replays a revision recorded at `step`, or (in the
        run that planned) plans the end again from the loop's rate; returns the revision
        applied, if any. Collective in a multi-process run that re-plans (process 0's
        end is every process's)."""
        recorded = [r for r in self.plan.revisions if r.step == step]
        if recorded:
            self._apply(recorded[0])
            return recorded[0]
        if not self.replans:
            return None
        now = clock()
        step_seconds = self.step_seconds(step, now)
        if step_seconds is None:
            return None
        costs = dataclasses.replace(
            self.plan.costs, step=step_seconds,
            evaluation=(statistics.mean(self._evaluations) if self._evaluations
                        else self.plan.costs.evaluation))
        elapsed = now - self.started
        available = self.plan.budget_seconds - self.plan.margin_seconds - elapsed
        end = int(distributed.leader_number(replan_steps(
            available, costs, step, self.eval_every, self.checkpoint_every, self.cap)))
        if abs(end - self.end) < max(1.0, REPLAN_TOLERANCE * self.end):
            return None
        revision = Revision(
            step=step, steps=end, step_seconds=step_seconds, elapsed_seconds=elapsed,
            predicted_seconds=elapsed + seconds_after(step, end, costs, self.eval_every,
                                                      self.checkpoint_every))
        self.plan = dataclasses.replace(self.plan, revisions=(*self.plan.revisions, revision))
        self.record(self.plan)  # before any checkpoint after this step
        self._apply(revision)
        return revision
