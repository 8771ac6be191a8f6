"""Records of measurements (maelm_jax/infra/records.py), the benchmarks' and the study's alike: the
commit marks a tree that differs from it, a record is written with its machine and read
back oldest first, and every machine a record holds is named the same way."""

import subprocess

import pytest

from maelm_jax.infra import records

pytestmark = pytest.mark.tier("unit")

MACHINE = {"device": "cpu", "devices": 1, "platform": "cpu", "cores": 2, "jax": "0.10.2",
           "commit": "0123456789abcdef", "matmul": "fp32 jitted 2048x2048 matmul",
           "matmul_gflops": 150.0}


def test_the_commit_marks_a_tree_that_differs_from_it(tmp_path, monkeypatch):
    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              cwd=tmp_path, capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-q", "-m", "a")
    head = git("rev-parse", "HEAD").strip()
    monkeypatch.setattr(records, "_PACKAGE_DIR", tmp_path)
    monkeypatch.delenv("MAELM_JAX_COMMIT", raising=False)
    (tmp_path / "new.txt").write_text("untracked: not a change of the tree\n")
    assert records.commit() == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert records.commit() == head + "+changes"
    monkeypatch.setattr(records.subprocess, "run", _no_git)
    assert records.commit() == "unknown"


def _no_git(*args, **kwargs):
    raise FileNotFoundError("git")


def test_a_record_is_written_with_its_machine_and_read_back_oldest_first(tmp_path):
    first = records.write("bench", {"ms": 1.0}, tmp_path, MACHINE)
    second = records.write("bench", {"ms": 2.0}, tmp_path, MACHINE)  # within the second
    assert first.parent == tmp_path / "bench" and first.name.endswith("_cpu_01234567.json")
    assert second != first and second.exists()
    found = records.read("bench", tmp_path)
    assert [r["ms"] for r in found] == [1.0, 2.0]
    assert found[0]["benchmark"] == "bench" and found[0]["machine"] == MACHINE
    assert records.read("nothing", tmp_path) == []


def test_every_machine_is_named_alike():
    assert records.describe(MACHINE) == "cpu, 2 cores, 150 GFLOP/s, jax 0.10.2"
    gpus = {**MACHINE, "device": "NVIDIA H100", "devices": 8, "platform": "gpu",
            "matmul_gflops": 672627.1}
    assert records.describe(gpus) == "8 x NVIDIA H100, 672,627 GFLOP/s, jax 0.10.2"
    # The study's first calls: the count in "device", no platform, no matmul.
    assert records.describe({"device": "1 x NVIDIA H200", "jax": "0.11.2"}) == (
        "1 x NVIDIA H200, jax 0.11.2")
