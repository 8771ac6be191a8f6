"""Shared fixtures: tiny configs and a small tokenizer trained once per session."""

import os
import pathlib
import subprocess
import sys
import tempfile


def _fast_compile() -> str:
    """XLA flags for programs that are compiled often and run briefly: tests time nothing
    and compile many tiny programs, where compile time is most of their CPU time. Without
    the backend's optimisation the model tests take about 30 % less CPU time; with XLA's
    older CPU emitters instead of its fusion emitters (compiled faster, running slower),
    a test that trains takes about 25 % less. The second flag is used only where this
    jaxlib knows it (XLA stops a process at an XLA_FLAGS entry it does not know), asked
    once per session: its processes inherit the answer."""
    if "MAELM_JAX_TEST_FAST_COMPILE" not in os.environ:
        flags = "--xla_backend_optimization_level=0"
        emitters = "--xla_cpu_use_fusion_emitters=false"
        known = subprocess.run([sys.executable, "-c", "import jax; jax.devices('cpu')"],
                               env=dict(os.environ, XLA_FLAGS=emitters, JAX_PLATFORMS="cpu"),
                               capture_output=True).returncode == 0
        os.environ["MAELM_JAX_TEST_FAST_COMPILE"] = f"{flags} {emitters}" if known else flags
    return os.environ["MAELM_JAX_TEST_FAST_COMPILE"]


FAST_COMPILE = _fast_compile()
# Eight CPU devices for the sharding tests; must be set before JAX is first imported.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count=8 {FAST_COMPILE}"
).strip()
# Many tests (and their main.py subprocesses, which inherit the environment) compile the
# same tiny programs: a persistent compilation cache shared by the session saves minutes.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      tempfile.mkdtemp(prefix="maelm-jax-test-compile-cache-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# The CPU alone: with libtpu installed (requirements-tpu-check.txt, for the tests that
# compile for TPU topologies) JAX would otherwise try to start a TPU runtime in every
# process and print pages of warnings. Topology descriptions need no runtime.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The per-user cache (maelm_jax/infra/user_cache.py) of the session, not the user's own.
os.environ.setdefault("MAELM_JAX_CACHE", tempfile.mkdtemp(prefix="maelm-jax-test-cache-"))

# The environment above must be set before JAX is imported, hence imports below code.
import pytest  # noqa: E402

from maelm_jax.data import builtin_corpus  # noqa: E402
from maelm_jax.text import tokenizer as tokenizer_lib  # noqa: E402

import support  # noqa: E402
from tiny_config import TINY_VOCAB  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


# How long a test waits for a subprocess to reach a point before calling it hung: a guard
# against waiting forever, not a speed requirement, so it is far above any machine's time.
HANG_SECONDS = 900


def subprocess_env(devices: int = 1) -> dict:
    """Environment for running main.py in a subprocess: the repo importable and `devices`
    CPU devices (fewer devices compile and run faster on a small machine)."""
    return dict(os.environ, PYTHONPATH=str(REPO_ROOT),
                XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}")


