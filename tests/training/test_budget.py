"""Training to a time budget (training/budget.py): the plan's arithmetic, the schedule's
shape at the planned end, a budgeted run that trains its plan and keeps it when resumed,
and a budget too small refused in one line. The measured costs are injected: nothing
here is timed."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from maelm_jax.infra import errors, paths
from maelm_jax.pretrain import time_budget
from maelm_jax.pretrain import train as pretrain_train
from maelm_jax.training import budget, optimizer
from maelm_jax.workdirs import layout

from support import preempt_at, snapshot, tiny_pretraining, train_metrics
from tiny_config import tiny_config

pytestmark = pytest.mark.tier("integration")

COSTS = budget.Costs(step=2.0, evaluation=10.0, checkpoint=5.0)


@pytest.mark.tier("unit")
def test_the_plan_is_the_most_steps_that_fit():
    # 10 steps, evaluated every 4 (4, 8, 10) and saved every 5 (1, 5, 10).
    assert budget.evaluations(10, 4) == 3 and budget.checkpoints(10, 5) == 3
    assert budget.seconds(10, COSTS, 4, 5) == 10 * 2 + 3 * 10 + 3 * 5
    for available in (40.0, 65.0, 100.0, 333.0, 1000.0):
        steps = budget.plan_steps(available, COSTS, 4, 5, cap=10_000)
        assert budget.seconds(steps, COSTS, 4, 5) <= available
        assert budget.seconds(steps + 1, COSTS, 4, 5) > available
    assert budget.plan_steps(1e9, COSTS, 4, 5, cap=123) == 123
    with pytest.raises(budget.BudgetError, match=r"^config.train.time_budget_minutes: 16 s "
                                                 r"are left .* cannot hold one step"):
        budget.plan_steps(16.0, COSTS, 4, 5, cap=100)


@pytest.mark.tier("unit")
def test_the_schedule_keeps_its_shape_at_the_planned_end():
    c = tiny_config()
    t = c.train
    t.num_steps, t.warmup_steps, t.eval_every, t.checkpoint_every = 1000, 100, 500, 400
    budget.scale_schedule(t, 250)
    assert (t.num_steps, t.warmup_steps, t.eval_every, t.checkpoint_every) == (250, 25, 250, 250)
    values = jnp.asarray(optimizer.schedule_values(t), jnp.float32)

    def schedule(step):
        return float(optimizer.learning_rate_at(jnp.int32(step), values))

    assert schedule(25) == pytest.approx(t.learning_rate)  # the peak, a tenth in
    assert schedule(250) == 0.0  # the decay's floor at the planned end
    assert schedule(249) > 0.0


@pytest.mark.tier("unit")
def test_a_plan_is_made_from_the_budget_less_the_margin_and_what_was_spent():
    c = tiny_config()
    c.train.num_steps, c.train.eval_every, c.train.checkpoint_every = 10_000, 50, 100
    plan = budget.make(600.0, 0.1, 100.0, COSTS, c.train, "1 x cpu", 256, 1e9)
    assert plan.margin_seconds == 60.0
    assert plan.steps == budget.plan_steps(440.0, COSTS, 50, 100, 10_000)
    assert plan.spent_seconds + budget.seconds(plan.steps, COSTS, 50, 100) == \
        pytest.approx(plan.predicted_seconds) and plan.predicted_seconds <= 540.0
    assert plan.tokens == plan.steps * 256 and plan.flops == plan.steps * 1e9
    assert budget.Plan.from_dict(json.loads(plan.to_json())) == plan


def _replanner(plan, replans=True, start=0, clock=None):
    t = tiny_config().train
    t.num_steps, t.warmup_steps, t.eval_every, t.checkpoint_every = plan.steps, 10, 1000, 1000
    recorded = []
    replanner = budget.Replanner(plan, optimizer.with_decay_end(
        optimizer.schedule_values(t), 0, plan.steps), start, 0.0, t, cap=1000,
        replans=replans, record=recorded.append)
    return replanner, recorded


@pytest.mark.tier("unit")
def test_the_run_plans_again_from_its_own_rate(monkeypatch):
    """Planned at 1 s a step, the loop runs 1.5 s a step: the end moves to what the time
    left holds, and the learning rate goes on from where it was to 0 at the new end. An
    evaluation of 20 s between two log steps is not counted as a step, but it is what the
    final evaluation will cost: the end moves again. A resumed run replays the recorded
    re-plans at their steps and plans nothing itself."""
    now = [0.0]
    monkeypatch.setattr(budget, "clock", lambda: now[0])
    costs = budget.Costs(step=1.0, evaluation=0.0, checkpoint=0.0)
    plan = budget.Plan(steps=100, budget_seconds=110.0, margin_seconds=10.0,
                       spent_seconds=0.0, costs=costs, predicted_seconds=100.0, device="cpu",
                       tokens=0, flops=0.0)
    replanner, recorded = _replanner(plan)
    schedules = {0: replanner.schedule}
    for step in range(1, 31):
        now[0] += 1.5
        if step == 15:
            now[0] += 20.0
            replanner.paused(20.0, evaluation=True)
        if replanner.at_log(step) is not None:
            schedules[step] = replanner.schedule
    # At 3 s, 97 s are left: 64 more steps of 1.5 s. At 42.5 s, 57.5 s less the final
    # evaluation's 20: 25 more steps.
    revisions = recorded[-1].revisions
    assert [(r.step, r.steps) for r in revisions] == [(2, 66), (15, 40)]
    assert replanner.end == 40 == recorded[-1].end
    assert [r.step_seconds for r in revisions] == pytest.approx([1.5, 1.5])

    def rate(schedule, step):
        return float(optimizer.learning_rate_at(np.float64(step), np.asarray(schedule), np))

    peak = schedules[0][0]
    assert rate(schedules[2], 10) == pytest.approx(peak)  # the warmup is kept
    for step, before in ((2, schedules[0]), (15, schedules[2])):
        assert rate(schedules[step], step) == pytest.approx(rate(before, step))  # no jump
    assert rate(schedules[15], 39) > 0.0 and rate(schedules[15], 40) == 0.0

    # A run resumed after step 1 of that plan: the re-plans come back at their steps, from
    # the record, whatever its own clock says.
    resumed, written = _replanner(recorded[-1], replans=False, start=1)
    assert resumed.end == 100
    now[0] += 1000.0
    for step in range(2, 31):
        resumed.at_log(step)
        if step in schedules:
            assert resumed.schedule == schedules[step]
    assert not written and resumed.end == 40
    # Resumed after a re-plan's step, it is in force from the start.
    assert _replanner(recorded[-1], replans=False, start=20)[0].schedule == schedules[15]
    assert _replanner(recorded[-1], replans=False, start=5)[0].schedule == schedules[2]


SLOW_STEPS = budget.Costs(step=30.0, evaluation=0.0, checkpoint=0.0)


def _costs(monkeypatch, costs=SLOW_STEPS, loop_step=None):
    """The measurement replaced by `costs`, and the budget's clock by one that moves
    `loop_step` seconds (default: the measured step's) at each step the loop dispatches."""
    measured = []
    monkeypatch.setattr(time_budget, "measure",
                        lambda *args: measured.append(args) or costs)
    now = [0.0]
    monkeypatch.setattr(budget, "clock", lambda: now[0])
    step = pretrain_train.Pretraining.train_step

    def timed_step(self, *args):
        now[0] += costs.step if loop_step is None else loop_step
        return step(self, *args)

    monkeypatch.setattr(pretrain_train.Pretraining, "train_step", timed_step)
    return measured


def test_a_budgeted_run_trains_its_plan_and_keeps_it_when_resumed(tmp_path, tiny_tokenizer,
                                                                   monkeypatch):
    """10 minutes at an injected 30 s a step: the plan's steps (num_steps is the cap),
    the warmup its share of them, the decay ending at the planned last step. Stopped
    mid-way and resumed with another budget and cap, the run keeps its plan (nothing measured
    again) and ends as a run configured with the planned steps does. The planned run's
    step is the measured one's program (the schedule is data): built and compiled once."""
    measured = _costs(monkeypatch)
    built = []
    build = pretrain_train.setup_lib.build
    monkeypatch.setattr(pretrain_train.setup_lib, "build",
                        lambda *args: built.append(build(*args)) or built[-1])
    c = tiny_pretraining(tmp_path, tiny_tokenizer, num_steps=100, warmup_steps=20,
                         eval_every=1000, checkpoint_every=1000, time_budget_minutes=10.0,
                         time_budget_margin=0.05)
    run = tmp_path / "run"
    preempt_at(monkeypatch, c, run, 3)
    plan = budget.read(run)
    assert len(measured) == 1 and plan.costs.step == 30.0
    assert len(built) == 1 and built[0].step._cache_size() == 1
    assert plan.steps == budget.plan_steps(570.0 - plan.spent_seconds, plan.costs, 1000,
                                           1000, 100)
    assert plan.steps == 19 and not plan.revisions  # 570 s at 30 s a step, the loop's too
    recorded = json.loads((run / layout.CONFIG_FILE).read_text())
    assert recorded["train"]["num_steps"] == 100  # the config as given; the plan beside it

    c.train.time_budget_minutes = 1.0  # harmless: the plan is kept
    c.train.num_steps = 57  # and so is the cap the warmup's share is of (100)
    pretrain_train.train_and_evaluate(c, str(run))
    assert len(measured) == 1 and budget.read(run) == plan
    assert max(train_metrics(run)) == plan.steps and set(train_metrics(run, "eval")) == {
        plan.steps}

    # The same as a run configured with the planned steps and warmup share.
    plain = tiny_pretraining(tmp_path, tiny_tokenizer, num_steps=plan.steps,
                             warmup_steps=round(20 * plan.steps / 100), eval_every=1000,
                             checkpoint_every=1000)
    pretrain_train.train_and_evaluate(plain, str(tmp_path / "plain"))
    got, want = train_metrics(run)[plan.steps], train_metrics(tmp_path / "plain")[plan.steps]
    for key in ("loss", "learning_rate"):
        assert got[key] == pytest.approx(want[key], rel=1e-6), key

    # Finished: started again it trains nothing, whatever its budget says.
    pretrain_train.train_and_evaluate(c, str(run))
    assert max(train_metrics(run)) == plan.steps


def test_a_run_slower_than_measured_ends_in_time_and_resumes_exactly(
        tmp_path, tiny_tokenizer, monkeypatch):
    """Measured at 30 s a step, the loop runs 45: 10 minutes less the margin hold 12 steps,
    not the 19 planned, and the run ends at 12 (its learning rate at 0 there). A run that
    stopped after the re-plan and resumes from a checkpoint before it (plan.json holds the
    re-plan) trains exactly as the run that was not stopped."""
    _costs(monkeypatch, loop_step=45.0)
    c = tiny_pretraining(tmp_path, tiny_tokenizer, num_steps=100, warmup_steps=20,
                         eval_every=1000, checkpoint_every=1000, time_budget_minutes=10.0,
                         time_budget_margin=0.05)
    pretrain_train.train_and_evaluate(c, str(tmp_path / "whole"))
    plan = budget.read(tmp_path / "whole")
    assert plan.steps == 19 and [(r.step, r.steps) for r in plan.revisions] == [(2, 12)]
    assert max(train_metrics(tmp_path / "whole")) == 12

    stopped = tmp_path / "stopped"
    preempt_at(monkeypatch, c, stopped, 5)
    assert budget.read(stopped).revisions == plan.revisions
    paths.remove(stopped / layout.CHECKPOINTS / "5")  # lost: the run resumes after step 1
    pretrain_train.train_and_evaluate(c, str(stopped))
    got, want = train_metrics(stopped), train_metrics(tmp_path / "whole")
    assert sorted(got) == sorted(want)
    for step in want:
        for key in ("loss", "learning_rate"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-6), (step, key)


def test_a_budget_too_small_is_one_line_and_leaves_the_workdir_as_it_was(
        tmp_path, tiny_tokenizer, monkeypatch):
    _costs(monkeypatch, budget.Costs(step=1.0, evaluation=100.0, checkpoint=1.0))
    c = tiny_pretraining(tmp_path, tiny_tokenizer, time_budget_minutes=1.0)
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "notes.txt").write_text("mine")
    before = snapshot(workdir)
    with pytest.raises(errors.UserError, match=r"^config.train.time_budget_minutes: 60 s less "
                                               r"the margin \(3 s\) and the \d+ s the start "
                                               r"took .*an evaluation \(100.0 s\)") as e:
        pretrain_train.train_and_evaluate(c, str(workdir))
    assert "\n" not in str(e.value)
    assert snapshot(workdir) == before


