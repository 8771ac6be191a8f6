"""benchmarks/step_matmuls.py: the dots it reads from a compiled module, and a tiny run."""

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from benchmarks import step_matmuls

from conftest import HANG_SECONDS, subprocess_env

# End-to-end: left out of the fast inner loop (pytest -m "not slow").
pytestmark = pytest.mark.tier("slow")

REPO = Path(__file__).resolve().parents[2]


def test_step_dots_reads_every_dot_of_a_compiled_gradient():
    def loss(w, x, k):
        h = jnp.tanh(x @ w)  # [8, 16, 6]
        scores = jnp.einsum("bqd,bkd->bqk", h, k)  # batched, like attention
        return (scores ** 2).sum()

    args = (jnp.ones((4, 6)), jnp.ones((8, 16, 4)), jnp.ones((8, 5, 6)))
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile().as_text()
    dots, where, _ = step_matmuls.step_dots(text)
    # Forward: x @ w and the scores; backward: the scores' gradient into h, and h's
    # gradient into w and into x (the scores' gradient into k is not asked for).
    assert sum(dots.values()) == 5, dots
    forward = 2 * 8 * 16 * 4 * 6 + 2 * 8 * 16 * 5 * 6
    backward = 2 * 8 * 16 * 5 * 6 + 2 * (2 * 8 * 16 * 4 * 6)
    assert sum(d.flops * n for d, n in dots.items()) == forward + backward
    places = [place for counter in where.values() for place in counter]
    assert {place.split()[0] for place in places} == {"fwd", "bwd"}
    rng = np.random.default_rng(0)
    for dot in dots:
        a, b = rng.normal(size=dot.lhs), rng.normal(size=dot.rhs)
        numbers = ((dot.lhs_contract, dot.rhs_contract), (dot.lhs_batch, dot.rhs_batch))
        np.testing.assert_allclose(np.einsum(dot.einsum(), a, b),
                                   lax.dot_general(a, b, numbers), rtol=1e-4, atol=1e-4)


def test_step_matmuls_script_runs_tiny():
    pytest.importorskip("torch", reason="torch is optional: pip install -r requirements-bench.txt")
    tiny = [f"--config={REPO / 'configs' / 'benchmark' / 'peer.py'}:layers=1",
            "--config.model.d_model=32", "--config.model.num_heads=2",
            "--config.model.d_ff=64", "--config.tokenizer.vocab_size=128",
            "--config.data.seq_len=16", "--config.train.batch_size=2", "--repeats=1",
            "--threads=1"]
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "step_matmuls.py"), *tiny],
        cwd=REPO.parent, env=dict(subprocess_env(), JAX_PLATFORMS="cpu"),
        capture_output=True, text=True, timeout=HANG_SECONDS, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert any(line.startswith("mlm train step: ") for line in lines), lines
    summary = [line for line in lines if line.startswith("per step, ")]
    assert len(summary) == 1 and "XLA" in summary[0] and "PyTorch" in summary[0], lines
    assert any("fwd layer_N/mlp/wi" in line for line in lines), lines