def require_shared_data(*parts: str) -> pathlib.Path:
    """The path under ../shared/data, or skip: users' machines do not have it."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"reference data {path} is absent (only on development machines)")
    return path


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory) -> tokenizer_lib.Tokenizer:
    path = tmp_path_factory.mktemp("tokenizer") / "tiny.model"
    return tokenizer_lib.train_tokenizer(
        builtin_corpus.iter_documents(), str(path), TINY_VOCAB, lowercase=True
    )


# Every test file declares its tier, `pytestmark = pytest.mark.tier(...)` (a test may
# declare its own): "unit", the seconds-scale tier (`pytest -m unit`: config validation, the
# registries, the workdir lifecycle, data readers, masking, FLOPs, CLI errors; nothing
# heavier than a toy step), "integration" (runs of a few seconds: steps, loops, models)
# or "slow" (end-to-end: main.py in subprocesses, several processes, the study, benchmark
# scripts; `pytest -m "not slow"` leaves them out). A test marked slow is slow wherever
# it is. tests/test_test_groups.py holds that every file declares one.
TIERS = ("unit", "integration", "slow")
TESTS_DIR = pathlib.Path(__file__).resolve().parent


def tier(item) -> str:
    marker = item.get_closest_marker("tier")
    if marker is None or marker.args[0] not in TIERS:
        raise pytest.UsageError(f"{item.nodeid}: its file declares no tier; add "
                                f"pytestmark = pytest.mark.tier(one of {TIERS})")
    return "slow" if item.get_closest_marker("slow") else marker.args[0]


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups from the marks
def pytest_collection_modifyitems(items):
    """Marks the unit and slow tiers (above) for `-m`. Keeps the tests that share a
    module-scoped fixture in one xdist worker (the fixture is then built once) and lets
    every other test go to whichever worker is free, so that one file's slow tests do not
    queue behind each other (pyproject's `--dist loadgroup`).

    The slow tier runs first: xdist hands out work in this order (groups of several tests
    first, the largest first), so the seconds-scale tests are left to fill the workers'
    last minutes instead of one worker finishing a minutes-long test alone. A module whose
    tests share a fixture moves whole (its fixture is built once)."""
    grouped, slow_modules = set(), set()
    for item in items:
        kind = tier(item)
        if kind == "unit":
            item.add_marker(pytest.mark.unit)
        elif kind == "slow":
            item.add_marker(pytest.mark.slow)
            slow_modules.add(item.module.__name__)
        fixture_defs = getattr(item, "_fixtureinfo", None)
        if fixture_defs is None:
            continue
        if any(defs[-1].scope in ("module", "package")
               for defs in fixture_defs.name2fixturedefs.values()):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
            grouped.add(item.module.__name__)

    def slow_first(item) -> int:
        module = item.module.__name__
        slow = module in slow_modules if module in grouped else tier(item) == "slow"
        return 0 if slow else 1

    items.sort(key=slow_first)  # stable: the collection's order within each rank


def poison_steps(monkeypatch, module, factory: str, step_indices) -> None:
    """Makes `module.factory`'s train steps see NaN parameters at the given 0-based steps,
    then hands back the clean parameters (not Adam's moments): the step's own non-finite
    check must drop the update, or the moments carry the NaN on."""
    import jax
    import jax.numpy as jnp

    real = getattr(module, factory)

    def make(*args, **kwargs):
        train_step = real(*args, **kwargs)

        def poisoned(state, batch, *args):  # args: pretraining's schedule
            bad = jnp.isin(state.step, jnp.asarray(step_indices))
            dirty = jax.tree.map(lambda p: jnp.where(bad, p * jnp.nan, p), state.params)
            new, metrics = train_step(state.replace(params=dirty), batch, *args)
            params = jax.tree.map(lambda n, p: jnp.where(bad, p, n), new.params, state.params)
            return new.replace(params=params), metrics

        return poisoned

    monkeypatch.setattr(module, factory, make)


def preempt_main(cmd, metrics_file: pathlib.Path, lines: int = 3, signum: int = 15,
                 **popen) -> int:
    """Runs main.py's `cmd`, sends `signum` (SIGTERM; SIGINT for a Ctrl-C) once
    `metrics_file` has `lines` lines, and checks the stop's exit: status 128 + signum, the
    message, no traceback. Returns the step it says it saved."""
    import re
    import signal
    import subprocess
    import time

    proc = subprocess.Popen(cmd, env=subprocess_env(), text=True, stderr=subprocess.PIPE,
                            **popen)
    deadline = time.monotonic() + HANG_SECONDS
    while not (metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= lines):
        assert proc.poll() is None and time.monotonic() < deadline, "finished or hung"
        time.sleep(0.05)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=HANG_SECONDS)
    assert proc.returncode == 128 + signum, stderr[-2000:]
    word = "interrupted" if signum == signal.SIGINT else "preempted"
    found = re.search(rf"{word}: saved a checkpoint at step (\d+) .*run the same command",
                      stderr)
    assert found, stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-2000:]
    return int(found.group(1))


@pytest.fixture
def sst2_settings(tmp_path, tiny_tokenizer):
    """TINY plus the data: 48 train examples = 6 steps of 8 per epoch, 16 dev examples."""
    data = tmp_path / "glue" / "SST-2"
    data.mkdir(parents=True)
    support.write_sst2(data, 48, 0)
    support.write_sst2(data, 16, 1)
    return {**support.FINETUNE_TINY, "tokenizer_path": tiny_tokenizer.model_path,
            "data.data_dir": str(tmp_path / "glue")}
