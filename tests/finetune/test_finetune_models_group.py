"""Several models x seeds of one task trained as one program (sweep.run_models,
seed_group.run_members): each run is its model's and seed's single run (its own encoder and
learning rate as data), runs of one seed draw the same batches and dropout whichever model
they start from, a group cut mid-way resumes exactly, and runs that cannot share a program
are refused in one line."""

import json

import pytest

from maelm_jax.finetune import seed_group, sweep, train
from maelm_jax.pretrain import train as pretrain_train
from maelm_jax.training import preemption

from support import assert_close, interrupt_batches, tiny_finetuning
from tiny_config import tiny_config

pytestmark = pytest.mark.tier("integration")

RUN = {"train.num_epochs": 1, "train.evals_per_epoch": 2, "train.log_every": 2,
       "train.checkpoint_every": 0, "save_checkpoint": False}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, tiny_tokenizer):
    """Two 4-step tiny pretrainings of one architecture (MLM and MAE-LM)."""
    runs = {}
    for objective in ("mlm", "maelm"):
        c = tiny_config(objective, tiny_tokenizer.model_path)
        c.train.num_steps = c.train.checkpoint_every = c.train.eval_every = 4
        workdir = tmp_path_factory.mktemp(objective)
        pretrain_train.train_and_evaluate(c, str(workdir))
        runs[objective] = str(workdir)
    return runs


def _sweeps(settings, pretrained, seeds=(1, 2)):
    """MLM, MAE-LM and the control (random weights, 3x the learning rate)."""
    out = {}
    for name, init_from in (*pretrained.items(), ("scratch", pretrained["mlm"])):
        c = tiny_finetuning(settings, **RUN)
        c.init_from, c.sweep = init_from, True
        c.grid.seeds, c.grid.seeds_per_program = seeds, len(seeds)
        c.grid.learning_rate = (3e-3 if name == "scratch" else 1e-3,)
        c.grid.num_epochs, c.grid.batch_size = (1,), (8,)
        if name == "scratch":
            c.init_weights = "random"
        out[name] = c
    return out


def _runs(root, summaries):
    return {(n, s): json.loads((root / n / "runs" / summary["settings"][0]["setting"]
                                / f"seed_{s}" / "results.json").read_text())
            for n, summary in summaries.items() for s in summary["seeds"]}


def _train_rows(group):
    rows = map(json.loads, (group / "metrics.jsonl").read_text().splitlines())
    return [r for r in rows if r["split"] == "train"]


def _strip(record):
    record = dict(record)
    for key in ("wall_seconds", "seed_group"):
        record.pop(key, None)
    return record


def test_a_task_as_one_program_equals_its_runs_apart(sst2_settings, pretrained, tmp_path):
    """Three models x two seeds in one program: MLM's seed 1 and the control's seed 2 (its
    own learning rate) are their single runs, to float rounding; the models differ, so the
    comparison can fail; every run is recorded as one of the group's six."""
    sweeps = _sweeps(sst2_settings, pretrained)
    root = tmp_path / "finetune"
    summaries = sweep.run_models(sweeps, {n: str(root / n) for n in sweeps},
                                 str(root / "groups"))
    got = _runs(root, summaries)
    group = root / "groups" / "mlm_maelm_scratch" / "seeds_1_2"
    roster = json.loads((group / "group.json").read_text())["runs"]
    assert [r["key"] for r in roster] == [f"{n}/seed_{s}" for n in sweeps for s in (1, 2)]
    assert [r["learning_rate"] for r in roster] == [1e-3] * 4 + [3e-3] * 2
    for record in got.values():
        assert len(record["seed_group"]["runs"]) == 6
    assert got[("scratch", 2)]["hyperparameters"]["learning_rate"] == 3e-3
    assert got[("scratch", 2)]["init_from"].startswith("random weights")
    for name, seed in (("mlm", 1), ("scratch", 2)):
        c = sweep.run_config(sweeps[name], sweep.settings(sweeps[name])[0], seed)
        alone = train.run(c, str(tmp_path / f"alone_{name}_{seed}"))
        assert_close(_strip(got[(name, seed)]), _strip(alone), f"{name} {seed}", atol=1e-4)
    losses = {n: [r[f"{n}/seed_1/loss"] for r in _train_rows(group)] for n in sweeps}
    assert losses["mlm"] != losses["maelm"] != losses["scratch"]
    assert sorted(summaries["maelm"]["settings"][0]["per_seed"]) == ["1", "2"]


def test_runs_of_one_seed_draw_the_same_batches_and_dropout(sst2_settings, tmp_path):
    """A group's batches for the runs (seeds 1, 2, 1): the two runs of seed 1 get the same
    arrays, drawn once, and the step folds each run's own seed into its dropout key, so
    runs of one seed differ only by their encoder and learning rate."""
    import numpy as np

    from maelm_jax.finetune import tasks

    sequences = [np.arange(3 + i % 7, dtype=np.int32) for i in range(24)]
    split = tasks.Split(sequences, {"labels": np.arange(24, dtype=np.int32) % 2})
    stacked = list(seed_group.stacked_batches(split, 4, (16,), (1, 2, 1), 1, 0))
    assert len(stacked) == 6
    for arrays in stacked:
        for values in arrays.values():
            np.testing.assert_array_equal(values[0], values[2])
    assert any((a["labels"][0] != a["labels"][1]).any() for a in stacked)


def _seeded(c, seed):
    c = c.copy_and_resolve_references()
    c.seed = seed
    return c


def test_a_task_cut_mid_way_resumes(sst2_settings, pretrained, tmp_path, monkeypatch):
    """Stopped by SIGTERM at step 4 of 6 (saved there, beside the evaluation at 3), the
    same call finishes every model's runs as the uninterrupted program does."""
    sweeps = _sweeps(sst2_settings, pretrained, seeds=(1,))
    whole_root, cut_root = tmp_path / "whole", tmp_path / "cut"
    whole = _runs(whole_root, sweep.run_models(
        sweeps, {n: str(whole_root / n) for n in sweeps}, str(whole_root / "groups")))
    interrupt_batches(monkeypatch, [], 4, "sigterm")
    with pytest.raises(preemption.Preempted):
        sweep.run_models(sweeps, {n: str(cut_root / n) for n in sweeps},
                         str(cut_root / "groups"))
    group = cut_root / "groups" / "mlm_maelm_scratch" / "seeds_1"
    saved = sorted(p.name for p in (group / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == ["3", "4"]
    resumed = _runs(cut_root, sweep.run_models(
        sweeps, {n: str(cut_root / n) for n in sweeps}, str(cut_root / "groups")))
    for key, record in whole.items():
        got, want = _strip(resumed[key]), _strip(record)
        assert got == want, key


def test_runs_that_cannot_share_a_program_are_refused(sst2_settings, pretrained, tmp_path):
    c = tiny_finetuning(sst2_settings, **RUN)
    c.init_from = pretrained["mlm"]
    other = _seeded(c, 2)
    other.train.batch_size = 4
    members = [seed_group.Member("a", _seeded(c, 1), str(tmp_path / "a")),
               seed_group.Member("b", other, str(tmp_path / "b"))]
    with pytest.raises(Exception, match=r"^config.train.batch_size: run b of a group differs "
                                        r"from run a in it"):
        seed_group.run_members(members, str(tmp_path / "group"))
    assert not (tmp_path / "group").exists()
