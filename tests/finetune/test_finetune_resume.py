"""An interrupted fine-tuning run continues from its last resume checkpoint and ends
exactly where an uninterrupted run ends: the same dev scores, metrics.jsonl lines and
selected parameters. Interrupted in-process (an exception, SIGTERM) and for real (main.py
killed with SIGKILL, or after its final checkpoint); a finished run is found, a changed
config refused, a workdir of the older layout converted.
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

from maelm_jax import runs
from maelm_jax.finetune import tasks, train
from maelm_jax.training import preemption
from maelm_jax.workdirs import layout

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

pytestmark = pytest.mark.tier("integration")


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
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


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
    # Finished: the resume states are gone, the final checkpoint alone stays.
    final = json.loads((workdir / "results.json").read_text())["dev"]["step"]
    assert [p.name for p in (workdir / "checkpoints").iterdir()] == [str(final)]
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



def test_a_finish_cut_short_resumes_and_an_older_layout_is_converted_in_one_command(
        sst2_settings, tmp_path, monkeypatch):
    """checkpoints/ is the one place: a run killed after its final checkpoint but before
    results.json continues from its resume states (the half-finished final removed) and
    ends as an uninterrupted run; an unfinished run of the older layout (resume/) is
    refused in one line naming the command that converts it, and after that command it
    continues; an unfinished run is no init_from."""
    scores, batches = Scripted(monkeypatch, SCORES), train.train_batches
    c = tiny_finetuning(sst2_settings, **RUN)
    train.run(c, str(tmp_path / "whole"))
    whole = _outcome(tmp_path / "whole")

    scores.calls, workdir, real = 0, tmp_path / "cut", train.results_record

    def killed_after_the_final_checkpoint(*args, **kwargs):
        raise Interrupt

    monkeypatch.setattr(train, "results_record", killed_after_the_final_checkpoint)
    with pytest.raises(Interrupt):
        train.run(c, str(workdir))
    monkeypatch.setattr(train, "results_record", real)
    # The final checkpoint (step 3's selected parameters) beside the last two resume
    # states (6 and 9); no results.
    assert _resume_steps(workdir) == [3, 6, 9] and not (workdir / "results.json").exists()
    assert [(workdir / "checkpoints" / str(step) / "meta").exists()
            for step in (3, 6, 9)] == [False, True, True]
    starts = []
    interrupt_batches(monkeypatch, starts)
    scores.calls = 3  # steps 3, 6 and 9 were evaluated before the state of step 9
    train.run(c, str(workdir))
    assert starts == [9]  # from the newest resume state, not the final checkpoint
    results, metrics, params = _outcome(workdir)
    assert (results, metrics) == whole[:2]
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(params), _leaves(whole[2]),
                                                    strict=True))

    scores.calls, old, starts = 0, tmp_path / "old", []
    monkeypatch.setattr(train, "train_batches", batches)
    interrupt_batches(monkeypatch, starts, 9, "raise")
    with pytest.raises(Interrupt):
        train.run(c, str(old))
    with pytest.raises(runs.CheckpointError, match=(
            rf"^config.init_from: {old} is an unfinished fine-tuning run \(no results.json\); "
            r"run its command again to finish it first$")):
        runs.resolve_checkpoint(str(old))
    (old / "checkpoints").rename(old / "resume")  # as the older version left it
    before = snapshot(old)
    with pytest.raises(layout.WorkdirError) as refused:
        train.run(c, str(old))
    assert str(refused.value) == (
        f"{old}/resume: resume checkpoints in an older layout; move them where runs keep "
        f"them now (mv {old}/resume {old}/checkpoints) and run again")
    assert snapshot(old) == before
    subprocess.run(str(refused.value).split("(", 1)[1].split(")")[0], shell=True, check=True)
    scores.calls = 2
    train.run(c, str(old))
    assert starts == [0, 6] and _outcome(old)[:2] == whole[:2]

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
    while not ((killed / "checkpoints").is_dir() and _resume_steps(killed)):
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
    assert re.search(rf"resumed from checkpoint at step \d+ \({killed}/checkpoints/\d+\)",
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
