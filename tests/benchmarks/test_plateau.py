"""benchmarks/plateau.py trains the variants of docs/plateau.md's table through main.py and
records each evaluation; an unknown variant is refused in one line."""

import subprocess
import sys

import pytest

from benchmarks import plateau, tables
from maelm_jax.infra import records

from conftest import REPO_ROOT

# End-to-end: main.py in subprocesses.
pytestmark = pytest.mark.tier("slow")

# The two variants with the most overrides: each must be a valid config.
CHECKED = ["mlm_normal_pre_ln", "maelm_paper_decoder"]


def test_the_variants_are_trained_and_recorded(tmp_path):
    assert set(CHECKED) <= set(plateau.VARIANTS)
    done = subprocess.run([sys.executable, "benchmarks/plateau.py", "--steps=6",
                           "--eval_every=3", f"--variants={','.join(CHECKED)}",
                           f"--record_dir={tmp_path}"], cwd=REPO_ROOT, capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    [record] = records.read("plateau", tmp_path)
    assert [v["key"] for v in record["variants"]] == CHECKED
    for v in record["variants"]:
        assert [e["step"] for e in v["evals"]] == [3, 6]
        assert all(0 <= e["accuracy"] <= 1 and e["loss"] > 0 for e in v["evals"])
        assert v["seconds"] > 0
    assert "--config.model.pre_ln=true" in record["variants"][0]["overrides"]
    table = tables.render("plateau", tmp_path)
    assert f"| {plateau.VARIANTS[CHECKED[1]][0]} | " in table and "6 steps each" in table


def test_an_unknown_variant_is_refused_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, "benchmarks/plateau.py", "--variants=nope",
                           f"--record_dir={tmp_path}"], cwd=REPO_ROOT, capture_output=True,
                          text=True, check=False)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith(
        "plateau.py: flag --variants=['nope']: unknown nope; expected some of mlm_normal, ")
    assert not (tmp_path / "plateau").exists()
