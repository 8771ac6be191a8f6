"""The learning-rate schedules as data (training/optimizer.py: learning_rate_at, shaped,
with_decay_end): each shape's rates at its landmarks, the same rates on the host and in a
compiled program, one compiled program for every shape, and a time budget's re-plans
(training/budget.py) that keep every shape without a jump and move only WSD's decay. A
resumed run mid-decay is exact: tests/training/test_reliability.py's resume test runs WSD."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.pretrain import setup as setup_lib
from maelm_jax.training import budget, optimizer

from tiny_config import tiny_config

pytestmark = pytest.mark.tier("unit")

PEAK, WARMUP, STEPS = 1e-3, 100, 1000


def _train(shape, **changes):
    t = tiny_config().train
    t.learning_rate, t.warmup_steps, t.num_steps, t.lr_schedule = PEAK, WARMUP, STEPS, shape
    t.decay_fraction, t.min_lr_ratio = 0.25, 0.1
    t.update(changes)
    return t


def _rate(schedule, step):
    return float(optimizer.learning_rate_at(np.float64(step), np.asarray(schedule, np.float64),
                                            np))


@pytest.mark.parametrize("shape", optimizer.SCHEDULES)
def test_each_shape_at_its_landmarks(shape):
    """The end of the warmup is the peak for every shape; then each goes its way to the
    floor (min_lr_ratio x peak) at the last step: linear and cosine from the warmup's end,
    WSD from the start of its decay (the last decay_fraction of the steps)."""
    s = optimizer.shaped(_train(shape))
    floor = 0.1 * PEAK
    assert _rate(s, 0) == 0.0 and _rate(s, WARMUP // 2) == pytest.approx(PEAK / 2)
    assert _rate(s, WARMUP) == pytest.approx(PEAK)
    middle = (WARMUP + STEPS) / 2
    expected = {
        "linear": {middle: (PEAK + floor) / 2, STEPS: floor, STEPS + 50: floor},
        "cosine": {middle: (PEAK + floor) / 2, WARMUP + 0.25 * (STEPS - WARMUP):
                   floor + (PEAK - floor) * (0.5 + 0.5 * math.cos(math.pi / 4)), STEPS: floor},
        # 250 decay steps: the peak until step 750, half-way down at 875.
        "wsd": {749: PEAK, 750: PEAK, 875: (PEAK + floor) / 2, STEPS: floor},
        "constant": {middle: PEAK, STEPS: PEAK},
        "inv_sqrt": {4 * WARMUP: PEAK / 2, 900: PEAK / 3, 10_000_000: floor},
    }[shape]
    for step, rate in expected.items():
        assert _rate(s, step) == pytest.approx(rate, rel=1e-9), (shape, step)


def test_the_linear_shape_without_a_floor_is_the_papers_schedule():
    """The default config's full form gives the rates of the three-value form (fine-tuning's,
    and pretraining's before the shapes) at every step."""
    t = _train("linear", min_lr_ratio=0.0)
    full, plain = optimizer.shaped(t), optimizer.schedule_values(t)
    for step in range(0, STEPS + 20, 7):
        assert _rate(full, step) == pytest.approx(_rate(plain, step), abs=1e-12), step


def test_host_and_device_rates_are_equal_and_one_program_serves_every_shape():
    """The jitted step's float32 rate equals numpy's float32 rate for every shape (what the
    logs, the plots and the budget compute on the host is what the step applies), and the
    program compiles once for all of them."""
    rate = jax.jit(optimizer.learning_rate_at)
    steps = np.array([0, 1, 50, 99, 100, 101, 300, 749, 750, 751, 875, 999, 1000, 1200])
    for shape in optimizer.SCHEDULES:
        s = np.asarray(optimizer.shaped(_train(shape)), np.float32)
        device = [float(rate(jnp.int32(step), jnp.asarray(s))) for step in steps]
        host = [float(optimizer.learning_rate_at(np.int32(step), s, np)) for step in steps]
        np.testing.assert_allclose(device, host, rtol=2e-6, atol=1e-12, err_msg=shape)
    assert rate._cache_size() == 1


