"""Sweeps: grid x seeds, medians per setting, JSON and Markdown, resumption; the configs."""

import json

import numpy as np
import pytest

from configs.finetune import glue as glue_config
from configs.finetune import squad as squad_config
from maelm_jax.finetune import config as finetune_config
from maelm_jax.finetune import sweep, train
from maelm_jax.workdirs import layout

from support import sst2_like

pytestmark = pytest.mark.tier("integration")


@pytest.fixture
def tiny_sweep_config(tmp_path, tiny_tokenizer):
    return tiny_sweep(tmp_path, tiny_tokenizer.model_path)


def tiny_sweep(tmp_path, tokenizer_path, num_epochs=1):
    """Two learning rates x two seeds of a tiny encoder on SST-2-like files in tmp_path."""
    data = tmp_path / "glue" / "SST-2"
    data.mkdir(parents=True, exist_ok=True)
    (data / "train.tsv").write_text(sst2_like(data, 48, 0))
    (data / "dev.tsv").write_text(sst2_like(data, 16, 1))
    c = glue_config.get_config("sst2")
    c.tokenizer_path = tokenizer_path  # from scratch: no init_from
    c.model.num_layers, c.model.d_model, c.model.num_heads, c.model.d_ff = 1, 32, 2, 64
    c.model.rel_pos_buckets, c.model.rel_pos_max_distance, c.model.max_positions = 8, 16, 32
    c.data.data_dir = str(tmp_path / "glue")
    c.data.max_seq_len, c.data.buckets = 32, (32,)
    c.train.eval_batch_size, c.train.log_every = 16, 10
    c.mesh.shape, c.fast_compile = (1, 1, 1), True
    c.sweep = True
    finetune_config.set_grid(c, {"learning_rate": (1e-3, 3e-3), "batch_size": (16,),
                                 "num_epochs": (num_epochs,), "warmup_ratio": (0.1,)})
    c.grid.seeds = (1, 2)
    return c


def test_sweep_reports_the_median_over_seeds_per_setting(tiny_sweep_config, tmp_path,
                                                         monkeypatch):
    workdir = tmp_path / "sweep"
    summary = sweep.run_sweep(tiny_sweep_config, str(workdir))
    assert [row["setting"] for row in summary["settings"]] == [
        "lr0.001_bs16_ep1_wu0.1", "lr0.003_bs16_ep1_wu0.1"]
    for row in summary["settings"]:
        per_seed = []
        for seed in (1, 2):
            run = workdir / "runs" / row["setting"] / f"seed_{seed}"
            results = json.loads((run / "results.json").read_text())
            assert results["seed"] == seed and results["num_steps"] == 3
            assert results["hyperparameters"]["learning_rate"] == row["hyperparameters"][
                "learning_rate"]
            assert not (run / "checkpoints").exists()  # sweeps keep no checkpoints
            per_seed.append(results["dev"]["accuracy"])
        assert row["per_seed"] == {"1": per_seed[0], "2": per_seed[1]}
        assert row["median"]["accuracy"] == pytest.approx(np.median(per_seed))
    best = max(summary["settings"], key=lambda r: r["median"]["accuracy"])
    assert summary["best_setting"] == best["setting"]
    assert json.loads((workdir / "sweep.json").read_text()) == summary
    table = (workdir / "sweep.md").read_text()
    assert "| setting | lr | batch | epochs | warmup | median accuracy | seed 1 | seed 2 |" in table
    assert f"| **{best['setting']}** |" in table
    assert len([line for line in table.splitlines()
                if line.startswith(("| lr0", "| **lr0"))]) == 2

    # Run again: every run is reused, nothing is trained.
    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(train, "run", no_training)
    assert sweep.run_sweep(tiny_sweep_config, str(workdir)) == summary


def test_configs_carry_the_papers_search_spaces():
    rte = glue_config.get_config("rte")  # a small task (Table 5, left)
    assert rte.mode == "finetune" and rte.task == "rte"
    assert tuple(rte.grid.learning_rate) == (2e-5, 3e-5, 4e-5, 5e-5)
    assert tuple(rte.grid.num_epochs) == (2, 3, 5, 10)
    assert tuple(rte.grid.batch_size) == (16, 32)
    assert tuple(rte.grid.warmup_ratio) == (0.06, 0.10)
    assert tuple(rte.grid.seeds) == (1, 2, 3, 4, 5)
    mnli_large = glue_config.get_config("MNLI,large")  # a large task, large++ rates
    assert tuple(mnli_large.grid.learning_rate) == (5e-6, 7e-6, 1e-5, 2e-5)
    assert tuple(mnli_large.grid.batch_size) == (32,)
    assert len(sweep.settings(mnli_large)) == 4 * 3
    squad = squad_config.get_config()  # Table 6
    assert squad.squad.version == "2.0" and tuple(squad.grid.num_epochs) == (2, 3)
    assert len(sweep.settings(squad)) == 4 * 2 * 2 * 2
    for c in (rte, mnli_large, squad):
        assert c.train.clip_norm == 0.0 and c.model.dropout == 0.1
        assert c.train.weight_decay == 0.01 and c.train.adam_eps == 1e-6
        assert (c.train.adam_b1, c.train.adam_b2) == (0.9, 0.98)
        assert c.train.learning_rate in tuple(c.grid.learning_rate)


