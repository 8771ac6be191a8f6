"""benchmarks/ is a package: its modules import each other by the package's name (none edits
sys.path; tests/test_import_graph.py holds that they form no cycle), and none defines an
absl flag when imported (a script defines its own in `define_flags()`, when it runs), so
that any of them can meet another in one process: a test worker, or a script that runs
another's code (tpu_suite.py runs the GPU suite's with the TPU's defaults)."""

import json
import subprocess
import sys

import pytest

from conftest import HANG_SECONDS, REPO_ROOT, subprocess_env

# Seconds: a process that imports every benchmark (JAX, Flax and the models).
pytestmark = pytest.mark.tier("integration")

MODULES = sorted(p.stem for p in (REPO_ROOT / "benchmarks").glob("*.py")
                 if p.name != "__init__.py")
# Flags the scripts define; none may exist after importing them all.
THEIR_FLAGS = ["config", "record_dir", "steps", "repeats", "out", "parts", "objectives",
               "depths", "variants", "corpus", "kernel"]

IMPORT_ALL = f"""
import importlib, json
from absl import flags
for name in {MODULES!r}:
    importlib.import_module("benchmarks." + name)
found = sorted(set(flags.FLAGS) & set({THEIR_FLAGS!r}))
ours = sorted(m for m in flags.FLAGS.flags_by_module_dict() if m.startswith("benchmarks"))
from benchmarks import gpu_suite
gpu_suite.define_flags(gpu_suite.TPU)  # a script's flags, beside every other module
print(json.dumps({{"found": found, "ours": ours, "kernel": flags.FLAGS["kernel"].default}}))
"""


def test_no_module_edits_sys_path():
    assert len(MODULES) > 20
    assert [m for m in MODULES if "sys.path" in (REPO_ROOT / "benchmarks" / f"{m}.py")
            .read_text()] == []


def test_every_module_imports_beside_every_other_and_defines_no_flag(tmp_path):
    # From outside the repository: the installed package is all the imports need.
    result = subprocess.run([sys.executable, "-c", IMPORT_ALL], cwd=tmp_path,
                            env=dict(subprocess_env(), JAX_PLATFORMS="cpu"),
                            capture_output=True, text=True, timeout=HANG_SECONDS, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found == {"found": [], "ours": [], "kernel": "tpu"}
