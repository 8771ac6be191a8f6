"""benchmarks/gpu_probe.py, the prepared GPU call, runs end to end on a CPU at a tiny size
(kernels interpreted): every section's sides built and timed, every line written and
flushed as it is measured, what does not fit the budget skipped with a line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HANG_SECONDS, subprocess_env

pytestmark = pytest.mark.tier("integration")  # each test names its own where it differs

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_probe.py"
TINY = [f"--config={REPO / 'configs' / 'benchmark' / 'peer.py'}:layers=1",
        "--config.model.d_model=32", "--config.model.num_heads=2", "--config.model.d_ff=64",
        "--config.model.decoder.d_model=32", "--config.model.decoder.num_heads=2",
        "--config.model.decoder.d_ff=64", "--config.tokenizer.vocab_size=128",
        "--config.data.seq_len=32", "--config.train.batch_size=2", "--steps=1", "--repeats=1",
        "--profile_steps=1"]


def probe(out: Path, *flags: str) -> list[dict]:
    done = subprocess.run([sys.executable, str(SCRIPT), f"--out={out}", *TINY, *flags],
                          cwd=REPO.parent, env=dict(subprocess_env(), JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=HANG_SECONDS, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (out / "gpu_probe.jsonl").read_text().splitlines()]


@pytest.mark.tier("slow")
def test_the_probe_measures_every_side_at_a_tiny_size(tmp_path):
    from benchmarks import gpu_probe

    lines = probe(tmp_path)
    by = {(x["section"], x["name"]): x for x in lines if "flag_set" not in x}
    machine = lines[0]
    assert machine["section"] == "machine" and machine["jax"] and machine["commit"]
    assert by[("matmul", "fp32 jitted 2048x2048 matmul")]["tflops"] > 0
    for objective in ("mlm", "maelm"):
        step = by[("step", f"{objective} default")]
        assert step["ms"] > 0 and step["mfu"] > 0 and step["flops_count"] == "3 x forward"
    profile = by[("profile", "mlm default")]
    assert profile["ops_ms"] > 0 and "gaps_ms" in profile and profile["ms_per_class"]
    attention = {name: x for (section, name), x in by.items() if section == "attention"}
    assert attention["cuDNN"]["skipped"] == "not on a GPU"
    for name in ("ours, bias and dropout", "ours, no bias", "ours, no dropout",
                 "ours, no bias, no dropout",
                 "ours, MAE-LM's per-example bias", "jax's Pallas mha (no bias, no dropout)",
                 *(f"ours, {c}" for c in gpu_probe.KERNEL_CANDIDATES)):
        assert attention[name]["forward_backward_ms"] > 0, attention[name]
    assert attention["ours, MAE-LM's per-example bias"]["shape"][1] < 32  # n_enc
    for name in gpu_probe.VARIANTS:
        assert by[("variants", name)]["speedup_over_default"] > 0, by[("variants", name)]
    if ("peer", "peer") in by:  # with requirements-bench.txt
        assert by[("peer", "peer (masked head)")]["ours_speedup"] > 0
    else:
        assert "requirements-bench.txt" in by[("peer", "RobertaForMaskedLM")]["skipped"]
    [flag_set] = gpu_probe.XLA_FLAG_SETS["cpu"]
    assert by[("xla_flags", flag_set)]["returncode"] == 0
    child = [x for x in lines if x.get("flag_set") == flag_set and x["section"] == "step"]
    assert {x["name"] for x in child} == {"mlm default", "maelm default"}
    assert lines[-1]["section"] == "done"


def test_what_does_not_fit_the_budget_is_skipped_with_a_line(tmp_path):
    lines = probe(tmp_path, "--budget_seconds=1", "--sections=step,attention")
    skipped = {x["name"] for x in lines if "skipped" in x}
    assert {"mlm default", "maelm default", "ours, bias and dropout"} <= skipped
    assert lines[-1]["section"] == "done"


@pytest.mark.tier("unit")
def test_the_profile_classes_a_compiled_steps_ops():
    from benchmarks import gpu_probe

    hlo = "\n".join([
        '  %custom-call.3 = (bf16[2]) custom-call(%p), custom_call_target="__gpu$xla.gpu.triton", '
        'backend_config={"name":"flash_attention_dkv"}',
        '  %custom-call.4 = bf16[2] custom-call(%p), custom_call_target="__cublas$lt$matmul"',
        '  %fusion.7 = f32[2] fusion(%p), kind=kLoop, calls=%fc, '
        'metadata={op_name="jit(step)/optimizer/mul"}',
        '  ROOT %fusion.8 = f32[2] fusion(%p), kind=kLoop, calls=%fc2',
        '  %custom-call.9 = bf16[2] custom-call(%p), custom_call_target="__cudnn$fmhaSoftmax"',
        '  %copy.1 = f32[2] copy(%p)'])
    assert gpu_probe.op_classes(hlo) == {
        "custom-call.3": "attention:flash_attention_dkv", "custom-call.4": "gemm",
        "fusion.7": "optimizer", "fusion.8": "fusion", "custom-call.9": "attention:cudnn",
        "copy.1": "other"}


@pytest.mark.tier("unit")
def test_a_bad_section_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), f"--out={tmp_path}", "--sections=stepz"],
                          cwd=REPO.parent, env=dict(subprocess_env(), JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=HANG_SECONDS, check=False)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    last = done.stderr.splitlines()[-1]
    assert "--sections" in last and "unknown stepz; expected some of matmul, step" in last


@pytest.mark.tier("unit")
def test_an_unwritable_out_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    done = subprocess.run([sys.executable, str(SCRIPT), f"--out={tmp_path / 'file' / 'out'}",
                           "--sections=matmul"], cwd=REPO.parent,
                          env=dict(subprocess_env(), JAX_PLATFORMS="cpu"), capture_output=True,
                          text=True, timeout=HANG_SECONDS, check=False)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "--out: cannot write" in done.stderr.splitlines()[-1]
