"""A pretraining run to a time budget (training/budget.py's arithmetic): its costs measured
on the run's own programs and devices (`measure`), its plan made or read back (`plan_run`)
and recorded (`record`, the workdir's plan.json)."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterator

import jax
import ml_collections
import numpy as np
from absl import logging

from maelm_jax.infra import distributed, paths, sharding, timer
from maelm_jax.pretrain import evaluation as evaluation_lib
from maelm_jax.pretrain import setup as setup_lib
from maelm_jax.training import budget as budget_lib
from maelm_jax.training import checkpoint as checkpoint_lib
from maelm_jax.workdirs import layout

# Train steps timed for a time budget's plan, after one that compiles.
MEASURED_STEPS = 5
MEASURED_CHECKPOINTS = ".time-budget-checkpoints"  # in the workdir while they are timed


def measure(program: setup_lib.Program, config: ml_collections.ConfigDict,
             batches: Iterator[np.ndarray], eval_data: list[jax.Array],
             workdir: paths.Path) -> budget_lib.Costs:
    """The costs of a step, an evaluation and a checkpoint of `program` on these devices,
    on a state of its own (freed after),
    each step fed as the run's are (`batches`: the loader's, read and sent to the devices
    within the step's time). The checkpoints are written where the run's go (the workdir,
    which every process shares), in a scratch directory removed after."""
    state = [program.init()]

    def step():
        batch = sharding.global_batch(next(batches), program.mesh)
        state[0], metrics = program.train_step(state[0], batch)
        return metrics

    def evaluation():
        return evaluation_lib.evaluate_program(program, state[0].params, eval_data, config.seed)

    with sharding.activate(program.mesh, program.rules):
        _, step_seconds = timer.timed(step, MEASURED_STEPS)
        _, eval_seconds = timer.timed(evaluation, 1)
        scratch = workdir / MEASURED_CHECKPOINTS
        try:
            ckpt = checkpoint_lib.Checkpointer(scratch, 2)

            def save(step: int) -> float:
                start = time.perf_counter()
                ckpt.save(step, state[0], {"step": step})
                ckpt.wait()
                return time.perf_counter() - start

            # The first save also sets up what every later one in this process reuses
            # (and is spent by now): the second is what a checkpoint of the run costs.
            save(1)
            checkpoint_seconds = save(2)
            ckpt.close()
        finally:
            distributed.barrier("time budget: checkpoints measured")
            if distributed.is_leader():
                paths.remove(scratch)
    del state[0]
    return budget_lib.Costs(step=step_seconds, evaluation=eval_seconds,
                            checkpoint=checkpoint_seconds)


def plan_run(config: ml_collections.ConfigDict, workdir: paths.Path, program, mesh,
            batches: Callable[[], Iterator[np.ndarray]], eval_data: list[jax.Array],
            vocab_size: int, started: float, resumed: bool) -> tuple[budget_lib.Plan, bool]:
    """(the run's plan, whether it was made now): read back (a resumed run keeps it,
    whatever machine it is on now), or made now from what this machine measures (process
    0's, on every process)."""
    t = config.train
    plan = budget_lib.read(workdir)
    if plan is not None:
        logging.info("time budget: keeping the plan of this run: %s", budget_lib.describe(plan))
        return plan, False
    recorded = layout.recorded_config(workdir) or {}
    if resumed and (recorded.get("train") or {}).get("time_budget_minutes"):
        raise budget_lib.BudgetError(  # planned, and its plan is gone
            f"{budget_lib.FIELD}: {workdir / layout.PLAN_FILE}, the plan of this run, is "
            f"missing; {budget_lib.lost_plan(workdir)}")
    if resumed:  # checkpoints of a run that was never planned: its steps are num_steps
        raise budget_lib.BudgetError(
            f"{budget_lib.FIELD}: {workdir} holds a run started without a time budget (no "
            f"{layout.PLAN_FILE}); continue it without one, or use another --workdir")
    costs = measure(program, config, batches(), eval_data, workdir)
    device = f"{mesh.size} x {jax.devices()[0].device_kind}"
    # The planned run runs the measured programs (its schedule is data): what is left of
    # the budget is what the measurement left.
    spent = budget_lib.clock() - started

    def plan_of(steps: int | None = None) -> budget_lib.Plan:
        return budget_lib.make(60 * t.time_budget_minutes, t.time_budget_margin, spent, costs,
                               t, device, t.batch_size * config.data.seq_len,
                               program.model_flops, steps)

    # Process 0 decides (the others measured a little differently), refusals included.
    try:
        mine, refusal = plan_of().steps, None
    except budget_lib.BudgetError as e:
        mine, refusal = 0, e
    steps = int(distributed.leader_number(mine))
    if not steps:
        raise refusal or budget_lib.BudgetError(
            f"{budget_lib.FIELD}: too small for this run (process 0's log says why)")
    plan = plan_of(steps)
    end = datetime.datetime.now() + datetime.timedelta(
        seconds=plan.predicted_seconds - (budget_lib.clock() - started))
    logging.info("time budget: %s; the run should end about %s (planned again at each log "
                 "step from the loop's own rate)", budget_lib.describe(plan),
                 end.strftime("%Y-%m-%d %H:%M"))
    return plan, True


def record(workdir: paths.Path, plan: budget_lib.Plan) -> None:
    """Writes the plan to the workdir's plan.json (process 0), whole or not at all."""
    if distributed.is_leader():
        paths.write_atomically(workdir / layout.PLAN_FILE, plan.to_json().encode())
