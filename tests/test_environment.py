"""Every environment variable the project reads (maelm_jax/infra/environment.py): empty is unset,
a bad value is one line naming the variable, and each reader goes through it."""

import os
import re
import subprocess
import sys

import pytest

from maelm_jax.infra import compile_cache, distributed, environment, errors, user_cache

from conftest import HANG_SECONDS, REPO_ROOT, subprocess_env

pytestmark = pytest.mark.tier("unit")


@pytest.mark.parametrize("name", ["SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"])
def test_a_launchers_count_empty_is_unset_and_a_bad_one_is_named(name):
    assert environment.integer(name, 1, 1, env={}) == 1
    assert environment.integer(name, 1, 1, env={name: ""}) == 1
    assert environment.integer(name, 1, 1, env={name: "  "}) == 1
    assert environment.integer(name, 1, 1, env={name: " 4 "}) == 4
    for bad in ("four", "2.5", "0", "-3"):
        with pytest.raises(environment.EnvironmentVariableError,
                           match=rf"^environment variable {name}: expected an integer >= 1 "
                                 rf"\(.*\), got '{bad}'; unset it or set a number$"):
            environment.integer(name, 1, 1, env={name: bad})


def test_cluster_detection_reads_the_launchers_through_it(tmp_path):
    assert distributed.cluster_detected({"SLURM_NTASKS": ""}, root=str(tmp_path)) is None
    assert distributed.cluster_detected({"SLURM_NTASKS": "2"}, root=str(tmp_path)) == "slurm"
    assert distributed.cluster_detected({"OMPI_COMM_WORLD_SIZE": "3"},
                                        root=str(tmp_path)) == "openmpi"
    assert distributed.cluster_detected({"TPU_WORKER_HOSTNAMES": "a,,b"},
                                        root=str(tmp_path)) == "cloud tpu"
    assert distributed.cluster_detected({"TPU_WORKER_HOSTNAMES": " , a"},
                                        root=str(tmp_path)) is None
    with pytest.raises(environment.EnvironmentVariableError, match="SLURM_NTASKS"):
        distributed.cluster_detected({"SLURM_NTASKS": "x"}, root=str(tmp_path))


def test_cache_directories_treat_empty_as_unset(monkeypatch, tmp_path):
    monkeypatch.setenv("MAELM_JAX_CACHE", "")
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert user_cache.directory("jax") == tmp_path / ".cache" / "maelm_jax" / "jax"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache.directory("jax") == tmp_path / "xdg" / "maelm_jax" / "jax"
    monkeypatch.setenv("MAELM_JAX_CACHE", str(tmp_path / "own"))
    assert user_cache.directory("jax") == tmp_path / "own" / "jax"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "")
    assert compile_cache.directory() == str(tmp_path / "own" / "jax")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jc"))
    assert compile_cache.directory() == str(tmp_path / "jc")


def test_only_known_variables_are_read():
    with pytest.raises(KeyError, match="environment.VARIABLES"):
        environment.text("HOME_DIR_OF_SOMEONE")
    assert environment.names("TPU_WORKER_HOSTNAMES", env={"TPU_WORKER_HOSTNAMES": "a, b,"}) \
        == ["a", "b"]


def test_no_module_reads_the_environment_but_through_it():
    """The variables of environment.VARIABLES are read nowhere else (a grep of the code)."""
    offenders = []
    code = [*(REPO_ROOT / "maelm_jax").rglob("*.py"), *(REPO_ROOT / "benchmarks").glob("*.py"),
            *(REPO_ROOT / "scripts").glob("*.py"), REPO_ROOT / "main.py"]
    for path in code:
        if path.name == "environment.py":
            continue
        text = path.read_text()
        for name in environment.VARIABLES:
            read = re.compile(rf'(environ\.get\(|getenv\(|environ\[)\s*"{name}"(?!\]\s*=[^=])')
            if read.search(text):
                offenders.append(f"{path.relative_to(REPO_ROOT)}: {name}")
    assert offenders == []
    # The check is real: a read is found.
    assert re.search(r'(environ\.get\(|getenv\(|environ\[)\s*"SLURM_NTASKS"',
                     'int(os.environ.get("SLURM_NTASKS", "1"))')


@pytest.mark.tier("integration")  # seconds: a run
def test_main_stops_with_one_line_for_a_bad_launcher_variable(tmp_path):
    """An empty launcher variable is a laptop run as usual; a bad one is one line and
    status 1, before anything is written."""
    env = {**subprocess_env(), "SLURM_NTASKS": "many", "OMPI_COMM_WORLD_SIZE": ""}
    run = subprocess.run([sys.executable, "main.py", "--config=tests/tiny_config.py",
                          f"--workdir={tmp_path / 'w'}"], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=HANG_SECONDS)
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert lines[-1].endswith("environment variable SLURM_NTASKS: expected an integer >= 1 "
                              "(the tasks of a Slurm job), got 'many'; unset it or set a "
                              "number"), run.stderr[-2000:]
    assert not (tmp_path / "w").exists()
    assert os.environ.get("SLURM_NTASKS") != "many"


@pytest.mark.parametrize("flags, env, message", [
    (("", 2, -1), {}, "--num_processes: only with --coordinator_address"),
    (("", 0, 0), {}, "--process_id: only with --coordinator_address"),
    (("10.0.0.1", 2, 0), {}, "--coordinator_address: expected host:port with a port in "
                             "1-65535, got '10.0.0.1'"),
    (("h:99999", 2, 0), {}, "--coordinator_address: expected host:port"),
    (("h:1234", 0, 0), {}, "--num_processes: expected at least 1"),
    (("h:1234", 2, 2), {}, r"--process_id: expected 0 to 1 \(ids count from 0, below "
                           r"--num_processes=2\), got 2"),
    (("h:1234", 2, -1), {}, "--process_id: expected 0 to 1"),
    (("h:1234", 2, 0), {"SLURM_NTASKS": "4"}, "--num_processes: 2, but the launcher's "
                                              "SLURM_NTASKS=4 says otherwise"),
])
def test_multi_process_flags_are_checked_before_jax_sees_them(flags, env, message):
    with pytest.raises(errors.UserError, match=f"^{message}"):
        distributed.check_process_flags(*flags, env=env)


def test_good_multi_process_flags_pass():
    distributed.check_process_flags("", 0, -1, env={})
    distributed.check_process_flags("host:1234", 2, 1, env={"SLURM_NTASKS": ""})
    distributed.check_process_flags("[::1]:1234", 4, 3, env={"OMPI_COMM_WORLD_SIZE": "4"})


def test_the_commit_of_a_copy_without_history(monkeypatch):
    from maelm_jax.infra import records

    monkeypatch.setenv("MAELM_JAX_COMMIT", "abc123")
    assert records.commit() == "abc123"
    monkeypatch.setenv("MAELM_JAX_COMMIT", " ")  # empty: git's, as if unset
    assert records.commit() != " " and records.commit() != ""
