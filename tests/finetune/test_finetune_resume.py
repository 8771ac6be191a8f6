"""An interrupted fine-tuning run continues from its last resume checkpoint and ends
exactly where an uninterrupted run ends: the same dev scores, metrics.jsonl lines and
selected parameters. Interrupted in-process (an exception, SIGTERM) and for real (main.py
killed with SIGKILL); a finished run is found, a changed config refused.
"""

import json
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from maelm_jax import layout
from maelm_jax.finetune import tasks, train
from maelm_jax.training import preemption

from conftest import HANG_SECONDS, REPO_ROOT, subprocess_env
from support import (
    Interrupt,
    assert_close,
    finetune_flags,
    interrupt_batches,
    snapshot,
    tiny_finetuning,
    write_sst2,
)


def _outcome(workdir):
    """What must not depend on interruptions: results.json (without the wall time and the
    file paths), metrics.jsonl (without examples/s) and the selected parameters."""
    results = json.loads((workdir / "results.json").read_text())
    metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    for record in metrics:
        record.pop("examples_per_sec", None)
    state = ocp.PyTreeCheckpointer().restore(
        workdir / "checkpoints" / str(results["dev"]["step"]) / "state")
    for key in ("wall_seconds", "files"):
        results.pop(key)
    return results, metrics, state["params"]


def _resume_steps(workdir):
    return sorted(int(p.name) for p in (workdir / "resume").iterdir() if p.name.isdigit())


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


class Scripted:
    """Replaces GLUE's primary dev score with scripted values, one per evaluation, so the
    best evaluation is known (`calls`: the evaluations already made by this run)."""

    def __init__(self, monkeypatch, values):
        self.values, self.calls = values, 0
        real = tasks.GlueTask.score

        def score(task, run_eval):
            scores = real(task, run_eval)
            scores[task.primary_metric] = self.values[self.calls]
            self.calls += 1
            return scores

        monkeypatch.setattr(tasks.GlueTask, "score", score)


# Two epochs of 6 steps, evaluated every 3 (steps 3, 6, 9, 12), logged every 4; resume
# checkpoints at the evaluations but the last (3, 6, 9). The scripted best is step 3's.
RUN = {"train.num_epochs": 2, "train.evals_per_epoch": 2, "train.log_every": 4,
       "train.checkpoint_every": 0}
SCORES = [80.0, 60.0, 70.0, 65.0]


@pytest.mark.parametrize("select, how, at, saved, saves", [
    # resumes at 6; the best (step 3) params from the checkpoint
    ("best", "raise", 9, [3, 6], "evaluations"),
    ("final", "sigterm", 7, [6, 7], "evaluations"),  # SIGTERM during step 7 saves step 7
    # Saves only on a stop request: SIGTERM during step 7 saves step 7 alone, with the
    # best (step 3) params.
    ("best", "sigterm", 7, [7], "stop"),
])
def test_an_interrupted_run_resumes_exactly(sst2_settings, tmp_path, monkeypatch, select, how, at,
                                            saved, saves):
    scores = Scripted(monkeypatch, SCORES)
    c = tiny_finetuning(sst2_settings, **RUN, **{"train.select": select,
                                                 "train.resume_saves": saves})
    train.run(c, str(tmp_path / "whole"))
    whole = _outcome(tmp_path / "whole")
    assert whole[0]["dev"]["step"] == (3 if select == "best" else 12)

    starts, workdir = [], tmp_path / "interrupted"
    scores.calls = 0
    interrupt_batches(monkeypatch, starts, at, how)
    with pytest.raises(preemption.Preempted if how == "sigterm" else Interrupt):
        train.run(c, str(workdir))
    assert _resume_steps(workdir) == saved and not (workdir / "results.json").exists()
    scores.calls = 2  # steps 3 and 6 were evaluated before the interruption
    train.run(c, str(workdir))
    assert starts == [0, saved[-1]]
    assert not (workdir / "resume").exists()  # finished: nothing left to resume
    results, metrics, params = _outcome(workdir)
    assert results == whole[0]
    assert metrics == whole[1]  # no line twice, the train means over the interruption too
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(params), _leaves(whole[2]),
                                                    strict=True))


