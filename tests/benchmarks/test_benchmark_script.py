"""benchmarks/step_time.py as a script: it runs end to end at tiny sizes given as
--config.<field>=<value> overrides, and a bad flag is one line on stderr and exit 1; the
benchmarks' default config files hold the sizes their docstrings give."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from maelm_jax.config import variants
from maelm_jax.pretrain import config as pretrain_config

from conftest import HANG_SECONDS, subprocess_env

# End-to-end: left out of the fast inner loop (pytest -m "not slow").
pytestmark = pytest.mark.tier("slow")

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs" / "benchmark"
# The encoder only: MLM and 3ML (whose decoder the benchmark derives) never build the
# config's 4 x 768 MAE-LM decoder.
TINY = ["--config.model.num_layers=1", "--config.model.d_model=64",
        "--config.model.num_heads=2", "--config.model.d_ff=256", "--config.data.seq_len=32",
        "--config.train.batch_size=2", "--config.tokenizer.vocab_size=128"]


def run_script(*flags: str) -> subprocess.CompletedProcess:
    env = dict(subprocess_env(), JAX_PLATFORMS="cpu")
    # Run from outside the repository: the installed packages (maelm_jax, benchmarks) are
    # all its imports need, and its default config is found from the package.
    return subprocess.run(
        # No record unless a test asks for one (in its own directory, never the repository's).
        [sys.executable, str(REPO / "benchmarks" / "step_time.py"), "--record_dir=", *flags],
        cwd=REPO.parent, env=env, capture_output=True, text=True, timeout=HANG_SECONDS, check=False)


def test_step_time_script_runs_tiny(tmp_path):
    result = run_script(*TINY, "--steps=2", "--warmup=0", "--repeats=1",
                        "--objectives=3ml_cross",  # mlm always runs; the others build alike
                        f"--record_dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert any(line.startswith("encoder 1 x 64 (2 heads, FFN 256)") and "L=32" in line
               and "batch=2" in line and "|V|=128" in line for line in lines), result.stdout
    assert any(line.startswith("mlm ") for line in lines), result.stdout
    assert not any(line.startswith(("maelm ", "3ml_self ")) for line in lines)  # not asked for
    for objective in ("3ml_cross",):
        assert any(line.startswith(f"{objective} ") for line in lines), result.stdout
        ratio = [line for line in lines if line.startswith(f"{objective} / mlm ratio")]
        assert len(ratio) == 1 and "FLOPs" in ratio[0] and "relative difference" in ratio[0]
    # Its record, as printed, for the generated tables.
    [path] = (tmp_path / "step_time").glob("*.json")
    record = json.loads(path.read_text())
    assert record["sizes"]["d_model"] == 64 and record["sizes"]["batch_size"] == 2
    assert set(record["objectives"]) == {"mlm", "3ml_cross"} and set(record["ratios"]) == {
        "3ml_cross"}
    shown = f"time {record['ratios']['3ml_cross']['time']:.3f}, FLOPs"
    assert shown in ratio[0] and record["machine"]["matmul_gflops"] > 0


def test_compile_time_script_records_each_depth_and_layout(tmp_path):
    env = dict(subprocess_env(), JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "compile_time.py"), "--depths=1,2",
         "--objective=mlm", *TINY, f"--record_dir={tmp_path}"],
        cwd=REPO.parent, env=env, capture_output=True, text=True, timeout=HANG_SECONDS,
        check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    [path] = (tmp_path / "compile_time").glob("*.json")
    record = json.loads(path.read_text())
    assert record["objective"] == "mlm" and record["sizes"]["d_model"] == 64
    assert {layout: sorted(by_depth) for layout, by_depth in record["seconds"].items()} == {
        "per_layer": ["1", "2"], "scanned": ["1", "2"]}
    ratio = record["seconds"]["scanned"]["2"] / record["seconds"]["scanned"]["1"]
    assert f"scanned: 2 layers / 1 layers = {ratio:.2f}x" in result.stdout


@pytest.mark.parametrize("flag, message", [
    ("--config.model.num_layerz=1",
     "--config.model.num_layerz: config.model has no field 'num_layerz'; did you mean "
     "config.model.num_layers?"),
    ("--objectives=mlm,nope", "unknown nope; expected some of mlm, maelm"),
    (f"--config={CONFIGS / 'nope.py'}", "nope.py does not exist"),
    ("--config.model.num_heads=5", "config.model.d_model: expected a multiple of"),
])
def test_step_time_script_bad_flag_is_one_line(flag, message):
    result = run_script(flag)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr
    assert result.stderr.startswith("step_time.py: ") and message in result.stderr, \
        result.stderr


def shape(stack) -> tuple[int, int, int, int]:
    return stack.num_layers, stack.d_model, stack.num_heads, stack.d_ff


def sizes(c) -> tuple[int, int, int]:
    return c.data.seq_len, c.train.batch_size, c.tokenizer.vocab_size


def test_benchmark_configs_hold_the_documented_sizes():
    step = variants.load(str(CONFIGS / "step_time.py"))
    peer = variants.load(str(CONFIGS / "peer.py"))
    compile_time = variants.load(str(CONFIGS / "compile_time.py"))
    for c in (step, peer, compile_time):
        pretrain_config.validate(c)
    assert shape(step.model) == shape(step.model.decoder) == (4, 768, 12, 3072)
    assert sizes(step) == (128, 8, 32768) and step.model.dropout == 0.1
    assert (shape(peer.model), shape(peer.model.decoder)) == ((4, 256, 4, 1024),
                                                              (1, 256, 4, 1024))
    assert sizes(peer) == (128, 32, 8000) and peer.model.decoder.dropout == 0.0
    assert shape(compile_time.model) == shape(compile_time.model.decoder) == (2, 128, 2, 512)
    assert sizes(compile_time) == (64, 4, 1024)
    # peer.py's option sets the encoder's depth and the decoder's, max(1, layers // 3).
    for layers, decoder_layers in ((12, 4), (2, 1)):
        c = variants.load(f"{CONFIGS / 'peer.py'}:layers={layers}")
        assert (c.model.num_layers, c.model.decoder.num_layers) == (layers, decoder_layers)


def test_peer_base_variant_is_bert_base_and_iterates_at_fewer_layers():
    base = variants.load(f"{CONFIGS / 'peer.py'}:base")
    pretrain_config.validate(base)
    assert (shape(base.model), shape(base.model.decoder)) == ((12, 768, 12, 3072),
                                                              (4, 768, 12, 3072))
    assert sizes(base) == (512, 32, 32768) and base.model.scan_layers
    assert base.model.dropout == base.model.attention_dropout == 0.1
    two = variants.load(f"{CONFIGS / 'peer.py'}:base,layers=2")
    assert (two.model.num_layers, two.model.decoder.num_layers, two.model.d_model) == (2, 1, 768)


def test_compile_cache_script_measures_cold_and_cached():
    env = dict(subprocess_env(), JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "compile_cache.py"),
         "--config.model.num_layers=1", "--config.data.seq_len=16", "--steps=1"],
        cwd=REPO.parent, env=env, capture_output=True, text=True, timeout=HANG_SECONDS,
        check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("(defaults)")]
    assert len(rows) == 1 and len(rows[0]) == 5
    cold, cached = float(rows[0][1]), float(rows[0][2])
    assert cold >= 0 and cached >= 0  # printed rounded: a fast machine's may read 0


def test_gpu_suite_runs_tiny_and_writes_its_results(tmp_path):
    """benchmarks/gpu_suite.py on this CPU at tiny sizes: the attention checks and one
    variant of the sweep, the train steps of MLM and MAE-LM with the einsum and the
    (interpreted) Pallas attention, and the three compile processes, written as JSON and a
    markdown table; a part cut off by the budget is recorded as skipped."""
    out = tmp_path / "suite"
    tiny = TINY + [
        "--config.model.decoder.num_layers=1", "--config.model.decoder.d_model=64",
        "--config.model.decoder.num_heads=2", "--config.model.decoder.d_ff=128"]
    env = dict(subprocess_env(), JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_suite.py"), f"--out={out}",
         f"--record_dir={tmp_path / 'records'}",
         "--parts=attention,throughput,profile,compile", "--sweep=none", "--peer=none",
         "--impls=einsum,pallas", "--objectives=maelm", "--steps=1", "--repeats=1",
         "--attention_repeats=1", "--profile_steps=1",
         "--profile_sides=mlm/einsum,maelm/einsum:model.rel_pos_buckets=0", *tiny],
        cwd=REPO.parent, env=env, capture_output=True,
        text=True, timeout=HANG_SECONDS, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((out / "gpu_suite.json").read_text())
    attention = record["parts"]["attention"]
    assert all(c["ok"] for c in attention["checks"]) and len(attention["checks"]) == 9
    assert attention["variants"][0]["ok"] and attention["fastest"] is not None
    sides = record["parts"]["throughput"]["sides"]
    assert set(sides) == {f"{o} / {i}" for o in ("mlm", "maelm") for i in ("einsum", "pallas")}
    for name, side in sides.items():
        assert side["ms"] > 0 and side["tokens_per_s"] > 0, name
    assert sides["maelm / pallas"]["flops_ratio_to_mlm"] > 1
    assert sides["maelm / pallas"]["time_ratio_to_mlm"] > 0
    profile = record["parts"]["profile"]["sides"]
    assert list(profile) == ["mlm/einsum", "maelm/einsum:model.rel_pos_buckets=0"]
    for name, side in profile.items():
        assert side["step_ms"] > 0 and side["ops"], name
        assert all(o["ms_per_step"] >= 0 and not o["op"].startswith("$") for o in side["ops"])
        assert abs(sum(o["share"] for o in side["ops"]) - 1) < 1e-6
    hlo = (out / "profile" / "maelm_einsum_model.rel_pos_buckets_0.hlo.txt").read_text()
    assert "HloModule" in hlo and "rel_embedding" not in hlo  # the bias is gone
    assert "rel_embedding" in (out / "profile" / "mlm_einsum.hlo.txt").read_text()
    compile_record = record["parts"]["compile"]
    assert all(compile_record[c]["compile_s"] > 0 for c in ("cold", "cached", "new_program"))
    table = (out / "gpu_suite.md").read_text()
    for heading in ("## Attention", "## Train step", "## Profile", "## Compile",
                    "| maelm / pallas |", "**maelm/einsum:model.rel_pos_buckets=0**"):
        assert heading in table
    # Its record, with the machine, renders as the docs' table of the suite.
    from benchmarks import tables

    [saved] = (tmp_path / "records" / "gpu_suite").glob("*.json")
    assert json.loads(saved.read_text())["machine"]["platform"] == "cpu"
    rendered = tables.render("gpu_suite", tmp_path / "records")
    assert rendered.startswith("Measured ") and "(1 run(s) recorded)" in rendered
    assert "## Train step" in rendered and "| maelm / pallas |" in rendered

    skipped = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_suite.py"), f"--out={out}",
         "--record_dir=", "--parts=quickstart", "--budget_seconds=10", *tiny],
        cwd=REPO.parent, env=env,
        capture_output=True, text=True, timeout=HANG_SECONDS, check=False)
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    record = json.loads((out / "gpu_suite.json").read_text())
    assert record["parts"] == {"quickstart": {"skipped": "budget: 10 s left"}}

    # A part whose time would run out builds no side it could not time: MLM is built and
    # timed, MAE-LM recorded as not built (a reserve of 148 s of the part's 150).
    cut = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_suite.py"), f"--out={out}",
         "--record_dir=", "--parts=throughput", "--peer=none", "--impls=einsum",
         "--objectives=maelm", "--steps=1", "--repeats=1", "--budget_seconds=150",
         "--timing_reserve_seconds=148", *tiny],
        cwd=REPO.parent, env=env, capture_output=True, text=True, timeout=HANG_SECONDS,
        check=False)
    assert cut.returncode == 0, cut.stderr[-3000:]
    sides = json.loads((out / "gpu_suite.json").read_text())["parts"]["throughput"]["sides"]
    assert sides["mlm / einsum"]["ms"] > 0
    assert sides["maelm / einsum"]["skipped"].endswith("s left to build and time it")
    assert "| maelm / einsum | | | not built: " in (out / "gpu_suite.md").read_text()


def test_tpu_suite_runs_tiny_with_the_tpu_kernels(tmp_path):
    """benchmarks/tpu_suite.py on this CPU at tiny sizes: part 1 checks the TPU kernels
    (interpreted here) against einsum, part 2 times the train step with einsum and Pallas,
    written to tpu_suite.json and tpu_suite.md; its TPU sweep names TPU tiles."""
    out = tmp_path / "suite"
    env = dict(subprocess_env(), JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "tpu_suite.py"), f"--out={out}",
         f"--record_dir={tmp_path / 'records'}", "--parts=attention,throughput", "--sweep=none",
         "--objectives=mlm", "--steps=1", "--repeats=1", "--attention_repeats=1", *TINY],
        cwd=REPO.parent, env=env, capture_output=True, text=True, timeout=HANG_SECONDS,
        check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((out / "tpu_suite.json").read_text())
    assert record["command"].startswith("python benchmarks/tpu_suite.py")
    attention = record["parts"]["attention"]
    assert all(c["ok"] for c in attention["checks"]) and len(attention["checks"]) == 9
    sides = record["parts"]["throughput"]["sides"]
    assert set(sides) == {"mlm / einsum", "mlm / pallas"} and record["parts"]["throughput"][
        "peer"] is None
    assert (out / "tpu_suite.md").read_text().startswith("# TPU suite")
    assert len(list((tmp_path / "records" / "tpu_suite").glob("*.json"))) == 1
    from benchmarks import attention as attention_bench

    tpu_variants = attention_bench.sweep_variants("quick", "tpu")
    assert tpu_variants and all(set(v) <= {"tpu_forward", "tpu_dkv", "tpu_dq", "hash_elements"}
                                for v in tpu_variants)


def test_the_sweep_combines_options_only_where_the_combination_gets_faster():
    """attention.combine_greedily on made-up timings: options that each beat the defaults
    join the fastest one, best first, only while the checked and timed combination gets
    faster; one that slows it down (they interact on a GPU) is left out."""
    from benchmarks import attention

    ms = {(): 10.0, (("bias_grad", "rows"),): 8.0, (("forward", "64x64:4:3"),): 9.0,
          (("hash_elements", 4),): 9.5, (("dq", "64x64:4:3"),): 11.0,
          (("bias_grad", "rows"), ("forward", "64x64:4:3")): 7.0,
          (("bias_grad", "rows"), ("forward", "64x64:4:3"), ("hash_elements", 4)): 7.5}
    tried = []

    def try_variant(changes):
        tried.append(changes)
        key = tuple(sorted(changes.items()))
        return {"changes": changes, "ok": True, "ms": ms[key]}

    singles = [try_variant(dict(k)) for k in ms if len(k) < 2]
    tried.clear()
    combined = attention.combine_greedily(singles, try_variant)
    assert tried == [{"bias_grad": "rows", "forward": "64x64:4:3"},
                     {"bias_grad": "rows", "forward": "64x64:4:3", "hash_elements": 4}]
    assert min(combined, key=lambda v: v["ms"])["changes"] == {
        "bias_grad": "rows", "forward": "64x64:4:3"}
    # A combination that fails its checks is not built on.
    ms[(("bias_grad", "rows"), ("forward", "64x64:4:3"))] = 6.0
    ms[(("bias_grad", "rows"), ("hash_elements", 4))] = 7.9

    def failing(changes):
        record = try_variant(changes)
        return {**record, "ok": "forward" not in changes}

    tried.clear()
    attention.combine_greedily(singles, failing)
    assert tried[-1] == {"bias_grad": "rows", "hash_elements": 4}
    assert attention.combine_greedily(singles[:1], try_variant) == []  # nothing to combine


def _write_trace(directory: Path, events: list[dict]) -> Path:
    import gzip

    path = directory / "plugins" / "profile" / "run" / "perfetto_trace.json.gz"
    path.parent.mkdir(parents=True)
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    return directory


def test_trace_op_seconds_reads_the_device_ops_line_or_the_cpu_op_threads(tmp_path):
    """harness.trace_op_seconds on made-up perfetto traces: on a GPU the "XLA Ops" line of
    the device process (not its streams' kernels, which repeat the ops, nor the host);
    on a CPU the op threads, not Python's thread nor the runtime's functions."""
    from benchmarks import harness

    def meta(kind, pid, name, tid=None):
        return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": {"name": name}}

    def op(name, pid, tid, dur):
        return {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": 0, "dur": dur}

    gpu = _write_trace(tmp_path / "gpu", [
        meta("process_name", 1, "/host:CPU"), meta("thread_name", 1, "python", 10),
        meta("process_name", 2, "/device:GPU:0"), meta("thread_name", 2, "XLA Ops", 20),
        meta("thread_name", 2, "Stream #13", 21),
        op("$main.py:1 <module>", 1, 10, 9000), op("PjitFunction(step)", 1, 10, 8000),
        op("loop_scatter_fusion", 2, 20, 3000), op("loop_scatter_fusion", 2, 20, 1000),
        op("gemm_fusion.2", 2, 20, 500), op("triton_gemm_kernel", 2, 21, 700)])
    assert harness.trace_op_seconds(gpu) == pytest.approx(
        {"loop_scatter_fusion": 4e-3, "gemm_fusion.2": 5e-4})
    cpu = _write_trace(tmp_path / "cpu", [
        meta("process_name", 1, "/host:CPU"), meta("thread_name", 1, "python", 10),
        op("$profiler.py:307 trace", 1, 10, 900), op("PjitFunction(step)", 1, 10, 800),
        op("ynn_fusion.1", 1, 11, 300), op("SlinkyThreadPool::Await", 1, 11, 50),
        op("end: ynn_fusion.1", 1, 11, 5), op("dot.3", 1, 12, 200), op("MutexLock", 1, 13, 70),
        meta("process_name", 3, "/device:CUSTOM:Megascale Trace")])
    assert harness.trace_op_seconds(cpu) == pytest.approx({"ynn_fusion.1": 3e-4, "dot.3": 2e-4})
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no perfetto_trace"):
        harness.trace_op_seconds(tmp_path / "empty")


def test_gpu_suite_bad_profile_side_is_one_line(tmp_path):
    env = dict(subprocess_env(), JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_suite.py"), f"--out={tmp_path / 's'}",
         "--parts=profile", "--profile_sides=mlm/einsum:model.nope=1"], cwd=REPO.parent,
        env=env, capture_output=True, text=True, timeout=HANG_SECONDS, check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "gpu_suite.py: --profile_sides: 'mlm/einsum:model.nope=1': no config field "
        "'model.nope'")
    assert not (tmp_path / "s").exists()


def test_finetune_seeds_script_times_runs_alone_and_grouped(tmp_path):
    """benchmarks/finetune_seeds.py at the study's tiny preset: both sides timed, the
    speedups and the per-run cost printed and recorded; a bad flag is one line."""
    env = dict(subprocess_env(), JAX_PLATFORMS="cpu")
    script = str(REPO / "benchmarks" / "finetune_seeds.py")
    tiny = f"--config={REPO / 'configs' / 'study' / 'gpu.py'}:tiny"
    result = subprocess.run(
        [sys.executable, script, tiny, "--steps=2", "--repeats=1", "--eval_examples=8",
         f"--record_dir={tmp_path}"],
        cwd=REPO.parent, env=env, capture_output=True, text=True, timeout=HANG_SECONDS,
        check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "GFLOP/s" in out and "a group of 3 runs" in out
    rows = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in out.splitlines()
            if line.startswith(("alone ", "group "))}
    # Printed with two decimals, a figure of a fast machine may read 0.00: only the
    # record's unrounded figures must be positive (no test depends on the machine's speed).
    assert set(rows) == {"alone", "group"} and all(v >= 0 for r in rows.values() for v in r)
    # Per run, a group's step costs its step over the runs.
    assert rows["group"][1] == pytest.approx(rows["group"][0] / 3, abs=0.01)
    assert "speedup per run: train steps" in out and "one run of 4 steps" in out
    [path] = (tmp_path / "finetune_seeds").glob("*.json")
    record = json.loads(path.read_text())
    assert record["runs"] == 3 and record["step_ms"]["alone"] == pytest.approx(
        rows["alone"][0], abs=0.01)
    assert all(v > 0 for v in record["step_ms"].values())
    for flag, named in (("--runs=1", "--runs"),
                        ("--config.finetune.batch_size=0", "config.finetune.batch_size")):
        bad = subprocess.run([sys.executable, script, tiny, flag, "--record_dir="],
                             cwd=REPO.parent, env=env,
                             capture_output=True, text=True, timeout=HANG_SECONDS, check=False)
        assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        assert named in bad.stderr


def test_finetune_parts_script_times_a_task_per_model_and_as_one_program(tmp_path,
                                                                        tiny_tokenizer):
    """benchmarks/finetune_parts.py at one_call,tiny: MLM, MAE-LM and the control with five
    seeds, three parts per model against one program; both timed and recorded; a bad flag
    is one line."""
    from support import write_sst2

    glue = tmp_path / "glue" / "SST-2"
    glue.mkdir(parents=True)
    write_sst2(glue, 24, 0)
    write_sst2(glue, 16, 1)
    env = dict(subprocess_env(), JAX_PLATFORMS="cpu")
    script = str(REPO / "benchmarks" / "finetune_parts.py")
    config = f"--config={REPO / 'configs' / 'study' / 'gpu.py'}:one_call,tiny"
    base = [sys.executable, script, config, f"--config.glue_dir={tmp_path / 'glue'}"]
    result = subprocess.run(
        [*base, f"--tokenizer={tiny_tokenizer.model_path}", "--repeats=1",
         f"--record_dir={tmp_path}"],
        cwd=REPO.parent, env=env, capture_output=True, text=True, timeout=HANG_SECONDS,
        check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {" ".join(line.split()[:2]): [float(x) for x in line.split()[2:]]
            for line in result.stdout.splitlines() if line.startswith(("per model", "one program"))}
    assert rows["per model"][:2] == [3, 5] and rows["one program"][:2] == [1, 15]
    assert all(v >= 0 for r in rows.values() for v in r[2:])  # rounded: 0 on a fast machine
    [path] = (tmp_path / "finetune_parts").glob("*.json")
    record = json.loads(path.read_text())
    assert record["models"] == ["mlm", "maelm", "scratch"]
    assert record["sides"]["per model"]["host_seconds"] == pytest.approx(
        3 * record["sides"]["per model"]["part_seconds"])
    bad = subprocess.run([*base, "--tokenizer=", "--record_dir="], cwd=REPO.parent, env=env,
                         capture_output=True, text=True, timeout=HANG_SECONDS, check=False)
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "--tokenizer" in bad.stderr