def test_a_config_names_a_known_shape_and_fractions_in_range():
    c = tiny_config()
    for field, value, words in (("lr_schedule", "cosin", "one of"),
                                ("decay_fraction", 1.5, r"a number in \[0, 1\]"),
                                ("min_lr_ratio", -0.1, r"a number in \[0, 1\]")):
        bad = c.copy_and_resolve_references()
        bad.train[field] = value
        with pytest.raises(pretrain_config.ConfigError,
                           match=rf"^config.train.{field}: expected {words}"):
            pretrain_config.validate(bad)


def test_the_program_takes_the_full_form():
    t = _train("wsd")
    assert setup_lib.schedule_values(t) == optimizer.shaped(t)
    assert len(optimizer.shaped(t)) == optimizer.FULL


@pytest.mark.parametrize("shape", optimizer.SCHEDULES)
def test_a_re_plan_keeps_the_shape_without_a_jump(shape):
    """A time budget's re-plans (with_decay_end) at a step in the warmup, the stable or
    decay phase: the rate at that step is unchanged, the rates before it are not the
    schedule's business, and the decay reaches the floor at the new end (constant and
    inv_sqrt are the same schedule whatever the end)."""
    floor = 0.1 * PEAK
    for at, end in ((50, 600), (500, 1400), (800, 900), (900, 2000)):
        before = optimizer.shaped(_train(shape))
        after = optimizer.with_decay_end(before, at, end)
        assert _rate(after, max(at, WARMUP)) == pytest.approx(_rate(before, max(at, WARMUP)),
                                                              rel=1e-9), (shape, at)
        if shape in ("linear", "cosine", "wsd"):
            assert _rate(after, end) == pytest.approx(floor, rel=1e-9)
            assert _rate(after, end - 1) > floor
        else:
            for step in range(at, end + 100, 37):
                assert _rate(after, step) == pytest.approx(_rate(before, step), rel=1e-9)


def test_a_re_planned_cosine_keeps_its_phase():
    """Re-planned half-way down, a cosine goes on as the same curve stretched to the new
    end: at each share of the remaining steps the rate is what the first plan had at the
    same share of its own."""
    before = optimizer.shaped(_train("cosine", min_lr_ratio=0.0))
    at = 550  # half-way through 100-1000
    after = optimizer.with_decay_end(before, at, 1900)
    for share in (0.1, 0.5, 0.9):
        assert _rate(after, at + share * 1350) == pytest.approx(
            _rate(before, at + share * 450), rel=1e-9)


def test_a_budgeted_wsd_run_moves_only_its_decay():
    """The Replanner (training/budget.py) on a WSD schedule: a re-plan in the stable phase
    leaves the warmup and the peak as they were and moves the decay to the last
    decay_fraction of the new end; the recorded re-plan replays to the same schedule."""
    t = _train("wsd", min_lr_ratio=0.0, log_every=10, eval_every=10_000,
               checkpoint_every=10_000)
    plan = budget.Plan(steps=STEPS, budget_seconds=2000.0, margin_seconds=0.0,
                       spent_seconds=0.0, costs=budget.Costs(1.0, 0.0, 0.0),
                       predicted_seconds=1000.0, device="cpu", tokens=0, flops=0.0,
                       revisions=(budget.Revision(step=200, steps=1600, step_seconds=1.0,
                                                  elapsed_seconds=200.0,
                                                  predicted_seconds=1600.0),))
    replanner = budget.Replanner(plan, optimizer.shaped(t), 0, 0.0, t, cap=10_000,
                                 replans=False, record=lambda plan: None)
    first = replanner.schedule
    assert replanner.at_log(200) is not None and replanner.end == 1600
    moved = replanner.schedule
    for step in (0, 50, 100, 200):
        assert _rate(moved, step) == pytest.approx(_rate(first, step))
    assert _rate(moved, 1199) == pytest.approx(PEAK)  # stable until 1600 - 400
    assert _rate(moved, 1200) == pytest.approx(PEAK) and _rate(moved, 1400) == \
        pytest.approx(PEAK / 2)
    assert _rate(moved, 1600) == 0.0
    resumed = budget.Replanner(plan, optimizer.shaped(t), 300, 0.0, t, cap=10_000,
                               replans=False, record=lambda plan: None)
    assert resumed.schedule == moved and resumed.end == 1600
