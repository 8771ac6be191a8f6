"""maelm_jax/workdirs/lock.py: one run per workdir (a flock locally, a lease in a bucket),
and the scratch directories of packing that a killed run leaves; the names a workdir may
have (guard.check_name) and a checkpoint committed without its metadata. The same command started
twice through main.py: tests/training/test_reliability.py (the SIGTERM test)."""

import hashlib
import json
import os
import socket
import time

import pytest

from maelm_jax.infra import paths
from maelm_jax.training import checkpoint
from maelm_jax.workdirs import layout, lock

from fake_bucket import fake_gcs

pytestmark = pytest.mark.tier("unit")


def test_a_second_hold_is_refused_naming_the_holder_and_writes_nothing(tmp_path):
    workdir = paths.Path(tmp_path / "runs" / "sweep lr=3e-3,#1")
    with lock.held(workdir):
        before = sorted(p.name for p in workdir.iterdir())
        # Another open file description: as another process would (a flock is per open).
        with pytest.raises(lock.WorkdirBusy) as refused:
            with lock.held(workdir):
                pytest.fail("held twice")
        assert sorted(p.name for p in workdir.iterdir()) == before == [layout.LOCK_FILE]
    line = str(refused.value)
    assert "\n" not in line
    assert f"process {os.getpid()} on {socket.gethostname()} since 20" in line
    assert "use another --workdir" in line
    # The hold is gone with the run, and so is the directory it created for it.
    assert not (tmp_path / "runs").exists()


def test_a_hold_keeps_what_the_run_wrote_and_removes_only_its_file(tmp_path):
    workdir = paths.Path(tmp_path / "run")
    with lock.held(workdir):
        (tmp_path / "run" / "config.json").write_text("{}")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.json"]
    with lock.held(workdir):  # free again
        pass


def test_a_hold_left_by_a_dead_process_is_taken_over(tmp_path, caplog):
    """What a SIGKILL leaves: the file with its record, no flock (the OS dropped it)."""
    (tmp_path / layout.LOCK_FILE).write_text(json.dumps(
        {"host": "lost-vm", "pid": 4242, "since": 1.8e9, "heartbeat": 1.8e9}))
    with lock.held(paths.Path(tmp_path)):
        record = json.loads((tmp_path / layout.LOCK_FILE).read_text())
        assert record["pid"] == os.getpid()
    assert "taking over the hold of process 4242 on lost-vm" in caplog.text
    assert not (tmp_path / layout.LOCK_FILE).exists()


def test_a_workdir_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "run").write_text("x")
    with pytest.raises(layout.WorkdirError, match="exists and is not a directory"):
        with lock.held(paths.Path(tmp_path / "run")):
            pass


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    monkeypatch.setattr(lock, "SETTLE_S", 0.0)
    (tmp_path / "bucket").mkdir()
    with fake_gcs(tmp_path):
        yield tmp_path / "bucket"


def test_a_bucket_lease_refuses_while_fresh_and_is_taken_over_once_stale(bucket, caplog,
                                                                         monkeypatch):
    workdir = paths.Path("gs://bucket/runs/a=1")
    with lock.held(workdir):
        held = json.loads((bucket / "runs" / "a=1" / layout.LOCK_FILE).read_text())
        assert held["pid"] == os.getpid()
        with pytest.raises(lock.WorkdirBusy, match=r"its lease expires 20.* removing "
                           r"gs://bucket/runs/a=1/\.lock takes over at once"):
            with lock.held(workdir):
                pytest.fail("held twice")
        # Its holder's machine is lost: no heartbeat for longer than the lease.
        now = time.time()
        monkeypatch.setattr(lock.time, "time", lambda: now + lock.LEASE_S + 1)
        with lock.held(workdir):
            taken = json.loads((bucket / "runs" / "a=1" / layout.LOCK_FILE).read_text())
            assert taken["token"] != held["token"]
        assert "whose lease expired" in caplog.text
    assert not (bucket / "runs" / "a=1" / layout.LOCK_FILE).exists()


def test_of_two_leases_written_at_once_the_overwritten_one_gives_way(bucket, monkeypatch):
    path = bucket / "run" / layout.LOCK_FILE
    rival = {"host": "other", "pid": 7, "since": time.time(), "heartbeat": time.time(),
             "token": "theirs"}
    monkeypatch.setattr(lock.time, "sleep", lambda s: path.write_text(json.dumps(rival)))
    with pytest.raises(lock.WorkdirBusy, match="in use by process 7 on other"):
        with lock.held(paths.Path("gs://bucket/run")):
            pytest.fail("both hold it")
    assert json.loads(path.read_text())["token"] == "theirs"  # the winner's lease stays


def test_the_lease_is_renewed_while_held(bucket, monkeypatch):
    monkeypatch.setattr(lock, "HEARTBEAT_S", 0.01)
    with lock.held(paths.Path("gs://bucket/run")):
        first = json.loads((bucket / "run" / layout.LOCK_FILE).read_text())["heartbeat"]
        deadline = time.monotonic() + 10
        while json.loads((bucket / "run" / layout.LOCK_FILE).read_text())["heartbeat"] == first:
            assert time.monotonic() < deadline, "no heartbeat"
            time.sleep(0.01)