def test_the_costs_are_measured_on_the_run_s_own_programs(tmp_path, tiny_tokenizer, caplog):
    """Unpatched: a step, an evaluation and a checkpoint measured here, and a budget far
    above what 6 steps need plans the cap."""
    import logging

    c = tiny_pretraining(tmp_path, tiny_tokenizer, num_steps=6, time_budget_minutes=60.0)
    with caplog.at_level(logging.INFO):
        pretrain_train.train_and_evaluate(c, str(tmp_path / "run"))
    plan = budget.read(tmp_path / "run")
    assert plan.steps == 6 and plan.budget_seconds == 3600.0 and plan.margin_seconds == 180.0
    costs = plan.costs
    assert 0 < costs.step < 60 and 0 < costs.evaluation < 600 and 0 < costs.checkpoint < 600
    assert plan.spent_seconds > 0 and plan.device.endswith("cpu")
    assert not (tmp_path / "run" / time_budget.MEASURED_CHECKPOINTS).exists()
    assert max(train_metrics(tmp_path / "run")) == 6
    assert "time budget: 6 steps" in caplog.text and "the run should end about" in caplog.text
    assert "trained steps 1-6 in" in caplog.text and "of a 3600 s budget" in caplog.text


@pytest.mark.tier("unit")
@pytest.mark.parametrize("text, reason", [
    ('{"steps": 19, "budg', "line 1 column 15"),
    ("null", "it holds null, not an object"),
    ('{"steps": "19"}', 'steps is "19", expected int'),
])
def test_a_damaged_plan_is_one_line_whose_advice_leads_to_the_same_run(tmp_path, text,
                                                                       reason):
    """The plan fixes the steps and schedule of the checkpoints trained under it: the
    advice is to put it back, or to start the run again from its budget, never to go on
    without it (which would train toward the cap, with the cap's warmup)."""
    (tmp_path / layout.PLAN_FILE).write_text(text)
    with pytest.raises(budget.BudgetError) as e:
        budget.read(paths.Path(tmp_path))
    line = str(e.value)
    assert "\n" not in line and reason in line and "put back a copy of it" in line
    assert f"move {tmp_path / layout.CHECKPOINTS} out as well and run the same command" in line


@pytest.mark.tier("unit")
def test_a_planned_run_whose_plan_is_gone_is_not_taken_for_one_never_planned(tmp_path):
    c = tiny_config("maelm")
    c.train.time_budget_minutes = 10.0
    layout.write_config(paths.Path(tmp_path), c)
    with pytest.raises(budget.BudgetError, match=r"plan.json, the plan of this run, is "
                                                 r"missing; .*put back a copy of it"):
        time_budget.plan_run(c, paths.Path(tmp_path), None, None, None, [], 0, 0.0,
                             resumed=True)


@pytest.mark.tier("unit")
def test_a_plan_records_its_cap_and_one_of_an_earlier_version_reads_without(tmp_path):
    plan = budget.make(600.0, 0.05, 0.0, COSTS, tiny_config("maelm").train, "cpu", 1, 1.0)
    assert plan.cap == tiny_config("maelm").train.num_steps
    record = json.loads(plan.to_json())
    del record["cap"]
    assert budget.Plan.from_dict(record).cap is None
    train = tiny_config("maelm").train
    train.num_steps, train.warmup_steps = 57, 20
    budget.scale_schedule(train, 19, cap=100)
    assert (train.num_steps, train.warmup_steps) == (19, 4)
