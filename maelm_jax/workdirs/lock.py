"""One process group per workdir: a run holds its workdir while it runs.

Without a hold, the same command started twice (a job submitted twice, a scheduler that
retries while the first attempt still runs) resumes the first one's checkpoint and trains
beside it, and both write the same steps. So every mode that writes a workdir holds it,
from process 0 of the job alone (`held_by_leader`), and a second start is refused in one
line naming the holder (host, process id, since when) before it writes anything.

A holder that dies must not block the workdir for good, so the hold is one the holder's end
releases by itself:

* on a local (or network) file system, an `fcntl.flock` on workdir/.lock, which the
  operating system drops when the process ends however it ends (SIGKILL included). The
  file records the holder for the refusal; the holder removes it when it is done, and a
  file left by a process that died is taken over (its record named in a warning).
* in a bucket, which has no locks, a lease: the object workdir/.lock records the holder
  and a heartbeat its thread renews every `HEARTBEAT_S`; a lease whose heartbeat is older
  than `LEASE_S` is stale (its holder died or lost its machine) and the next start takes
  it over, as it does at once a lease whose holder ran on its own machine and has
  ended. The refusal says when a live-looking lease expires, and that removing the object
  takes it over at once. The bucket cannot make "read, then write" atomic for us, so a
  start writes its lease and reads it back after `SETTLE_S`: of two starts at the same
  instant, the one whose lease was overwritten gives way.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import glob
import json
import os
import pathlib
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator

from absl import logging

from maelm_jax.infra import distributed, paths
from maelm_jax.workdirs import guard, layout

LOCK_FILE = layout.LOCK_FILE
# A bucket's lease: renewed every HEARTBEAT_S, stale once its heartbeat is LEASE_S old
# (several heartbeats, so a slow request does not lose it), and read back after SETTLE_S.
HEARTBEAT_S = 20.0
LEASE_S = 90.0
SETTLE_S = 2.0


class WorkdirBusy(layout.WorkdirError):
    """The workdir is held by another run."""


def _holder() -> dict:
    """What a hold records of its holder, for the refusal and for a takeover's warning."""
    now = time.time()
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": now,
            "heartbeat": now, "token": uuid.uuid4().hex}


