"""scripts/plan_memory.py as a user runs it: main.py's --config flags, from any directory,
one-line errors."""

import subprocess
import sys

import pytest

from conftest import HANG_SECONDS, REPO_ROOT, subprocess_env

# End-to-end: left out of the fast inner loop (pytest -m "not slow").
pytestmark = pytest.mark.tier("slow")

TINY = str(REPO_ROOT / "tests" / "tiny_config.py")


def plan_memory(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    # From outside the repository: the installed package, not the current directory, makes
    # the imports work.
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "plan_memory.py"), *flags],
        cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=HANG_SECONDS)


def test_plan_memory_takes_config_overrides(tmp_path):
    result = plan_memory(tmp_path, f"--config={TINY}", "--config.mesh.shape=(2,1,1)",
                         "--config.train.batch_size=4", "--remat_policies=none,full")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "batch 4 " in out and "mesh {'data': 2, 'fsdp': 1, 'tensor': 1} = 2 devices" in out
    assert "remat_policy=none:" in out and "remat_policy=full:" in out
    assert out.count("activations + temporaries") == 2


def test_plan_memory_compiles_for_a_tpu_slice(tmp_path):
    """XLA:TPU's own figures for a v5e-8 (compile-only devices), set against its HBM."""
    pytest.importorskip("libtpu", reason="libtpu is not installed (requirements-tpu-check.txt)")
    result = plan_memory(tmp_path, f"--config={TINY}", "--topology=v5e:2x4",
                         "--config.mesh.shape=(2,4,1)", "--config.train.batch_size=16")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "8 devices on v5e:2x4 x 1 slices (TPU v5 lite)" in out, out
    assert "compute bfloat16" in out  # "auto" as a TPU resolves it
    assert "HBM per device               16.02 GiB" in out
    assert ("remat_policy=auto (dots_attention), 2 sequences per device per micro-batch: "
            "fits:") in out


@pytest.mark.parametrize("flags, message", [
    (["--config.model.num_layerz=1"], "--config.model.num_layerz: config.model has no field "
                                      "'num_layerz'; did you mean config.model.num_layers?"),
    (["--config.model.dropout=3"], "config.model.dropout: expected a number in [0, 1)"),
    (["--config=nope.py"], "nope.py does not exist"),
    (["--remat_policies=dots,most"], "--remat_policies=dots,most: unknown most; expected "
                                       "some of all, none"),
    (["--config.mesh.shape=(-1,1,1)"], "config.mesh.shape has a -1; give --devices"),
    (["stray"], "unexpected arguments: stray"),
    (["--fit"], "--fit: needs --topology"),
    (["--topology=v9:2x2"], "--topology: expected <generation>:<chips per axis>"),
    (["--devices=-2"], "--devices=-2"),
    (["--num_slices=0"], "--num_slices=0"),
])
def test_plan_memory_bad_flags_are_one_line(tmp_path, flags, message):
    if not any(f.startswith("--config=") for f in flags):
        flags = [f"--config={TINY}", "--config.mesh.shape=(2,1,1)", *flags]
    result = plan_memory(tmp_path, "--no_compile", *flags)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("plan_memory.py: ") and message in lines[0], \
        result.stderr


@pytest.mark.parametrize("name", ["fill_mask.py", "analysis/rank.py", "benchmark/step_time.py",
                                  "benchmark/compile_time.py"])
def test_config_files_without_variants_refuse_one(name):
    from maelm_jax.config import variants

    path = str(REPO_ROOT / "configs" / name)
    variants.load(path)
    with pytest.raises(variants.VariantError, match="'oops': this file offers no variants"):
        variants.load(path + ":oops")


def test_study_tokenizer_trains_the_pieces_a_study_is_then_given(tmp_path):
    from support import made_up_documents

    for name, part in (("large", slice(0, None, 2)), ("wiki", slice(1, None, 2))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "wiki_00").write_text("".join(
            f'<doc id="{i}" url="u" title="T{i}">\nT{i}\n{text}\n</doc>\n'
            for i, text in enumerate(made_up_documents(200)[part])))
    command = [sys.executable, str(REPO_ROOT / "scripts" / "study_tokenizer.py"),
               f"--config={REPO_ROOT / 'configs' / 'study' / 'gpu.py'}:one_call,tiny",
               f"--config.pretrain.data.sources.large.path={tmp_path / 'large'}",
               f"--config.pretrain.data.sources.wiki.path={tmp_path / 'wiki'}"]
    result = subprocess.run(command + [f"--out={tmp_path / 'tok'}"], cwd=tmp_path,
                            env=subprocess_env(), capture_output=True, text=True,
                            timeout=HANG_SECONDS)
    assert result.returncode == 0, result.stderr[-3000:]
    model = tmp_path / "tok" / "tokenizer.model"
    assert result.stdout.startswith(f"{model} (512 pieces) sha256 ")
    missing = subprocess.run(command, cwd=tmp_path, env=subprocess_env(), capture_output=True,
                             text=True, timeout=HANG_SECONDS)
    assert missing.returncode == 1
    assert missing.stderr.strip() == ("study_tokenizer.py: --out: expected the directory to "
                                      "write tokenizer.model into")


