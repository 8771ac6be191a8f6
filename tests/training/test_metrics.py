"""The metric sinks (maelm_jax/training/metrics.py): what a run writes reads back, and a
process that runs main.py imports no more than it needs at start-up (every run, test and
benchmark subprocess pays for what it imports)."""

import json
import struct
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, subprocess_env

pytestmark = pytest.mark.tier("unit")


def _records(path):
    """The payloads of a TFRecord file (length, its CRC, data, its CRC)."""
    data, at = path.read_bytes(), 0
    while at < len(data):
        (length,) = struct.unpack("<Q", data[at:at + 8])
        yield data[at + 12:at + 12 + length]
        at += 12 + length + 4


def test_scalars_read_back_from_the_jsonl_file_and_the_event_file(tmp_path):
    from tensorboardX.proto import event_pb2

    from maelm_jax.training import metrics

    writer = metrics.MetricWriter(tmp_path)
    writer.write("train", 3, {"loss": 1.5, "accuracy": 0.25})
    writer.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"split": "train", "step": 3, "loss": 1.5, "accuracy": 0.25}]
    [events] = (tmp_path / "tensorboard").iterdir()
    scalars = {}
    for payload in _records(events):
        event = event_pb2.Event.FromString(payload)
        for value in event.summary.value:
            scalars[(value.tag, event.step)] = value.simple_value
    assert scalars == {("train/loss", 3): 1.5, ("train/accuracy", 3): 0.25}


def test_main_imports_neither_pytorch_nor_scipy_stats():
    """tensorboardX would import PyTorch when it is installed and the GLUE metrics scipy's
    statistics: about three seconds of every main.py process, for neither's use."""
    code = ("import sys, main; from maelm_jax.training import metrics; "
            "print(sorted(m for m in ('torch', 'scipy.stats', 'google.cloud.storage') "
            "if sys.modules.get(m)))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=subprocess_env(),
                          capture_output=True, text=True, check=True)
    assert done.stdout.split("\n")[-2] == "[]", done.stdout


def test_a_process_that_has_pytorch_keeps_it():
    pytest.importorskip("torch", reason="PyTorch is not installed (requirements-hf.txt)")
    code = ("import torch, sys; from maelm_jax.training import metrics; "
            "import tensorboardX.x2num as x; print(sys.modules['torch'] is torch)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=subprocess_env(),
                          capture_output=True, text=True, check=True)
    assert done.stdout.split("\n")[-2] == "True", done.stdout


class _Recording:
    """A sink that records what it is given; `fails_at`: the step whose write raises."""

    def __init__(self, local, workdir, record, calls, fails_at=None):
        self.calls, self.fails_at = calls, fails_at

    def write(self, split, step, scalars):
        if step == self.fails_at:
            raise ConnectionError("the service went away\nsecond line")
        self.calls.append((split, step, scalars))

    def flush(self):
        pass

    def close(self):
        self.calls.append("closed")


def test_every_tracker_gets_the_same_scalars_and_one_that_fails_never_stops_the_run(
        tmp_path, monkeypatch, caplog):
    from maelm_jax.config import options
    from maelm_jax.training import metrics

    assert options.TRACKERS == tuple(metrics.TRACKERS)  # the config's names are the sinks'
    steady, failing = [], []
    monkeypatch.setattr(metrics, "TRACKERS", {
        "steady": (lambda *a: _Recording(*a, steady), None),
        "failing": (lambda *a: _Recording(*a, failing, fails_at=2), None)})
    writer = metrics.MetricWriter(tmp_path, trackers=("steady", "failing"))
    for step in (1, 2, 3):
        writer.write("train", step, {"loss": 1.0 / step})
    writer.write("eval", 3, {"loss": 0.5})
    writer.close()
    assert steady[:1] == failing[:1] == [("train", 1, {"loss": 1.0})]
    assert steady == [("train", 1, {"loss": 1.0}), ("train", 2, {"loss": 0.5}),
                      ("train", 3, {"loss": 1 / 3}), ("eval", 3, {"loss": 0.5}), "closed"]
    assert len(failing) == 1  # left out after its failure, never closed
    warned = [r.getMessage() for r in caplog.records if "tracker failing" in r.getMessage()]
    assert warned == ["tracker failing failed at step 2 (the service went away) and is left "
                      "out from here on; metrics.jsonl keeps every line"]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4


def test_a_tracker_that_cannot_start_or_is_not_installed_is_one_line(tmp_path, monkeypatch):
    from maelm_jax.pretrain import config as pretrain_config
    from maelm_jax.training import metrics

    from tiny_config import tiny_config

    def refuses(*args):
        raise PermissionError("api key rejected\ndetails")

    monkeypatch.setattr(metrics, "TRACKERS", {**metrics.TRACKERS, "wandb": (refuses, None)})
    with pytest.raises(metrics.TrackerError,
                       match=r"^config.train.trackers: wandb could not start: api key "
                             r"rejected$"):
        metrics.MetricWriter(tmp_path, trackers=("tensorboard", "wandb"))
    monkeypatch.undo()
    real = metrics.importlib.util.find_spec
    monkeypatch.setattr(metrics.importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    assert metrics.check_trackers("tensorboard") == ("tensorboard",)
    assert metrics.check_trackers("") == ()
    with pytest.raises(metrics.TrackerError) as info:
        metrics.check_trackers("tensorboard, wandb")
    assert str(info.value) == ("config.train.trackers: 'wandb' needs the wandb package, which "
                               "is not installed: pip install -r requirements-trackers.txt")
    c = tiny_config()
    c.train.trackers = "tensorboard,mlflow"
    with pytest.raises(pretrain_config.ConfigError,
                       match=r"^config.train.trackers: expected a comma-separated list of "
                             r"tensorboard, wandb \(or empty\), got 'tensorboard,mlflow'$"):
        pretrain_config.validate(c)


def test_wandb_offline_writes_its_run_and_a_resumed_run_continues_it(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (requirements-trackers.txt)")
    from maelm_jax.training import metrics

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    record = {"config": {"objective": "maelm", "train": {"num_steps": 4}},
              "data_fingerprint": "f00d"}
    writer = metrics.MetricWriter(tmp_path, trackers=("wandb",), record=record)
    run = writer._sinks["wandb"].run
    assert run.config["data_fingerprint"] == "f00d" and run.config["config"]["objective"] == \
        "maelm"
    for step in (1, 2):
        writer.write("train", step, {"loss": 3.0 - step})
    writer.close()
    kept = json.loads((tmp_path / "trackers" / "wandb_run.json").read_text())
    first = sorted((tmp_path / "trackers" / "wandb").glob(f"offline-run-*-{kept['id']}"))
    assert len(first) == 1 and (first[0] / f"run-{kept['id']}.wandb").stat().st_size > 0

    resumed = metrics.MetricWriter(tmp_path, resume_step=2, trackers=("wandb",), record=record)
    assert resumed._sinks["wandb"].run.id == kept["id"]
    resumed.write("train", 3, {"loss": 0.5})
    resumed.close()
    runs = list((tmp_path / "trackers" / "wandb").glob("offline-run-*"))
    assert {r.name.rsplit("-", 1)[1] for r in runs} == {kept["id"]}
    assert json.loads((tmp_path / "trackers" / "wandb_run.json").read_text()) == kept
