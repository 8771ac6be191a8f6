"""The tools a long run is watched and shaped with, one at a time: milestone checkpoints
(training/checkpoint.py: Keep), stack dumps on SIGUSR1 (infra/stacks.py), the profiler's
window (training/profiler.py). A tiny resumed pretraining run with all of them on is
tests/training/test_reliability.py's test_a_resumed_run_counts_on_from_its_checkpoint."""

import faulthandler
import os
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from maelm_jax import runs
from maelm_jax.infra import stacks
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.training import checkpoint

from tiny_config import tiny_config

pytestmark = pytest.mark.tier("unit")


def test_milestones_outlive_the_rotation(tmp_path):
    """Saved at every step, keeping the latest 2: the steps every 3 and step 5 stay for
    good, the others go; a Checkpointer opened again (a resumed run) keeps them too."""
    keep = checkpoint.Keep(latest=2, period=3, steps=(5,))
    assert [s for s in range(1, 9) if keep.milestone(s)] == [3, 5, 6]
    ckpt = checkpoint.Checkpointer(tmp_path, keep, async_save=False)
    for step in range(1, 7):
        ckpt.save(step, {"x": jnp.full([2], step, jnp.float32)}, {"step": step})
    ckpt.close()
    ckpt = checkpoint.Checkpointer(tmp_path, keep, async_save=False)
    for step in (7, 8):
        ckpt.save(step, {"x": jnp.full([2], step, jnp.float32)}, {"step": step})
    ckpt.wait()
    ckpt.close()
    assert checkpoint.finished_steps(tmp_path) == [3, 5, 6, 7, 8]
    plain = checkpoint.Checkpointer(tmp_path / "plain", 2, async_save=False)
    for step in range(1, 5):
        plain.save(step, {"x": jnp.zeros([2])}, {"step": step})
    plain.close()
    assert checkpoint.finished_steps(tmp_path / "plain") == [3, 4]


def test_milestone_and_profile_fields_are_checked():
    c = tiny_config()
    window = r'a window "START,COUNT" of ints >= 1, or empty'
    for field, value, words in (("keep_period", -1, "an int >= 0"),
                                ("keep_steps", (10, 0), r"a tuple of steps \(ints >= 1\)"),
                                ("profile_steps", "3", window),
                                ("profile_steps", "0,2", window),
                                ("profile_steps", "2,x", window)):
        bad = c.copy_and_resolve_references()
        bad.train[field] = value
        with pytest.raises(pretrain_config.ConfigError,
                           match=rf"^config.train.{field}: expected {words}"):
            pretrain_config.validate(bad)


def _waits_for_the_test(event):
    event.wait()


def test_sigusr1_dumps_every_thread_to_stderr_and_the_workdir(tmp_path, capfd):
    """The dump is written by faulthandler's C handler into a pipe that `tee` copies to the
    file and to stderr: every thread's stack, one of them waiting in this test's helper."""
    event = threading.Event()
    waiting = threading.Thread(target=_waits_for_the_test, args=(event,), daemon=True)
    waiting.start()
    try:
        target = stacks.on_signal(tmp_path / "stacks", process=3)
        assert target == tmp_path / "stacks" / "process_3.txt"
        assert "kill -USR1" in stacks.describe(target) and str(target) in stacks.describe(target)
        os.kill(os.getpid(), stacks.SIGNAL)
        deadline = time.monotonic() + 20
        while "_waits_for_the_test" not in (target.read_text() if target.exists() else ""):
            assert time.monotonic() < deadline, "no stacks written"
            time.sleep(0.05)
        dump = target.read_text()
        assert dump.count("Thread 0x") >= 2 and "Current thread" in dump
        time.sleep(0.2)
        assert "_waits_for_the_test" in capfd.readouterr().err
    finally:
        event.set()
        assert stacks.on_signal() is None  # stderr alone again; the pipe and tee let go
        faulthandler.unregister(stacks.SIGNAL)


def test_a_milestone_is_named_by_its_path(tmp_path):
    """The rank analysis and the export take a run's checkpoint by its path,
    <workdir>/checkpoints/<step>: a milestone is one."""
    (tmp_path / "config.json").write_text('{"mode": "pretrain", "train": {"num_steps": 9}}')
    ckpt = checkpoint.Checkpointer(tmp_path / "checkpoints", checkpoint.Keep(1, 3),
                                   async_save=False)
    for step in (3, 4):
        ckpt.save(step, {"params": {"w": np.ones([2], np.float32)}}, {"step": step})
    ckpt.close()
    assert runs.resolve_checkpoint(str(tmp_path / "checkpoints" / "3")) == (
        tmp_path, tmp_path / "checkpoints" / "3")


def test_the_profile_window_opens_after_the_compiling_step():
    """A window from step 1 of a fresh run starts at step 2; a resumed session past the
    window traces nothing; a process that does not trace has no window."""
    from maelm_jax.config import options
    from maelm_jax.training import profiler

    assert options.profile_window("") is None and options.profile_window("5,2") == (5, 2)
    fresh = profiler.Window(paths_of("w"), "1,3", first=1, traced=True)
    assert (fresh.start, fresh.end) == (2, 3)
    assert profiler.Window(paths_of("w"), "10,3", first=1, traced=True).start == 10
    assert profiler.Window(paths_of("w"), "1,3", first=5, traced=True).start is None
    assert profiler.Window(paths_of("w"), "10,3", first=1, traced=False).start is None
    assert profiler.summary({"dot": 0.003, "fusion": 0.001}, steps=2) == (
        "2.00 ms of ops a step; top: dot 1.50 ms (75%), fusion 0.50 ms (25%)")


def paths_of(name):
    from maelm_jax.infra import paths
    return paths.Path("/nonexistent") / name