def test_scratch_left_by_a_killed_run_is_removed_and_one_being_written_is_not(tmp_path):
    cache = tmp_path / "data"
    cache.mkdir()
    dead = cache / ".tmp-dead"  # a killed packer's: its lock file, no flock
    dead.mkdir()
    (dead / layout.LOCK_FILE).write_text("")
    (dead / "train-main-00000-of-00001").write_bytes(b"x")
    unlocked_old = cache / ".tmp-old"  # killed before it locked, long ago
    unlocked_old.mkdir()
    os.utime(unlocked_old, (0, 0))
    unlocked_new = cache / ".tmp-new"  # just made by a packer that has yet to lock it
    unlocked_new.mkdir()
    (cache / "0123abcd").mkdir()  # a finished set
    with lock.scratch(cache) as live:
        assert lock.remove_unowned(cache) == sorted([dead, unlocked_old])
        assert live.exists() and unlocked_new.exists() and (cache / "0123abcd").exists()
    assert not (live / layout.LOCK_FILE).exists()


@pytest.mark.parametrize("name", ["sweep[lr=3e-3]", "run*", "run?"])
def test_a_workdir_named_as_a_glob_pattern_is_refused_before_anything_is_written(
        tmp_path, name):
    for workdir in (paths.Path(tmp_path / "runs" / name), paths.Path(f"gs://bucket/{name}")):
        with pytest.raises(layout.WorkdirError, match=r"glob character .* name it without"):
            with lock.held(workdir):
                pytest.fail("held")
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_committed_without_its_metadata_is_not_intact(tmp_path):
    """What orbax commits when its merge's glob misses the per-process stores: the digests
    of what was written pass, the state cannot restore."""
    step = tmp_path / "6"
    (step / "state" / "ocdbt.process_0").mkdir(parents=True)
    (step / "state" / "_METADATA").write_text("{}")
    digests = {"state/_METADATA": [2, hashlib.sha256(b"{}").hexdigest()]}
    (step / checkpoint.DIGEST_FILE).write_text(json.dumps(digests))
    with pytest.raises(ValueError, match="committed without its metadata"):
        checkpoint.check_digests(paths.Path(step))
    (step / "state" / "manifest.ocdbt").write_bytes(b"")
    checkpoint.check_digests(paths.Path(step))


def test_every_mode_but_fill_mask_holds_its_workdir():
    """main.py holds --workdir (lock.held_by_leader, which refuses a glob-pattern name
    first) for every mode that writes it: all but fill_mask, which reads a run. Read from
    main.py's source, as tests/test_docs.py reads MODES (importing main defines flags)."""
    import ast

    from conftest import REPO_ROOT

    tree = ast.parse((REPO_ROOT / "main.py").read_text())
    [modes] = [n.value for n in ast.walk(tree) if isinstance(n, ast.AnnAssign)
               and getattr(n.target, "id", None) == "MODES"]
    writes = {}
    for key, call in zip(modes.keys, modes.values, strict=True):
        flag = [k.value for k in call.keywords if k.arg == "writes_workdir"]
        writes[key.value] = ast.literal_eval(flag[0]) if flag else True
    assert {mode for mode, w in writes.items() if not w} == {"fill_mask"}
    assert {"pretrain", "prepare", "finetune", "rank", "study", "export"} <= set(writes)


def test_a_lease_whose_holder_ended_on_this_machine_is_taken_over_at_once(bucket):
    """A run in a bucket killed and started again on its machine: no wait for the lease
    to expire (a holder on another machine must be waited for, or its lease removed)."""
    import subprocess
    import sys

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    record = {"host": socket.gethostname(), "pid": int(ended.stdout), "since": time.time(),
              "heartbeat": time.time(), "token": "killed"}
    (bucket / "run").mkdir()
    (bucket / "run" / layout.LOCK_FILE).write_text(json.dumps(record))
    with lock.held(paths.Path("gs://bucket/run")):
        pass
    (bucket / "run" / layout.LOCK_FILE).write_text(json.dumps({**record, "host": "other"}))
    with pytest.raises(lock.WorkdirBusy, match="in use by process"):
        with lock.held(paths.Path("gs://bucket/run")):
            pass


def test_a_workdir_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    """A read-only or someone else's directory (faked: as root, permissions cannot make
    the case): one line, and no directory left."""
    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(lock, "_locked_fd", denied)
    with pytest.raises(layout.WorkdirError, match=r"cannot write .*\.lock \(Permission "
                                                  r"denied\); give a directory"):
        with lock.held(paths.Path(tmp_path / "runs" / "run")):
            pytest.fail("held")
    assert list(tmp_path.iterdir()) == []


def test_a_restore_interrupted_inside_a_library_sets_nothing_aside(tmp_path, monkeypatch):
    """A Ctrl-C that arrives inside orbax or tensorstore can come out wrapped in another
    error; the restore must not take it for a damaged checkpoint (set aside as
    <step>.damaged, the run resumed from an older one)."""
    import numpy as np

    ckpt = checkpoint.Checkpointer(tmp_path / "checkpoints", 3)
    state = {"w": np.arange(4, dtype=np.float32)}
    ckpt.save(2, state, {"step": 2})
    ckpt.wait()

    def interrupted(*args):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("tensorstore: operation cancelled") from None

    monkeypatch.setattr(checkpoint.Checkpointer, "restore", interrupted)
    with pytest.raises(RuntimeError, match="cancelled"):
        ckpt.restore_latest(state)
    ckpt.close()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2"]
