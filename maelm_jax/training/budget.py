"""Training to a time budget: how many steps fit the time there is, from what was measured.

A run given `train.time_budget_minutes` measures, on the devices at hand, a train step, an
evaluation and a checkpoint (`Costs`), then plans the largest number of steps (at most
`train.num_steps`, the cap) whose steps, periodic evaluations and checkpoints and the final
evaluation and save end within the budget less a margin (`plan_steps`). The schedule is
scaled to the plan (`scale_schedule`: the warmup keeps its share of the steps, the decay
reaches its floor at the planned end), and the plan is recorded (`Plan`, the workdir's
plan.json) so that a resumed run keeps it exactly. The study sizes its pretraining parts
with the same arithmetic (study/sizing.py).

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

import jax
import ml_collections

from maelm_jax import errors, layout, paths


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


def seconds(steps: int, costs: Costs, eval_every: int, checkpoint_every: int) -> float:
    """Predicted seconds of `steps` training steps with their evaluations and saves."""
    return (steps * costs.step + evaluations(steps, eval_every) * costs.evaluation
            + checkpoints(steps, checkpoint_every) * costs.checkpoint)


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
    low, high = 1, cap  # seconds() grows with the steps: the largest that fits
    while low < high:
        middle = (low + high + 1) // 2
        if seconds(middle, costs, eval_every, checkpoint_every) <= available:
            low = middle
        else:
            high = middle - 1
    return low


def scale_schedule(train: ml_collections.ConfigDict, steps: int) -> None:
    """Sets `train` to run `steps` steps with the schedule's shape kept: the warmup the
    same share of them as configured (of train.num_steps), the decay ending at the last
    step; evaluations and checkpoints no rarer than one at the end."""
    train.warmup_steps = round(train.warmup_steps * steps / train.num_steps)
    train.num_steps = steps
    train.eval_every = min(train.eval_every, steps)
    train.checkpoint_every = min(train.checkpoint_every, steps)
    train.log_every = min(train.log_every, steps)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A budgeted run's plan, as plan.json records it: kept by every resumption."""

    steps: int
    budget_seconds: float
    margin_seconds: float
    spent_seconds: float  # before the plan: start-up, data, compiling and measuring
    costs: Costs
    predicted_seconds: float  # spent + the planned steps with evaluations and saves
    device: str  # the device kind the costs were measured on, and how many
    tokens: int  # planned tokens (steps x batch x length)
    flops: float  # planned training FLOPs (model FLOPs, pretrain/flops.py)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> Plan:
        return cls(**{**record, "costs": Costs(**record["costs"])})


def read(workdir: paths.Path) -> Plan | None:
    path = workdir / layout.PLAN_FILE
    if not path.is_file():
        return None
    try:
        return Plan.from_dict(json.loads(paths.read_text(path)))
    except (json.JSONDecodeError, TypeError, KeyError) as e:
        raise BudgetError(f"{path}: not a plan this version reads ({e}); remove it to plan "
                          "again, or use another --workdir") from None


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
                tokens=steps * tokens_per_step, flops=steps * flops_per_step)


def describe(plan: Plan) -> str:
    """The plan in one log line."""
    return (f"{plan.steps} steps, {plan.tokens / 1e6:.1f}M tokens, {plan.flops:.3g} FLOPs, "
            f"predicted to end {plan.predicted_seconds:.0f} s after the start "
            f"({plan.spent_seconds:.0f} s before the plan, {plan.costs.step * 1e3:.1f} ms a "
            f"step, {plan.costs.evaluation:.1f} s an evaluation, {plan.costs.checkpoint:.1f} "
            f"s a checkpoint, on {plan.device}), within {plan.budget_seconds:.0f} s less a "
            f"margin of {plan.margin_seconds:.0f} s")
