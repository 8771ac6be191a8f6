"""Several seeds of one setting trained as one program (finetune/seed_group.py): each run
is the single run of its seed (initialisation, data order, dropout, its own evaluations
and best), a sweep groups its seeds by grid.seeds_per_program and reuses finished groups,
and an interrupted group resumes exactly."""

import json

import jax
import numpy as np
import pytest

from maelm_jax.finetune import data, seed_group, sweep, tasks, train
from maelm_jax.training import preemption

from support import Interrupt, assert_close, interrupt_batches, tiny_finetuning

pytestmark = pytest.mark.tier("integration")

RUN = {"train.num_epochs": 2, "train.evals_per_epoch": 2, "train.log_every": 2,
       "train.checkpoint_every": 0, "save_checkpoint": False}


def _rows(workdir, split):
    return [r for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())
            if r["split"] == split]


def _group(config, seeds, root):
    dirs = [root / f"seed_{s}" for s in seeds]
    results = seed_group.run(config, seeds, str(root / seed_group.group_name(seeds)),
                             [str(d) for d in dirs])
    return results, dirs


def test_each_run_of_a_group_is_its_seeds_single_run(sst2_settings, tmp_path):
    """One bucket (32), so no step pads: seed s's losses, gradient norms and dev scores in
    the group are the single run's, to float rounding (two programs), and its own files say
    so. The two seeds differ, so the comparison can fail."""
    c = tiny_finetuning(sst2_settings, **RUN)
    seeds = (1, 2)
    results, dirs = _group(c, seeds, tmp_path / "group")
    group_train = _rows(tmp_path / "group" / "seeds_1_2", "train")
    losses = {}
    for seed, got, run_dir in zip(seeds, results, dirs, strict=True):
        c.seed = seed
        alone = train.run(c, str(tmp_path / f"alone_{seed}"))
        for key in ("wall_seconds", "seed_group"):
            got.pop(key, None)
            alone.pop(key, None)
        assert_close(got, alone, f"seed {seed}", atol=1e-4)
        recorded = json.loads((run_dir / "results.json").read_text())
        assert recorded["seed_group"]["seeds"] == [1, 2] and recorded["seed"] == seed
        assert json.loads((run_dir / "config.json").read_text())["seed"] == seed
        solo_train = _rows(tmp_path / f"alone_{seed}", "train")
        for mine, theirs in zip(group_train, solo_train, strict=True):
            for name in ("loss", "grad_norm"):
                assert mine[f"seed_{seed}/{name}"] == pytest.approx(theirs[name], abs=1e-4)
            assert mine["learning_rate"] == pytest.approx(theirs["learning_rate"])
        losses[seed] = [r[f"seed_{seed}/loss"] for r in group_train]
    assert losses[1] != losses[2]
    assert not (tmp_path / "group" / "seeds_1_2" / "checkpoints").exists()


def test_stacked_batches_pad_each_step_to_its_longest_run():
    # Mostly short sequences, a few long: batches land in different buckets.
    sequences = [np.arange(20 if i % 9 == 0 else 5, dtype=np.int32) for i in range(40)]
    split = tasks.Split(sequences, {"labels": np.arange(40, dtype=np.int32)})
    buckets, seeds = (8, 16, 32), (4, 5, 6)
    stacked = list(seed_group.stacked_batches(split, 4, buckets, seeds, 2, start=3))
    alone = [[b for _, b in train.train_batches(split, 4, buckets, s, 2, 3)] for s in seeds]
    assert len(stacked) == 2 * 10 - 3
    lengths, padded = set(), 0
    for step, arrays in enumerate(stacked):
        n = max(runs[step].tokens.shape[1] for runs in alone)
        lengths.add(n)
        assert arrays["tokens"].shape == (3, 4, n)
        for i, runs in enumerate(alone):
            own = runs[step]
            for name, values in own.padded(n).arrays().items():
                np.testing.assert_array_equal(arrays[name][i], values)
            # What padding adds is masked out.
            assert not arrays["key_mask"][i, :, own.tokens.shape[1]:].any()
            padded += own.tokens.shape[1] < n
    assert lengths == {8, 32} and padded > 0  # some runs padded, not every step's longest


def test_padded_refuses_to_shorten():
    batch = data.make_batch([np.arange(10, dtype=np.int32)], np.arange(1), 2, (16,), {})
    with pytest.raises(ValueError, match="cannot pad a batch of length 16 to 8"):
        batch.padded(8)


