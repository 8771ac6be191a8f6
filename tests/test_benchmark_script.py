"""Smoke test: benchmarks/step_time.py runs end to end at tiny sizes, as a script."""

import subprocess
import sys
from pathlib import Path

from conftest import subprocess_env

REPO = Path(__file__).resolve().parents[1]


def test_step_time_script_runs_tiny():
    env = dict(subprocess_env(), JAX_PLATFORMS="cpu")
    # Run from outside the repository: the script must make its own imports work.
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "step_time.py"),
         "--encoder_layers=1", "--d_model=64", "--num_heads=2", "--seq_len=32",
         "--batch_size=2", "--decoder_layers=1", "--decoder_d_model=32",
         "--vocab_size=128", "--steps=2", "--warmup=0", "--repeats=1",
         "--objectives=3ml_cross"],  # mlm always runs; maelm and 3ml_self build alike
        cwd=REPO.parent, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert any(line.startswith("mlm ") for line in lines), result.stdout
    assert not any(line.startswith(("maelm ", "3ml_self ")) for line in lines)  # not asked for
    for objective in ("3ml_cross",):
        assert any(line.startswith(f"{objective} ") for line in lines), result.stdout
        ratio = [line for line in lines if line.startswith(f"{objective} / mlm ratio")]
        assert len(ratio) == 1 and "FLOPs" in ratio[0] and "relative difference" in ratio[0]
