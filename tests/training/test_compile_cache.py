"""The persistent compilation cache: on by default in main.py, where the flags say."""

import subprocess
import sys

import pytest

from maelm_jax.infra import compile_cache, user_cache

from conftest import HANG_SECONDS, REPO_ROOT, subprocess_env

# End-to-end: left out of the fast inner loop (pytest -m "not slow").
pytestmark = pytest.mark.tier("slow")


def test_the_cache_directory_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv(user_cache.ENV, str(tmp_path / "user"))
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    assert compile_cache.directory() == str(tmp_path / "user" / "jax")
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "env"))
    assert compile_cache.directory() == str(tmp_path / "env")
    assert compile_cache.directory(str(tmp_path / "flag")) == str(tmp_path / "flag")
    monkeypatch.delenv(user_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache.directory("jax") == tmp_path / "xdg" / "maelm_jax" / "jax"


def _pretrain(tmp_path, tokenizer_path, name, *flags):
    env = subprocess_env()
    env.pop(compile_cache.ENV, None)  # only the flags decide
    return subprocess.run(
        [sys.executable, "main.py", "--config=tests/tiny_config.py",
         f"--workdir={tmp_path / name}", f"--config.tokenizer.model_path={tokenizer_path}",
         "--config.train.num_steps=2", "--config.train.eval_every=2",
         "--config.train.checkpoint_every=2", *flags],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=HANG_SECONDS)


def test_main_keeps_compiled_programs_unless_told_not_to(tmp_path, tiny_tokenizer):
    cache = tmp_path / "cache"
    run = _pretrain(tmp_path, tiny_tokenizer.model_path, "on", f"--compilation_cache_dir={cache}")
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"loaded from the compilation cache in {cache}) and ran the first step" in run.stderr
    assert any(cache.iterdir())  # the train step, at least (conftest: no minimum time)
    off = tmp_path / "off"
    run = _pretrain(tmp_path, tiny_tokenizer.model_path, "without", "--nocompilation_cache",
                    f"--compilation_cache_dir={off}")
    assert run.returncode == 0, run.stderr[-2000:]
    assert not off.exists() and "(no compilation cache) and ran the first step" in run.stderr
