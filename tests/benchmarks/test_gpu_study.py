"""benchmarks/gpu_study.sh brings a call's record back however the call ends: finished, at
the study's time limit, killed by the outer timeout, or the script itself told to stop. A
lent machine's command is cut at 10 minutes and only OUT comes back (8 files), so a record
copied only after a clean exit is lost exactly when it matters: the small files come back in
one archive, beside the packed encoders. main.py is a stub here (a fake
`python3` on PATH that writes what the study writes and ends as told), .device/setup.sh a
one-liner: each case takes about a second."""

import json
import os
import signal
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.tier("integration")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_study.sh"

# The study as the script sees it: writes its outputs into --workdir, then ends as
# $FAKE_END says: "exit N", or "hang" (until SIGTERM, which takes the study's stop path:
# study.json written, status 143).
STUB = r"""#!/usr/bin/env bash
for a in "$@"; do case $a in --workdir=*) w=${a#--workdir=} ;; esac; done
mkdir -p "$w"
printf '%s\n' "$@" > "$w/args.txt"
for i in $(seq 1000); do echo "log line $i"; done
stop() { echo '{"finished": false, "stopped": "SIGTERM"}' > "$w/study.json"; exit 143; }
trap stop TERM
echo "# study" > "$w/study.md"
echo '{"steps": {"mlm": 50}}' > "$w/sizing.json"
printf 'PNG' > "$w/loss_curves.png"
printf 'PNG' > "$w/rank_layers.png"
mkdir -p "$w/encoders" && printf 'NPZ' > "$w/encoders/mlm.npz"
case $FAKE_END in
  exit*) echo '{"finished": true}' > "$w/study.json"; exit ${FAKE_END#exit } ;;
  hang) touch "$w/started"; sleep 30 & wait ;;
esac
"""


@pytest.fixture
def machine(tmp_path):
    """A project root with .device/ staged, the data directories and the stub on PATH."""
    root = tmp_path / "root"
    (root / ".device").mkdir(parents=True)
    (root / ".device" / "setup.sh").write_text("echo 'data: wiki_large wiki glue'\n")
    data = tmp_path / "data"
    for d in ("wiki_large", "wiki", "glue", "study_tokenizer"):
        (data / d).mkdir(parents=True)
    (data / "study_tokenizer" / "tokenizer.model").write_text("pieces")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(STUB)
    (bin_dir / "python3").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", STUDY_DATA_DIR=str(data),
               STUDY_WORKDIR=str(tmp_path / "work"), STUDY_STOP_GRACE="5")
    return root, env, tmp_path / "out", tmp_path / "work"


def _run(machine, end: str, *args: str, preset: str = "one_call",
         **env) -> subprocess.CompletedProcess:
    root, base, out, _ = machine
    return subprocess.run([str(SCRIPT), str(out), preset, *args], cwd=root,
                          env=dict(base, FAKE_END=end, **env), capture_output=True, text=True,
                          timeout=60, check=False)


def _records(out: Path) -> Path:
    """records.tar.gz of OUT, extracted beside OUT."""
    where = out.parent / "records"
    with tarfile.open(out / "records.tar.gz") as archive:
        archive.extractall(where, filter="data")
    return where


def _brought_back(out: Path, status: int) -> dict:
    """OUT holds the archive of the record, the plots, the log's tail and call.json, and
    the packed encoder; returns call.json."""
    assert {p.name for p in out.iterdir()} == {"records.tar.gz", "encoder_mlm.npz"}
    records = _records(out)
    assert {p.name for p in records.iterdir()} == {
        "study.json", "study.md", "sizing.json", "loss_curves.png", "rank_layers.png",
        "study.log", "call.json"}
    log = (records / "study.log").read_text().splitlines()
    assert len(log) == 400 and log[-1].startswith("gpu_study.sh: ")  # the tail, its verdict
    call = json.loads((records / "call.json").read_text())
    assert call["exit_status"] == status and call["preset"] == "one_call"
    assert 0 <= call["setup_seconds"] < 30 and 0 <= call["main_seconds"] < 30
    return call


@pytest.mark.parametrize("status", [0, 75])
def test_a_finished_or_time_limited_call_comes_back(machine, status):
    result = _run(machine, f"exit {status}")
    assert result.returncode == status, result.stderr
    call = _brought_back(machine[2], status)
    assert call["minutes"] == 9 and call["timeout_seconds"] == 9 * 60 + 20
    assert json.loads((machine[2].parent / "records" / "study.json").read_text()) == {
        "finished": True}
    args = (machine[3] / "args.txt").read_text().splitlines()
    data = machine[1]["STUDY_DATA_DIR"]
    assert "--time_limit_minutes=9" in args and f"--config.glue_dir={data}/glue" in args
    assert f"--config.pretrain.tokenizer.model_path={data}/study_tokenizer/tokenizer.model" in args


def test_a_mechanism_call_reads_no_glue(machine):
    result = _run(machine, "exit 0", preset="mechanism")
    assert result.returncode == 0, result.stderr
    args = (machine[3] / "args.txt").read_text().splitlines()
    assert "--config=configs/study/gpu.py:mechanism" in args
    assert not any(a.startswith("--config.glue_dir") for a in args)


def test_the_outer_timeout_stops_the_study_and_its_record_still_comes_back(machine):
    started = time.monotonic()
    result = _run(machine, "hang", "0.01", STUDY_TIMEOUT_MARGIN="0.4")  # 1 s in all
    assert result.returncode == 124, result.stderr
    assert time.monotonic() - started < 15
    call = _brought_back(machine[2], 124)
    assert "killed by the outer timeout" in call["outcome"] and call["minutes"] == 0.01
    # What the study wrote on its way out (its SIGTERM path) is what came back.
    assert json.loads((machine[2].parent / "records" / "study.json").read_text())[
        "stopped"] == "SIGTERM"


def test_the_script_told_to_stop_passes_it_on_and_brings_back_the_record(machine):
    root, env, out, work = machine
    proc = subprocess.Popen([str(SCRIPT), str(out), "one_call"], cwd=root,
                            env=dict(env, FAKE_END="hang"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not (work / "started").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 143
    call = _brought_back(out, 143)
    assert call["outcome"] == "preempted (SIGTERM to gpu_study.sh)"
    assert json.loads((out.parent / "records" / "study.json").read_text())["stopped"] == (
        "SIGTERM")


def test_an_error_before_the_study_still_writes_call_json(machine):
    root, env, out, _ = machine
    (root / ".device" / "setup.sh").unlink()
    result = _run(machine, "exit 0")
    assert result.returncode == 1 and ".device/ is not staged" in result.stderr
    call = json.loads((_records(out) / "call.json").read_text())
    assert call["exit_status"] == 1 and call["main_seconds"] is None
    assert ".device/ is not staged" in call["outcome"]
    (root / ".device" / "setup.sh").write_text("true\n")
    result = _run(machine, "exit 0", "nine")
    assert result.returncode == 1 and "MINUTES must be a number" in result.stderr
    assert json.loads((_records(out) / "call.json").read_text())["minutes"] is None
