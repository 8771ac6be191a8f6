"""benchmarks/laptop_study.py runs the study as docs/results.md gives it and records it
with the docs' paths, never this machine's; bad data directories and a used workdir are
refused in one line before anything runs."""

import json
import subprocess
import sys

import pytest

from benchmarks import tables
from maelm_jax.infra import records

from conftest import REPO_ROOT

# End-to-end: main.py in a subprocess.
pytestmark = pytest.mark.tier("slow")

SCRIPT = [sys.executable, "benchmarks/laptop_study.py"]
# A study of one model, a few steps, one seed, one task (the mini study's own sizes).
SHORT = ["--config.models=mlm", "--config.pretrain.train.num_steps=10",
         "--config.pretrain.train.eval_every=10", "--config.pretrain.train.checkpoint_every=10",
         "--config.seeds=(1,)", "--config.tasks=('SST-2',)",
         "--config.finetune.min_train_examples=40", "--config.finetune.num_epochs=1"]


def _write_sst2(root):
    rows = ["sentence\tlabel"] + [f"the film is {'good' if i % 2 else 'bad'} {i}\t{i % 2}"
                                  for i in range(48)]
    (root / "SST-2").mkdir(parents=True)
    for split in ("train", "dev"):
        (root / "SST-2" / f"{split}.tsv").write_text("\n".join(rows) + "\n")


def _run(*args):
    return subprocess.run([*SCRIPT, *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          check=False)


def test_the_study_is_recorded_in_the_docs_paths(tmp_path):
    glue = tmp_path / "my_glue"
    _write_sst2(glue)
    workdir = tmp_path / "kept"
    done = _run(f"--glue_dir={glue}", f"--workdir={workdir}", f"--record_dir={tmp_path / 'rec'}",
                "--", *SHORT)
    assert done.returncode == 0, done.stderr[-3000:]
    [record] = records.read("laptop_study", tmp_path / "rec")
    assert str(tmp_path) not in json.dumps(record)  # no path of this machine
    assert record["command"].startswith(
        "python main.py --config=configs/study/mini.py --workdir=runs/study "
        "--config.glue_dir=/data/my_glue --config.models=mlm")
    assert record["data"] == {"glue": {"name": "my_glue"}}
    study = record["study"]
    assert study["finished"] and study["models"] == ["mlm"] and study["controls"] == ["scratch"]
    assert study["pretraining"]["mlm"]["workdir"] == "runs/study/pretrain/mlm"
    assert set(study["glue"]["mlm"]) == {"SST-2"}
    assert record["seconds"] > 0 and record["peak_gb"] > 0.1
    assert (workdir / "study.md").is_file()  # --workdir keeps the study and its plots
    text = tables.render("laptop_study", tmp_path / "rec")
    assert "pretrained on the built-in corpus, fine-tuned on the GLUE copy `my_glue`" in text
    [mlm] = [line for line in text.splitlines() if line.startswith("| MLM |")]
    assert f"{study['glue']['mlm']['SST-2']['median']:.1f}" in mlm


@pytest.mark.parametrize("args, line", [
    (["--glue_dir={tmp}/absent"], "laptop_study.py: --glue_dir: {tmp}/absent is not a directory"),
    (["--corpus={tmp}/absent"], "laptop_study.py: --corpus: {tmp}/absent is not a directory"),
    (["--workdir={tmp}"], "laptop_study.py: --workdir: {tmp} exists; a recorded study starts "
                          "in a new directory"),
])
def test_bad_directories_are_refused_in_one_line(tmp_path, args, line):
    done = _run(*[a.format(tmp=tmp_path) for a in args], f"--record_dir={tmp_path / 'rec'}")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == line.format(tmp=tmp_path)
    assert not (tmp_path / "rec").exists()