def test_a_finished_run_is_found_and_a_changed_config_refused(sst2_settings, tmp_path,
                                                             monkeypatch):
    """The lifecycle of every mode (training/lifecycle.py) in fine-tuning: an unfinished
    run of another config is refused, one line, the workdir untouched; the override starts
    it again; the same command then finds it finished (nothing trained), also with a
    harmless field changed."""
    starts, workdir = [], tmp_path / "run"
    interrupt_batches(monkeypatch, starts, 9, "raise")
    with pytest.raises(Interrupt):
        train.run(tiny_finetuning(sst2_settings, **RUN), str(workdir))
    assert _resume_steps(workdir) == [3, 6]
    before = snapshot(workdir)
    # Another learning rate: the unfinished run's checkpoints do not fit it.
    c = tiny_finetuning(sst2_settings, **RUN, **{"train.learning_rate": 3e-3})
    with pytest.raises(layout.WorkdirError, match=(
            r"^\S+ holds a run with a different config.train.learning_rate; use another "
            r"--workdir, or pass --allow_config_change to start it again with the new "
            r"config anyway$")):
        train.run(c, str(workdir))
    assert snapshot(workdir) == before and starts == [0]
    first = train.run(c, str(workdir), allow_config_change=True)
    assert starts == [0, 0]
    results = (workdir / "results.json").read_text()
    c.train.log_every = 5  # harmless: how often the run logged
    assert train.run(c, str(workdir)) == first  # found: nothing trained
    assert starts == [0, 0] and (workdir / "results.json").read_text() == results
    steps = [(r["split"], r["step"]) for r in map(
        json.loads, (workdir / "metrics.jsonl").read_text().splitlines())]
    assert len(steps) == len(set(steps)) == 3 + 4  # train at 4, 8, 12; dev at 3, 6, 9, 12


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_main_killed_or_preempted_continues_where_it_stopped(sst2_settings, tmp_path, how):
    """A real kill (SIGKILL) or preemption notice (SIGTERM): main.py fine-tunes 120 steps
    with resume checkpoints every 20 and gets the signal once the first one is complete;
    the same command finishes the run as if nothing had happened. SIGTERM: a checkpoint at
    the step it was on, exit status 143 and no results."""
    data = tmp_path / "glue" / "SST-2"
    write_sst2(data, 480, 0)  # 60 steps per epoch
    run = {"train.num_epochs": 2, "train.log_every": 10, "train.checkpoint_every": 20,
           "train.select": "final"}
    cmd = [sys.executable, "main.py", "--config=configs/finetune/glue.py:sst2",
           *finetune_flags(sst2_settings, **run)]
    killed, log = tmp_path / "killed", tmp_path / "killed.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(cmd + [f"--workdir={killed}"], cwd=REPO_ROOT,
                                env=subprocess_env(), stderr=stderr)
    deadline = time.monotonic() + HANG_SECONDS
    while not ((killed / "resume").is_dir() and _resume_steps(killed)):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.02)
    proc.send_signal(how)
    proc.wait()
    assert not (killed / "results.json").exists()  # stopped before the end
    if how == signal.SIGTERM:
        assert proc.returncode == 143, log.read_text()[-2000:]
        step = int(re.search(r"preempted: saved a checkpoint at step (\d+)",
                             log.read_text()).group(1))
        assert step in _resume_steps(killed)
    resumed = subprocess.run(cmd + [f"--workdir={killed}"], cwd=REPO_ROOT,
                             env=subprocess_env(), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert re.search(rf"resumed from checkpoint at step \d+ \({killed}/resume/\d+\)",
                     resumed.stderr)

    # In-process, uninterrupted.
    train.run(tiny_finetuning(sst2_settings, **run), str(tmp_path / "whole"))
    results, metrics, params = _outcome(killed)
    whole = _outcome(tmp_path / "whole")
    assert [e["step"] for e in results["evals"]] == [60, 120]
    # One device in the subprocess, eight in this one: equal to within float rounding.
    assert_close(results, whole[0])
    assert_close(metrics, whole[1])
    assert_close(_leaves(params), _leaves(whole[2]))