def test_a_sweep_runs_its_seeds_in_groups_and_reuses_them(sst2_settings, tmp_path, monkeypatch):
    """Seeds (1, 2, 3) two to a program: the group (1, 2) and seed 3 alone; the summary
    holds every seed, and a second sweep reuses all three without training."""
    c = tiny_finetuning(sst2_settings, **RUN)
    c.sweep = True
    c.grid.seeds, c.grid.seeds_per_program, c.grid.num_epochs = (1, 2, 3), 2, (1,)
    summary = sweep.run_sweep(c, str(tmp_path / "sweep"))
    runs = tmp_path / "sweep" / "runs" / summary["settings"][0]["setting"]
    assert sorted(p.name for p in runs.iterdir()) == ["seed_1", "seed_2", "seed_3", "seeds_1_2"]
    assert sorted(summary["settings"][0]["per_seed"]) == ["1", "2", "3"]
    assert (runs / "seed_3" / "metrics.jsonl").exists()  # alone: a single run's workdir
    assert not (runs / "seed_1" / "metrics.jsonl").exists()  # in the group's
    for seed in (1, 2):
        recorded = json.loads((runs / f"seed_{seed}" / "results.json").read_text())
        assert recorded["seed_group"]["seeds"] == [1, 2]
        assert summary["settings"][0]["per_seed"][str(seed)] == recorded["dev"]["accuracy"]

    def refuse(*args):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(seed_group, "run", refuse)
    monkeypatch.setattr(train, "run", refuse)
    again = sweep.run_sweep(c, str(tmp_path / "sweep"))
    assert again["settings"][0]["per_seed"] == summary["settings"][0]["per_seed"]


@pytest.mark.parametrize("select, how, at", [("best", "raise", 9), ("final", "sigterm", 7)])
def test_an_interrupted_group_resumes_exactly(sst2_settings, tmp_path, monkeypatch, select,
                                              how, at):
    """Stopped during step `at` (an exception, or SIGTERM, which saves that step), the same
    call finishes the group with every run's results and metrics as uninterrupted."""
    c = tiny_finetuning(sst2_settings, **RUN, **{"train.select": select})
    seeds = (1, 2)
    whole, _ = _group(c, seeds, tmp_path / "whole")

    interrupt_batches(monkeypatch, [], at, how)
    with pytest.raises(preemption.Preempted if how == "sigterm" else Interrupt):
        _group(c, seeds, tmp_path / "cut")
    group_dir = tmp_path / "cut" / "seeds_1_2"
    saved = sorted(int(p.name) for p in (group_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == ([3, 6] if how == "raise" else [6, 7])
    assert not (tmp_path / "cut" / "seed_1" / "results.json").exists()
    resumed, _ = _group(c, seeds, tmp_path / "cut")
    for got, want in zip(resumed, whole, strict=True):
        for record in (got, want):
            record.pop("wall_seconds")
            record.pop("seed_group")
        assert got == want
    metrics = [_rows(d, "train") + _rows(d, "dev")
               for d in (group_dir, tmp_path / "whole" / "seeds_1_2")]
    for rows in metrics:
        for r in rows:
            r.pop("examples_per_sec", None)
    assert metrics[0] == metrics[1]


def test_a_group_on_a_data_parallel_mesh_matches_one_device(sst2_settings, tmp_path):
    """The runs axis whole on every device, each run's batch split over 2 devices: the
    same results as on one device, to float rounding."""
    c = tiny_finetuning(sst2_settings, **{**RUN, "train.num_epochs": 1})
    one, _ = _group(c, (1, 2), tmp_path / "one")
    c.mesh.shape = (2, 1, 1)
    two, _ = _group(c, (1, 2), tmp_path / "two")
    for a, b in zip(one, two, strict=True):
        for record in (a, b):
            record.pop("wall_seconds")
            record.pop("seed_group")
        assert_close(a, b, atol=1e-4)
    assert jax.device_count() >= 2


def test_a_group_refuses_predictions_and_checkpoints(sst2_settings, tmp_path):
    c = tiny_finetuning(sst2_settings, **{**RUN, "save_checkpoint": True})
    with pytest.raises(Exception, match="config.save_checkpoint, config.predict_test: "
                                        "expected False for a seed group"):
        _group(c, (1, 2), tmp_path / "group")
    assert not (tmp_path / "group").exists()


def test_a_group_on_the_pallas_kernel_draws_each_runs_attention_dropout(sst2_settings,
                                                                        tmp_path):
    """The kernel (interpreted here) under the group's vmap: attention dropout 0.1 inside
    it, drawn from each run's own seed, so every run's losses are its single run's. Were
    the kernel's bits drawn from the batched grid's indices instead, they would differ."""
    run = {**RUN, "train.num_epochs": 1, "model.attention_impl": "pallas",
           "model.attention_dropout": 0.1, "train.log_every": 1}
    c = tiny_finetuning(sst2_settings, **run)
    _group(c, (1, 2), tmp_path / "group")
    group_train = _rows(tmp_path / "group" / "seeds_1_2", "train")
    for seed in (1, 2):
        c.seed = seed
        train.run(c, str(tmp_path / f"alone_{seed}"))
        alone = [r["loss"] for r in _rows(tmp_path / f"alone_{seed}", "train")]
        mine = [r[f"seed_{seed}/loss"] for r in group_train]
        assert len(mine) == 6
        np.testing.assert_allclose(mine, alone, rtol=1e-4, atol=1e-5)
