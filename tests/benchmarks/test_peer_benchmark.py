"""Smoke tests: benchmarks/peer_hf.py runs end to end at tiny sizes, as a script."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HANG_SECONDS, subprocess_env

# End-to-end: left out of the fast inner loop (pytest -m "not slow").
pytestmark = pytest.mark.tier("slow")

REPO = Path(__file__).resolve().parents[2]
# peer.py's option sets the encoder's depth and the decoder's (max(1, 1 // 3) = 1); the
# overrides shrink both stacks' width.
TINY = [f"--config={REPO / 'configs' / 'benchmark' / 'peer.py'}:layers=1",
        "--config.model.d_model=32", "--config.model.num_heads=2", "--config.model.d_ff=64",
        "--config.model.decoder.d_model=32", "--config.model.decoder.num_heads=2",
        "--config.model.decoder.d_ff=64", "--config.tokenizer.vocab_size=128",
        "--config.data.seq_len=16", "--config.train.batch_size=2", "--steps=1", "--repeats=1"]


def run_script(*flags: str, pythonpath: str = "") -> subprocess.CompletedProcess:
    env = dict(subprocess_env(), JAX_PLATFORMS="cpu")  # subprocess_env compiles fast
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env["PYTHONPATH"]
    # Run from outside the repository: the installed packages (maelm_jax, benchmarks) are
    # all its imports need.
    return subprocess.run(
        # No record unless a test asks for one (in its own directory, never the repository's).
        [sys.executable, str(REPO / "benchmarks" / "peer_hf.py"), *TINY, "--record_dir=",
         *flags],
        cwd=REPO.parent, env=env, capture_output=True, text=True, timeout=HANG_SECONDS, check=False)


def run_ok(*flags: str) -> list[str]:
    result = run_script(*flags)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert any(line.startswith("fp32 jitted 2048x2048 matmul: ") and "GFLOP/s" in line
               for line in lines), result.stdout
    assert any("XLA" in line and "CPUs" in line for line in lines), result.stdout
    assert any(line.startswith("encoder 1 x 32 (2 heads, FFN 64), MAE-LM decoder 1 x 32,")
               and "L=16" in line and "batch=2" in line for line in lines), result.stdout
    for side in ("mlm", "maelm"):
        assert any(line.startswith(f"{side} ") for line in lines), result.stdout
    return lines


def test_peer_script_runs_without_peer():
    lines = run_ok("--peer=none")
    assert "peer: skipped (--peer=none)" in lines
    assert not any(line.startswith(("peer ", "mlm / peer")) for line in lines)


def test_peer_script_runs_with_hf(tmp_path):
    pytest.importorskip("torch", reason="torch is optional: pip install -r requirements-bench.txt")
    pytest.importorskip("transformers",
                        reason="transformers is optional: pip install -r requirements-bench.txt")
    lines = run_ok("--peer=hf", "--threads=1", f"--record_dir={tmp_path}")
    assert any(line.startswith("torch ") and "get_num_threads() = 1" in line for line in lines)
    assert any(line.startswith("peer ") for line in lines), lines
    for side, target in (("mlm", "1.5x"), ("maelm", "1.2x")):
        ratio = [line for line in lines if line.startswith(f"{side} / peer: ")]
        assert len(ratio) == 1 and f"target >= {target}" in ratio[0], lines
        assert ratio[0].endswith(("meets)", "misses)")), ratio
    [path] = (tmp_path / "peer").glob("*.json")
    record = json.loads(path.read_text())
    assert record["peer"].startswith("peer")
    assert set(record["ratios"]) == {"mlm", "maelm"} and record["sizes"]["seq_len"] == 16
    ratio = [line for line in lines if line.startswith("mlm / peer: ")][0]
    assert ratio.startswith(f"mlm / peer: {record['ratios']['mlm']['ratio']:.2f}x")


def test_peer_script_says_what_to_install(tmp_path):
    # A torch that fails to import, as where it is not installed.
    (tmp_path / "torch.py").write_text("raise ImportError(\"No module named 'torch'\")\n")
    result = run_script("--peer=hf", pythonpath=str(tmp_path))
    assert result.returncode != 0
    assert "pip install -r requirements-bench.txt" in result.stderr.splitlines()[-1]
    assert "Traceback" not in result.stderr


def test_round_ratios_pair_the_sides_round_by_round():
    from maelm_jax.infra import timer

    # Two rounds of three steps; the machine is twice as slow in the second round, for
    # both sides alike, and the odd step out in each round does not move the median.
    peer = [3.0, 3.0, 9.0, 6.0, 6.0, 6.0]
    ours = [2.0, 1.0, 2.0, 4.0, 4.0, 40.0]
    assert timer.round_ratios(peer, ours, 3) == [1.5, 1.5]
    # The ratio of overall medians mixes rounds: 6.0 / 3.0 = 2.0.
    assert timer.round_ratios(peer, ours[:4], 3) == [1.5]  # only complete rounds


@pytest.mark.tier("integration")  # imports PyTorch and transformers
def test_the_equal_work_peer_computes_the_stock_peers_loss():
    """The peer at our work (its LM head and loss at the masked positions only) gives the
    stock RobertaForMaskedLM's loss on the same batch and weights, without dropout."""
    pytest.importorskip("torch", reason="torch is optional: pip install -r requirements-bench.txt")
    pytest.importorskip("transformers",
                        reason="transformers is optional: pip install -r requirements-bench.txt")
    import numpy as np

    from benchmarks import harness, roberta_peer
    from configs.benchmark import peer

    c = harness.objective_config(peer.get_config("layers=1"), "mlm")
    c.model.d_model, c.model.num_heads, c.model.d_ff = 32, 2, 64
    c.model.dropout = c.model.attention_dropout = 0.0
    c.tokenizer.vocab_size, c.data.seq_len = 128, 16
    tokens = np.random.default_rng(0).integers(5, 128, (4, 16))
    stock = roberta_peer.PeerBench(c, tokens, "cpu", compiled=False)
    equal = roberta_peer.PeerBench(c, tokens, "cpu", compiled=False, masked_head=True)
    assert equal.name == "peer (masked head)"
    ids, labels = stock.mask()
    assert 0 < int((labels != -100).sum()) < labels.numel()
    # The same initial weights (torch.manual_seed(0) in each).
    a, b = float(stock.loss(ids, labels)), float(equal.loss(ids, labels))
    assert abs(a - b) <= 1e-5 * abs(a) and a > 1.0
