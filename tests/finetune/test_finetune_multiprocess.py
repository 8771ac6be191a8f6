"""Fine-tuning as one job of two processes (jax.distributed on localhost, 4 CPU devices
each) on one 8-device mesh, as pretraining runs: the dev scores and train losses of a
single 8-device process, the files written once, and a run stopped in one process that
two processes finish."""

import json
import subprocess
import sys

import jax
import pytest

from maelm_jax.finetune import train

from conftest import HANG_SECONDS, REPO_ROOT, subprocess_env
from support import (
    FINETUNE_TINY,
    assert_close,
    finetune_flags,
    free_port,
    log_tail,
    tiny_finetuning,
    write_sst2,
)

# End-to-end (left out of the fast inner loop, pytest -m "not slow"), on 8 devices.
pytestmark = [pytest.mark.tier("slow"),
              pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (CPU) devices")]

# 48 train examples = 6 steps of 8 per epoch, two epochs, evaluated every 3 steps; every
# mesh axis of size 2, so parameters, moments and batches are split across the processes.
RUN = {"train.num_epochs": 2, "train.evals_per_epoch": 2, "train.log_every": 2,
       "train.checkpoint_every": 0, "train.select": "best", "mesh.shape": (2, 2, 2)}


@pytest.fixture(scope="module")
def settings(tmp_path_factory, tiny_tokenizer):
    glue = tmp_path_factory.mktemp("glue")
    (glue / "SST-2").mkdir()
    write_sst2(glue / "SST-2", 48, 0)
    write_sst2(glue / "SST-2", 16, 1)
    test_rows = [f"{i}\tthe film was {w} and long" for i, w in enumerate(["good", "dull"] * 5)]
    (glue / "SST-2" / "test.tsv").write_text("\n".join(["index\tsentence", *test_rows]) + "\n")
    return {**FINETUNE_TINY, **RUN, "tokenizer_path": tiny_tokenizer.model_path,
            "data.data_dir": str(glue), "predict_test": True}


@pytest.fixture(scope="module")
def single(settings, tmp_path_factory):
    """The run in this process, on its 8 devices."""
    workdir = tmp_path_factory.mktemp("single")
    return train.run(tiny_finetuning(settings), str(workdir)), _metrics(workdir)


def _metrics(workdir) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]



def _two_processes(settings, workdir) -> list[str]:
    """main.py as processes 0 and 1 of one job; returns their logs."""
    cmd = [sys.executable, "main.py", "--config=configs/finetune/glue.py:sst2",
           *finetune_flags(settings), f"--workdir={workdir}",
           f"--coordinator_address=127.0.0.1:{free_port()}", "--num_processes=2"]
    procs = [subprocess.Popen(cmd + [f"--process_id={i}"], cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=subprocess_env(4))
             for i in range(2)]
    logs = [p.communicate(timeout=HANG_SECONDS)[0] for p in procs]
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log_tail(log)
    assert "process 1 of 2" in logs[1]
    return logs


def _assert_same_run(workdir, single):
    """What the run computes equals the single process's within float rounding (other
    compiled programs); the metrics hold each line once (process 0 alone writes them)."""
    expected, expected_metrics = single
    results = json.loads((workdir / "results.json").read_text())
    for key in ("dev", "best", "final", "evals"):
        assert_close(results[key], expected[key], key, atol=1e-5)
    metrics = _metrics(workdir)
    for record in metrics + expected_metrics:
        record.pop("examples_per_sec", None)
    assert_close(metrics, expected_metrics, "metrics", atol=1e-5)
    # Finished: the final checkpoint alone (no resume state left beside it).
    assert [p.name for p in (workdir / "checkpoints").iterdir()] == [str(results["dev"]["step"])]
    assert (workdir / "checkpoints" / str(results["dev"]["step"]) / "state").is_dir()
    assert (workdir / "encoder.json").is_file() and (workdir / "tokenizer.model").is_file()


def test_two_processes_fine_tune_as_one(settings, single, tmp_path):
    workdir = tmp_path / "multi"
    logs = _two_processes(settings, workdir)
    _assert_same_run(workdir, single)
    assert "[dev] step" in logs[0] and "[dev] step" not in logs[1]
    rows = (workdir / "predictions" / "SST-2.tsv").read_text().splitlines()
    assert len(rows) == 11 and rows[0].split("\t") == ["index", "prediction"]


class Interrupt(Exception):
    pass


def test_a_run_stopped_in_one_process_is_finished_by_two(settings, single, tmp_path,
                                                         monkeypatch):
    """Resume checkpoints of an 8-device process (steps 3 and 6; the best evaluation's
    parameters among them) restore into the shardings of the two-process mesh."""
    real = train.train_batches

    def stop_at_step_8(*args):
        for step, item in enumerate(real(*args), start=args[-1] + 1):
            if step == 8:
                raise Interrupt
            yield item

    monkeypatch.setattr(train, "train_batches", stop_at_step_8)
    workdir = tmp_path / "stopped"
    with pytest.raises(Interrupt):
        train.run(tiny_finetuning(settings), str(workdir))
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["3", "6"]
    logs = _two_processes(settings, workdir)
    assert f"resumed from checkpoint at step 6 ({workdir}/checkpoints/6)" in logs[0]
    _assert_same_run(workdir, single)


def test_a_sweep_runs_as_one_job_of_two_processes(settings, tmp_path):
    """Each run of the grid is a two-process run, seeds 1 and 2 as one program (a seed
    group, its state and batches split over both processes' devices) and seed 3 alone;
    process 0 alone writes the sweep's files, and the same command again reuses every
    finished run."""
    sweep = {"sweep": True, "grid.num_epochs": (1,), "grid.learning_rate": (1e-3,),
             "grid.batch_size": (8,), "grid.seeds": (1, 2, 3), "grid.seeds_per_program": 2}
    workdir = tmp_path / "sweep"
    logs = _two_processes({**settings, **sweep}, workdir)
    summary = json.loads((workdir / "sweep.json").read_text())
    assert list(summary["settings"][0]["per_seed"]) == ["1", "2", "3"]
    assert sorted(p.name for p in (workdir / "runs").iterdir()) == [
        summary["settings"][0]["setting"]]
    runs = workdir / "runs" / summary["settings"][0]["setting"]
    assert sorted(p.name for p in runs.iterdir()) == ["seed_1", "seed_2", "seed_3", "seeds_1_2"]
    group_metrics = _metrics(runs / "seeds_1_2")
    assert len(group_metrics) == len({(r["split"], r["step"]) for r in group_metrics})
    assert "sweep: reusing" not in logs[0]
    again = _two_processes({**settings, **sweep}, workdir)
    assert all(log.count("sweep: reusing") == 3 for log in again)
    assert json.loads((workdir / "sweep.json").read_text())["score"] == summary["score"]
