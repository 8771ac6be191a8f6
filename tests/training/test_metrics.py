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