def _flag_definitions():
    """(file, DEFINE_ call) of every absl flag defined by main.py, scripts/ and benchmarks/."""
    import ast

    files = [REPO_ROOT / "main.py", *sorted((REPO_ROOT / "scripts").glob("*.py")),
             *sorted((REPO_ROOT / "benchmarks").glob("*.py"))]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr.startswith("DEFINE_")):
                yield path, node


def test_every_numeric_flag_of_every_tool_declares_its_range():
    """A count or a size given out of range (a negative device count, zero steps) is the
    flag parser's one line naming the flag, not a ZeroDivisionError later: every integer
    and float flag of main.py, scripts/ and benchmarks/ has a bound (absl checks it while
    parsing), and every tool parses its flags with cli's one-line parser."""
    numeric, unbounded = 0, []
    for path, node in _flag_definitions():
        if node.func.attr in ("DEFINE_integer", "DEFINE_float"):
            numeric += 1
            keywords = {k.arg for k in node.keywords}
            if not keywords & {"lower_bound", "upper_bound"}:
                unbounded.append(f"{path.name}: {node.args[0].value}")
    assert numeric > 20 and unbounded == []
    for path in [*(REPO_ROOT / "scripts").glob("*.py"), *(REPO_ROOT / "benchmarks").glob("*.py")]:
        text = path.read_text()
        if "app.run(" in text:  # its own flags, or those it forwards to main.py after --
            assert ("flags_parser=cli.tool_flags_parser" in text
                    or "flags_parser=cli.forwarding_flags_parser" in text), path.name


@pytest.mark.parametrize("script, flag, message", [
    ("benchmarks/program_cost.py", "--json={tmp}", "--json: expected a file to write"),
    ("benchmarks/program_cost.py", "--json={tmp}/no/such/dir/x.json",
     "--json: expected a file to write"),
    ("scripts/study_tokenizer.py", "--out={tmp}/file", "--out: expected a directory"),
    ("benchmarks/step_time.py", "--record_dir={tmp}/file", "--record_dir: expected a directory"),
])
def test_path_flags_are_checked_while_parsing(tmp_path, script, flag, message):
    """A path flag that cannot be what it names (an output file that is a directory, an
    output directory that is a file) is one line naming the flag, before any work."""
    (tmp_path / "file").write_text("")
    result = subprocess.run([sys.executable, str(REPO_ROOT / script),
                             flag.format(tmp=tmp_path)], cwd=tmp_path, env=subprocess_env(),
                            capture_output=True, text=True, timeout=HANG_SECONDS)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr[-2000:]


def test_every_list_flag_of_every_tool_is_checked_while_parsing():
    """A list flag's items (--parts, --impls, --objectives, --variants, --depths, ...) are
    checked by a validator registered with the flag (cli.choices_flag or its own), so an
    unknown item is the parser's one line before any work, not an error in a later part.
    --profile_sides needs the loaded config; gpu_suite.main checks it before any part."""
    import ast

    checked_in_main = {"profile_sides"}
    lists, unchecked = 0, []
    files = [REPO_ROOT / "main.py", *sorted((REPO_ROOT / "scripts").glob("*.py")),
             *sorted((REPO_ROOT / "benchmarks").glob("*.py"))]
    for path in files:
        calls = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)]
        validated = {n.args[0].value for n in calls
                     if isinstance(n.func, ast.Attribute) and n.args
                     and n.func.attr in ("choices_flag", "register_validator", "validator")
                     and isinstance(n.args[0], ast.Constant)}
        for n in calls:
            if isinstance(n.func, ast.Attribute) and n.func.attr == "DEFINE_list":
                lists += 1
                name = n.args[0].value
                if name not in validated | checked_in_main:
                    unchecked.append(f"{path.name}: --{name}")
    assert lists >= 5 and unchecked == []


def test_an_unknown_part_of_the_gpu_suite_is_one_line_before_any_part(tmp_path):
    flag, message = "--parts=throughput,foo", "unknown foo; expected some of attention, throughput"
    result = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks/gpu_suite.py"),
                             f"--out={tmp_path}/suite", flag],
                            cwd=tmp_path, env=subprocess_env(), capture_output=True,
                            text=True, timeout=HANG_SECONDS)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and flag.split("=")[0] in lines[0], \
        result.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []
