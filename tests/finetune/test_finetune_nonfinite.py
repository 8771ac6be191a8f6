"""Fine-tuning shares pretraining's non-finite policy (training/engine.py): a step whose
loss or gradients are not finite leaves the parameters and Adam's moments as they were;
"stop" ends the run with one line naming the step, "skip" counts it and goes on."""

import json

import numpy as np
import pytest

from maelm_jax.finetune import setup as finetune_setup
from maelm_jax.finetune import train
from maelm_jax.training import engine

from conftest import poison_steps
from support import tiny_finetuning

pytestmark = pytest.mark.tier("integration")

RUN = {"train.num_epochs": 1, "train.log_every": 2, "train.checkpoint_every": 2}


def _poison_step(step_index, monkeypatch):
    poison_steps(monkeypatch, finetune_setup, "make_train_step", [step_index])


def test_stop_names_the_step_and_keeps_the_resume_checkpoints(sst2_settings, tmp_path,  # noqa: F811
                                                              monkeypatch):
    _poison_step(2, monkeypatch)
    workdir = tmp_path / "run"
    with pytest.raises(engine.NonFiniteError,
                       match=r"step 3: non-finite .* checkpoint is step 2") as info:
        train.run(tiny_finetuning(sst2_settings, **RUN), str(workdir))
    assert "\n" not in str(info.value)
    assert (workdir / "checkpoints" / "2").is_dir() and not (workdir / "results.json").exists()


def test_skip_counts_the_dropped_update_and_finishes(sst2_settings, tmp_path,  # noqa: F811
                                                     monkeypatch):
    _poison_step(2, monkeypatch)
    workdir = tmp_path / "run"
    config = tiny_finetuning(sst2_settings, **RUN, **{"train.nonfinite": "skip"})
    results = train.run(config, str(workdir))
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["split"] == "train"]
    assert [r["skipped_updates"] for r in train_rows] == [0, 1, 1]
    assert all(np.isfinite(r["grad_norm"]) or r["step"] == 4 for r in train_rows)
    # Adam's moments kept out of the NaN: the steps after it train on finite numbers.
    assert np.isfinite(train_rows[-1]["loss"]) and np.isfinite(train_rows[-1]["grad_norm"])
    assert np.isfinite(results["dev"]["accuracy"])
