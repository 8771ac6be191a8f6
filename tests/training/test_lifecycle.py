"""The one lifecycle policy (training/lifecycle.py) as each mode that trains applies it:
what a workdir's record decides (start, continue, finished), a changed config refused in
the same one line, the override flag's meaning per mode, and records from before a field
existed. Reads only: the runs themselves are in the kill-and-resume tests."""

import json

import pytest

from configs.finetune import glue as glue_config
from maelm_jax.finetune import config as finetune_config
from maelm_jax.finetune import inputs as finetune_inputs
from maelm_jax.pretrain import train as pretrain_train
from maelm_jax.training import lifecycle
from maelm_jax.workdirs import layout

from tiny_config import tiny_config

pytestmark = pytest.mark.tier("unit")

START, CONTINUE, FINISHED = (lifecycle.Decision.START, lifecycle.Decision.CONTINUE,
                             lifecycle.Decision.FINISHED)


def _pretraining():
    return pretrain_train.PRETRAINING, tiny_config("maelm", "/tmp/tiny.model")


def _fine_tuning():
    c = glue_config.get_config("sst2")
    c.init_from, c.data.data_dir = "/runs/pre", "/data/glue"
    return finetune_inputs.FINE_TUNING, finetune_config.resolve_paths(c)


MODES = {"pretraining": _pretraining, "fine-tuning": _fine_tuning}


def _record(workdir, config):
    workdir.mkdir(exist_ok=True)
    layout.write_config(workdir, config)


@pytest.mark.parametrize("mode", MODES)
def test_what_a_workdir_holds_decides_the_run(mode, tmp_path):
    policy, c = MODES[mode]()
    assert lifecycle.decide(policy, c, tmp_path / "new") is START
    _record(tmp_path, c)
    assert lifecycle.decide(policy, c, tmp_path) is CONTINUE
    harmless = c.copy_and_resolve_references()
    harmless.train.log_every += 1
    harmless.mesh.shape = (1, 1, 1)
    assert lifecycle.decide(policy, harmless, tmp_path) is CONTINUE
    # Fine-tuning's results.json says finished; pretraining's checkpoint at num_steps
    # does (one short of it continues, and so does a run given more steps).
    if mode == "fine-tuning":
        (tmp_path / layout.RESULTS_FILE).write_text("{}")
    else:
        (tmp_path / layout.CHECKPOINTS / str(c.train.num_steps - 1)).mkdir(parents=True)
        assert lifecycle.decide(policy, c, tmp_path) is CONTINUE
        (tmp_path / layout.CHECKPOINTS / str(c.train.num_steps)).mkdir()
    assert lifecycle.decide(policy, c, tmp_path) is FINISHED
    if mode == "pretraining":
        c.train.num_steps += 1
        assert lifecycle.decide(policy, c, tmp_path) is CONTINUE


@pytest.mark.parametrize("mode", MODES)
def test_a_changed_config_is_refused_in_one_line_in_every_mode(mode, tmp_path):
    policy, c = MODES[mode]()
    _record(tmp_path, c)
    changed = c.copy_and_resolve_references()
    changed.seed += 1
    changed.train.learning_rate *= 2
    with pytest.raises(layout.WorkdirError) as e:
        lifecycle.decide(policy, changed, tmp_path)
    assert str(e.value) == (
        f"{tmp_path} holds a run with a different config.seed, config.train.learning_rate; "
        f"use another --workdir, or pass --allow_config_change to {policy.override_words} "
        "anyway")
    # The override: pretraining goes on with its checkpoints, fine-tuning starts again.
    assert lifecycle.decide(policy, changed, tmp_path, allow_config_change=True) is (
        START if mode == "fine-tuning" else CONTINUE)


@pytest.mark.parametrize("mode", MODES)
def test_another_modes_workdir_is_refused(mode, tmp_path):
    policy, c = MODES[mode]()
    other = "finetune" if policy.mode == "pretrain" else "pretrain"
    (tmp_path / layout.CONFIG_FILE).write_text(json.dumps({"mode": other}))
    with pytest.raises(layout.WorkdirError, match=rf"^{tmp_path} holds a {other} run, not a "
                                                  rf"{policy.noun} run; use another --workdir$"):
        lifecycle.decide(policy, c, tmp_path, allow_config_change=True)


@pytest.mark.parametrize("mode", MODES)
def test_a_record_from_before_a_field_existed_counts_its_default(mode, tmp_path):
    policy, c = MODES[mode]()
    recorded = json.loads(layout.config_json(c))
    del recorded["train"]["learning_rate"]  # as if written before the field existed
    tmp_path.joinpath(layout.CONFIG_FILE).write_text(json.dumps(recorded))
    default = policy.defaults().train.learning_rate
    assert lifecycle.changes(policy, c, recorded) == (
        [] if c.train.learning_rate == default else ["train.learning_rate"])
    at_default = c.copy_and_resolve_references()
    at_default.train.learning_rate = default
    assert lifecycle.decide(policy, at_default, tmp_path) is CONTINUE


def test_the_harmless_fields_are_each_modes_own():
    """Fine-tuning's evals_per_epoch decides which evaluation is selected: a change;
    pretraining's num_steps only how far the run goes: harmless."""
    ft_policy, ft = _fine_tuning()
    changed = ft.copy_and_resolve_references()
    changed.train.evals_per_epoch += 1
    assert lifecycle.changes(ft_policy, changed, json.loads(layout.config_json(ft))) == [
        "train.evals_per_epoch"]
    pt_policy, pt = _pretraining()
    longer = pt.copy_and_resolve_references()
    longer.train.num_steps *= 2
    assert lifecycle.changes(pt_policy, longer, json.loads(layout.config_json(pt))) == []


def test_a_session_opens_in_one_order_and_closes_however_the_loop_ends(tmp_path, monkeypatch):
    """lifecycle.session: make way, restore (config.json not yet written: a run whose
    checkpoints cannot restore leaves the record as it was), then config.json and the
    mode's records, then the writer; the checkpointer closes when the loop raises."""
    import flax
    import jax.numpy as jnp

    @flax.struct.dataclass
    class State:
        step: jnp.ndarray
        w: jnp.ndarray

    _, config = _pretraining()
    workdir, events = tmp_path / "run", []
    config_file = workdir / layout.CONFIG_FILE
    restore = lifecycle.restore_or_init
    monkeypatch.setattr(lifecycle, "restore_or_init", lambda *args: events.append(
        ("restore", config_file.exists())) or restore(*args))
    closed = []
    close = lifecycle.checkpoint_lib.Checkpointer.close
    monkeypatch.setattr(lifecycle.checkpoint_lib.Checkpointer, "close",
                        lambda self: closed.append(True) or close(self))

    def init():
        return State(jnp.zeros([], jnp.int32), jnp.arange(3.0))

    with pytest.raises(RuntimeError, match="the loop failed"):
        with lifecycle.session(workdir, config, init(), init, keep=2, resume=True,
                               make_way=lambda: events.append(("make way", workdir.exists())),
                               records=[lambda: events.append(
                                   ("record", config_file.exists()))]) as session:
            events.append(("loop", session.start))
            session.ckpt.save(7, session.state.replace(step=jnp.int32(7)), {"step": 7})
            raise RuntimeError("the loop failed")
    assert events == [("make way", True), ("restore", False), ("record", True), ("loop", 0)]
    assert closed == [True]  # the save was waited for
    events.clear()
    with lifecycle.session(workdir, config, init(), init, keep=2, resume=True) as session:
        assert session.start == 7 and session.state.w.tolist() == [0.0, 1.0, 2.0]