def test_3ml_recipe_grid_weight_decay_and_aggregation():
    rte = glue_config.get_config("rte,3ml")  # 3ML Table 5, right column
    assert tuple(rte.grid.learning_rate) == (1e-5, 3e-5, 5e-5, 8e-5)
    assert tuple(rte.grid.num_epochs) == (3, 5, 10) and tuple(rte.grid.batch_size) == (16, 32)
    assert tuple(rte.grid.warmup_ratio) == (0.06,)
    assert rte.train.weight_decay == 0.1 and rte.grid.aggregate == "best_then_median"
    mnli = glue_config.get_config("mnli,paper=3ml")  # left column
    assert tuple(mnli.grid.learning_rate) == (5e-5, 8e-5) and tuple(mnli.grid.num_epochs) == (3, 5)
    assert len(sweep.settings(mnli)) == 2 * 2
    assert glue_config.get_config("rte").grid.aggregate == "median_then_best"
    with pytest.raises(ValueError, match="variant option paper: expected one of maelm, 3ml"):
        glue_config.get_config("rte,paper=bert")


# 3ML Table 5: QQP, MNLI and QNLI take the left column; CoLA, SST-2, MRPC, STS-B and RTE
# the right one (WNLI, which 3ML does not fine-tune, goes with them).
THREEML_LARGE = {"qqp", "mnli", "qnli"}


@pytest.mark.parametrize("task", ["cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli",
                                  "rte", "wnli"])
def test_3ml_grid_follows_its_table_5_task_by_task(task):
    c = glue_config.get_config(f"{task},3ml")
    if task in THREEML_LARGE:
        assert tuple(c.grid.learning_rate) == (5e-5, 8e-5)
        assert tuple(c.grid.batch_size) == (32,) and tuple(c.grid.num_epochs) == (3, 5)
        assert (c.train.batch_size, c.train.num_epochs) == (32, 3)
    else:
        assert tuple(c.grid.learning_rate) == (1e-5, 3e-5, 5e-5, 8e-5)
        assert tuple(c.grid.batch_size) == (16, 32) and tuple(c.grid.num_epochs) == (3, 5, 10)
        assert (c.train.batch_size, c.train.num_epochs) == (16, 10)
    assert tuple(c.grid.warmup_ratio) == (0.06,) and c.train.weight_decay == 0.1
    assert c.train.learning_rate in tuple(c.grid.learning_rate)
    assert c.metric == "3ml" and glue_config.get_config(task).metric == "maelm"
    # MAE-LM's own split differs on SST-2 (with its large tasks).
    maelm_small = len(glue_config.get_config(task).grid.batch_size) > 1
    assert maelm_small == (task not in THREEML_LARGE | {"sst2"})


def _rows(table):
    """Sweep rows from {setting: [score of seed 1, seed 2, ...]}."""
    return [{"setting": name, "median": {"acc": float(np.median(scores))},
             "per_seed": {str(i + 1): v for i, v in enumerate(scores)}}
            for name, scores in table.items()]


def test_the_two_aggregation_rules():
    # Setting a has the best median (70); setting b wins seeds 2 and 4 by a lot.
    rows = _rows({"a": [70, 70, 70, 70, 69], "b": [60, 90, 50, 95, 40]})
    seeds = ["1", "2", "3", "4", "5"]
    maelm = sweep.aggregate(rows, seeds, "acc", "median_then_best")
    assert (maelm["score"], maelm["best_setting"]) == (70, "a")
    threeml = sweep.aggregate(rows, seeds, "acc", "best_then_median")
    # Bests per seed: 70, 90, 70, 95, 69 -> median 70.
    assert threeml["score"] == 70 and threeml["best_setting"] == "a"
    assert [p["setting"] for p in threeml["best_per_seed"].values()] == ["a", "b", "a", "b", "a"]
    rows = _rows({"a": [70] * 5, "b": [90, 95, 60, 60, 60], "c": [60, 60, 90, 60, 60]})
    # Bests: 90, 95, 90, 70, 70 -> 90, above the best median (a's 70).
    assert sweep.aggregate(rows, seeds, "acc", "best_then_median")["score"] == 90
    assert sweep.aggregate(rows, seeds, "acc", "median_then_best")["score"] == 70