def _when(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime(
        "%Y-%m-%d %H:%M:%S UTC")


def describe(record: dict | None) -> str:
    """The holder in words: "process 123 on host-a since 2026-01-01 10:00:00 UTC"."""
    if not isinstance(record, dict):
        return "another process (it has not recorded itself yet)"
    try:
        return f"process {record['pid']} on {record['host']} since {_when(record['since'])}"
    except (KeyError, TypeError, ValueError, OverflowError, OSError):
        return "another process (its record is unreadable)"


def _parse(data: bytes) -> dict | None:
    try:
        record = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return record if isinstance(record, dict) else None


@contextlib.contextmanager
def held(workdir: paths.Path) -> Iterator[None]:
    """Holds `workdir` (absolute; created if need be) for the block; raises WorkdirBusy
    (one line, nothing written) while another run holds it. A workdir this call created
    and the block left empty is removed again, so a refused run leaves no directory."""
    guard.check_directory(workdir)
    if paths.is_local(workdir):
        with _flock(pathlib.Path(workdir)):
            yield
    else:
        with _lease(workdir):
            yield


@contextlib.contextmanager
def held_by_leader(workdir: paths.Path) -> Iterator[None]:
    """`held`, by process 0 of a multi-process job for all of its processes: one job is
    one holder, and a refusal stops every process with the same line."""
    with contextlib.ExitStack() as hold:
        with distributed.as_one("workdir held"):
            if distributed.is_leader():
                hold.enter_context(held(workdir))
        yield


def _created_dirs(directory: pathlib.Path) -> list[pathlib.Path]:
    """The directories `mkdir(parents=True)` would create for `directory`, deepest first."""
    missing = []
    for path in [directory, *directory.parents]:
        if path.exists():
            break
        missing.append(path)
    return missing


@contextlib.contextmanager
def _flock(directory: pathlib.Path) -> Iterator[None]:
    created = _created_dirs(directory)
    path = directory / LOCK_FILE
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = _locked_fd(path)
    except OSError as e:  # a read-only or someone else's directory
        _remove_empty(created)
        raise layout.WorkdirError(
            f"--workdir {directory}: cannot write {path} ({e.strerror or e}); give a "
            "directory this user can write") from None
    except BaseException:
        _remove_empty(created)
        raise
    try:
        left = _parse(os.pread(fd, 1 << 16, 0))
        if left is not None:  # its holder ended without removing it: a kill, a lost VM
            logging.warning("%s: taking over the hold of %s, which ended without releasing "
                            "it", directory, describe(left))
        record = json.dumps(_holder()).encode("utf-8")
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        yield
    finally:
        # Removed while still held: a start that opened it meanwhile finds, once it has
        # the lock, that its file is no longer the one at `path`, and tries again.
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
        os.close(fd)
        _remove_empty(created)


def _locked_fd(path: pathlib.Path) -> int:
    """A descriptor of `path` with its exclusive flock (created with the umask's mode)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _parse(os.pread(fd, 1 << 16, 0))
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise WorkdirBusy(
                f"--workdir {path.parent} is in use by {describe(holder)}; wait for it to "
                "end or use another --workdir (the hold ends with that process, however "
                f"it ends; if its machine is gone for good, remove {path})") from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # its holder removed it as we opened it: the next one is current


def _remove_empty(created: list[pathlib.Path]) -> None:
    for directory in created:
        with contextlib.suppress(OSError):
            directory.rmdir()  # only if empty: what the run wrote stays


def _read_lease(path: paths.Path) -> dict | None:
    try:
        return _parse(path.read_bytes())
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def _lease(workdir: paths.Path) -> Iterator[None]:
    path = workdir / LOCK_FILE
    current = _read_lease(path)
    if path.exists():
        if current is not None and _fresh(current) and not _ended_here(current):
            raise _busy(path, current)
        logging.warning("%s: taking over the hold of %s, which ended without releasing it "
                        "(it ran on this machine) or whose lease expired (no heartbeat for "
                        "%.0f s)", workdir, describe(current), LEASE_S)
    mine = _holder()
    paths.write_atomically(path, json.dumps(mine))
    time.sleep(SETTLE_S)
    current = _read_lease(path)
    if current is None or current.get("token") != mine["token"]:
        raise _busy(path, current)  # another start wrote its lease after ours
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(path, mine, stop), daemon=True,
                            name="workdir lease")
    beat.start()
    try:
        yield
    finally:
        stop.set()
        beat.join()
        with contextlib.suppress(Exception):  # a bucket's own error types
            if (_read_lease(path) or {}).get("token") == mine["token"]:
                path.unlink()


def _ended_here(record: dict) -> bool:
    """Whether the lease's holder ran on this machine and has ended (killed, say): the
    same command run again there need not wait for the lease to expire."""
    try:
        if record["host"] != socket.gethostname():
            return False
        os.kill(int(record["pid"]), 0)
    except ProcessLookupError:
        return True
    except (KeyError, TypeError, ValueError, OverflowError, OSError):
        return False
    return False


def _fresh(record: dict) -> bool:
    try:
        return time.time() - float(record["heartbeat"]) < LEASE_S
    except (KeyError, TypeError, ValueError):
        return False


def _busy(path: paths.Path, record: dict | None) -> WorkdirBusy:
    try:
        expires = _when(float(record["heartbeat"]) + LEASE_S)
    except (KeyError, TypeError, ValueError):
        expires = "once its heartbeat stops"
    return WorkdirBusy(
        f"--workdir {path.parent} is in use by {describe(record)}; wait for it to end or "
        f"use another --workdir (if that process is gone, its lease expires {expires} and "
        f"the same command then takes over; removing {path} takes over at once)")


def _heartbeat(path: paths.Path, mine: dict, stop: threading.Event) -> None:
    """Renews the lease until `stop`; a renewal that fails (a network hiccup) is retried at
    the next beat, as the lease outlasts several."""
    while not stop.wait(HEARTBEAT_S):
        mine["heartbeat"] = time.time()
        try:
            paths.write_atomically(path, json.dumps(mine))
        except Exception as e:  # noqa: BLE001 - a bucket client's own error types
            logging.warning("%s: could not renew the workdir's lease (%s); retrying", path, e)



# A scratch directory (`scratch`) without a lock file this old is a leftover too: its
# owner died between creating it and locking it (or it came from an older version).
_UNLOCKED_SCRATCH_S = 600.0


@contextlib.contextmanager
def scratch(parent: pathlib.Path, prefix: str = ".tmp-") -> Iterator[pathlib.Path]:
    """A new directory `parent/<prefix>...` held by this process while the block builds
    in it (a flock'd `.lock` in it), so that `remove_unowned` can tell a directory another
    process is still writing from one a killed process left. Before renaming it into
    place, the block calls `unlocked` (the lock file must not be published)."""
    directory = pathlib.Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    fd = _locked_fd(directory / LOCK_FILE)
    try:
        yield directory
    finally:
        unlocked(directory)
        os.close(fd)


def unlocked(directory: pathlib.Path) -> None:
    """Removes the lock file of a `scratch` directory (its flock stays with the open
    descriptor until the block ends)."""
    with contextlib.suppress(OSError):
        os.unlink(directory / LOCK_FILE)


def remove_unowned(parent: pathlib.Path, prefix: str = ".tmp-") -> list[pathlib.Path]:
    """Removes the `scratch` directories under `parent` whose process is gone (a kill
    during a preparation would leave one for good); returns them."""
    removed = []
    for directory in sorted(parent.glob(glob.escape(prefix) + "*")):
        if not directory.is_dir() or not _unowned(directory):
            continue
        shutil.rmtree(directory, ignore_errors=True)
        removed.append(directory)
    if removed:
        logging.info("removed %d directories left by interrupted preparations in %s: %s",
                     len(removed), parent, ", ".join(p.name for p in removed))
    return removed


def _unowned(directory: pathlib.Path) -> bool:
    try:
        fd = os.open(directory / LOCK_FILE, os.O_RDWR)
    except FileNotFoundError:
        try:
            return time.time() - directory.stat().st_mtime > _UNLOCKED_SCRATCH_S
        except OSError:
            return False
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # dropped with the descriptor
        return True
    except OSError:
        return False  # its owner is still writing it
    finally:
        os.close(fd)