def test_config_mistakes_name_the_field(tiny_sweep_config, tmp_path):
    c = tiny_sweep_config
    # main.py runs a sweep config with sweep.run_sweep; train.run is one run.
    with pytest.raises(finetune_config.FinetuneConfigError,
                       match=r"^config.sweep: expected False for a single run"):
        train.run(c, str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()
    c.sweep = False
    c.train.select = "median"
    with pytest.raises(finetune_config.FinetuneConfigError,
                       match=r"^config.train.select: expected"):
        train.run(c, str(tmp_path / "x"))
    c.train.select = "best"
    c.data.max_seq_len = 64  # more than the encoder's 32 positions
    with pytest.raises(finetune_config.FinetuneConfigError,
                       match=r"config.data.max_seq_len: expected at most the encoder's 32"):
        train.run(c, str(tmp_path / "x"))
    c.data.max_seq_len, c.tokenizer_path = 32, ""
    with pytest.raises(finetune_config.FinetuneConfigError, match=r"^config.tokenizer_path: "):
        train.run(c, str(tmp_path / "x"))
    c.task = "sst3"
    with pytest.raises(finetune_config.FinetuneConfigError, match=r"^config.task: expected a GLUE"):
        train.run(c, str(tmp_path / "x"))
    pretraining_dir = tmp_path / "pre"
    pretraining_dir.mkdir()
    (pretraining_dir / "config.json").write_text(json.dumps({"mode": "pretrain"}))
    c.task, c.tokenizer_path = "sst2", "x.model"  # the workdir is checked first
    with pytest.raises(layout.WorkdirError, match=r"holds a pretrain run, not a fine-tuning"):
        train.run(c, str(pretraining_dir))


@pytest.mark.slow
def test_a_preempted_sweep_exits_143_and_the_same_command_finishes(tmp_path, tiny_tokenizer):
    """Through main.py: SIGTERM during the sweep's first run saves it and stops the sweep
    (exit 143, no summary, no later run started); the same command finishes with the
    summary of a sweep that was never stopped."""
    import subprocess
    import sys

    from conftest import HANG_SECONDS, REPO_ROOT, preempt_main, subprocess_env

    config_file = tmp_path / "sweep_config.py"
    tests = [str(REPO_ROOT / "tests"), str(REPO_ROOT / "tests" / "finetune")]  # support, this
    config_file.write_text(  # this file's tiny sweep, as a config file for main.py
        f"import sys\nsys.path[:0] = {tests!r}\n"
        "import pathlib\nfrom test_finetune_sweep import tiny_sweep\n\n\n"
        "def get_config():\n"
        f"    return tiny_sweep(pathlib.Path({str(tmp_path)!r}), "
        f"{tiny_tokenizer.model_path!r}, num_epochs=20)\n")
    cmd = [sys.executable, "main.py", f"--config={config_file}",
           f"--workdir={tmp_path / 'sweep'}", "--config.train.log_every=1"]
    first = tmp_path / "sweep" / "runs" / "lr0.001_bs16_ep20_wu0.1" / "seed_1"
    step = preempt_main(cmd, first / "metrics.jsonl", cwd=REPO_ROOT)
    assert (first / "checkpoints" / str(step)).is_dir() and step < 60
    assert not (tmp_path / "sweep" / "sweep.json").exists()
    assert not (tmp_path / "sweep" / "runs" / "lr0.001_bs16_ep20_wu0.1" / "seed_2").exists()
    subprocess.run(cmd, cwd=REPO_ROOT, env=subprocess_env(), check=True, capture_output=True,
                   timeout=HANG_SECONDS)
    resumed = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert [row["setting"] for row in resumed["settings"]] == [
        "lr0.001_bs16_ep20_wu0.1", "lr0.003_bs16_ep20_wu0.1"]
    # The stopped run against the same run never stopped (the others ran once anyway).
    c = tiny_sweep(tmp_path, tiny_tokenizer.model_path, num_epochs=20)
    c.train.log_every, c.grid.learning_rate, c.grid.seeds = 1, (1e-3,), (1,)
    whole = sweep.run_sweep(c, str(tmp_path / "whole"))
    assert resumed["settings"][0]["per_seed"]["1"] == pytest.approx(
        whole["settings"][0]["per_seed"]["1"], abs=1e-6)
