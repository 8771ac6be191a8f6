"""Where files live: local paths and bucket URIs behind one type, `etils.epath.Path`.

Every file the project reads or writes goes through `epath.Path` (as orbax and tfds do), so
a workdir, a prepared-data cache, a tokenizer or a data file may be ``gs://bucket/...`` as
well as a local path. epath reaches a bucket through fsspec, so ``gs://`` needs the
``gcsfs`` package at run time (``pip install -r requirements-gcs.txt``); without it
`resolve` names the setting and the package in one line.

A URI must never pass through `pathlib` or `os.path`: ``pathlib.Path("gs://b/x")`` is the
local path ``gs:/b/x``. `resolve` is the way in for every path a user gives.

A bucket is not a file system, and the helpers here are how the project copes:

* no directories: one appears with its first object, so `make_dirs` does nothing there
  (and never creates a bucket);
* no appending: an object is written whole when it is closed, so files that grow
  (metrics.jsonl, TensorBoard event files) are written locally and uploaded whole
  (`LocalMirror`);
* no atomic rename of a directory (a rename is a copy and a delete, object by object):
  writing one object is atomic, so `write_atomically` writes in one go there, and a set of
  files is marked complete by the one written last;
* no memory mapping: readers that need a local file read the bytes instead.
"""

from __future__ import annotations

import contextlib
import glob as glob_lib
import os
import pathlib
import shutil
import tempfile
import time
import uuid

from etils import epath

from maelm_jax.infra import errors

Path = epath.Path
PathLike = str | os.PathLike

# The URI schemes supported: scheme -> (fsspec protocol epath asks for, the package that
# provides it). Orbax checkpoints reach only gs:// buckets natively (TensorStore's gcs
# driver), so other object stores are refused rather than half supported.
_SCHEMES = {"gs": ("gcs", "gcsfs")}
_INSTALL = "pip install -r requirements-gcs.txt"


class PathError(errors.UserError):
    """A path that cannot be used here (an unsupported scheme, a missing package)."""


def is_uri(path: PathLike) -> bool:
    """Whether `path` names an object in a bucket (``scheme://...``), not a local file."""
    return "://" in os.fspath(path)


def is_local(path: PathLike) -> bool:
    return not is_uri(path)


def check_backend(uri: str, field: str) -> None:
    """Raises PathError (naming `field`) unless `uri`'s scheme is supported and the
    package that reaches it is installed."""
    scheme = uri.split("://", 1)[0]
    if scheme not in _SCHEMES:
        supported = ", ".join(f"{s}://" for s in _SCHEMES)
        raise PathError(f"{field}: {uri}: {scheme}:// is not supported; use a local path or "
                        f"{supported}")
    import fsspec  # epath's backend for buckets (without TensorFlow)

    protocol, package = _SCHEMES[scheme]
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError:
        raise PathError(f"{field}: {uri}: {scheme}:// paths need the {package} package "
                        f"({_INSTALL})") from None


def absolute(value: str, field: str = "path") -> str:
    """An absolute local path (``~`` expanded), or a URI unchanged once `check_backend`
    accepts it; "" stays "". `field` names the setting in errors."""
    if not value:
        return value
    if is_uri(value):
        check_backend(value, field)
        return value
    return os.path.abspath(os.path.expanduser(value))


def resolve(value: PathLike, field: str) -> Path:
    """`value` (a path the user gave, in `field`) as an absolute `Path` (see `absolute`)."""
    return Path(absolute(os.fspath(value), field))


def lineage(path: Path) -> list[Path]:
    """`path` and its parents, up to the file system's root or the URI's bucket."""
    chain = [path, *path.parents]
    if is_uri(path):
        # Path("gs://b/x").parents: gs://b, then gs:// and / (which are not in the bucket).
        chain = [p for p in chain if is_uri(p) and os.fspath(p).split("://", 1)[1]]
    return chain


def _comparable(path: PathLike) -> pathlib.PurePath:
    return Path(path) if is_uri(path) else pathlib.Path(path).resolve()


def same(a: PathLike, b: PathLike) -> bool:
    """Whether `a` and `b` name the same file (symlinks resolved for local paths)."""
    return is_uri(a) == is_uri(b) and _comparable(a) == _comparable(b)


def contains(outer: PathLike, inner: PathLike) -> bool:
    """Whether `inner` is `outer` or lies under it (symlinks resolved for local paths)."""
    return same(outer, inner) or (
        is_uri(outer) == is_uri(inner) and _comparable(outer) in _comparable(inner).parents)


def make_dirs(path: Path) -> None:
    """Creates a local directory and its parents; in a bucket nothing (a directory appears
    with its first object, and creating one could create a bucket)."""
    if is_local(path):
        path.mkdir(parents=True, exist_ok=True)


def remove(path: Path) -> None:
    """Removes a file or a directory tree if it exists; failures are ignored (as
    ``shutil.rmtree(ignore_errors=True)``): this is cleanup, never the point, and must not
    hide the error that called for it."""
    with contextlib.suppress(Exception):  # bucket clients raise their own error types
        if path.is_dir():
            path.rmtree()
        else:
            path.unlink(missing_ok=True)


def read_text(path: Path) -> str:
    """The file's text, decoded as UTF-8 whatever the locale or the backend."""
    return path.read_bytes().decode("utf-8")


def write_text(path: Path, text: str) -> None:
    """Writes `text` as UTF-8 (whatever the locale or the backend), atomically: a file
    another process may read meanwhile (a peer of a multi-process job, a user) or that a
    killed process was rewriting is always whole."""
    write_atomically(path, text.encode("utf-8"))


def write_atomically(path: Path, data: bytes | str) -> None:
    """Writes `data` so that a reader sees the old content or the new, never a part:
    locally through a temporary file beside `path` and a rename; in a bucket in one
    write, since an object is replaced whole when its upload completes."""
    data = data.encode("utf-8") if isinstance(data, str) else data
    if is_uri(path):
        path.write_bytes(data)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkstemp: its file is private (0600), and the rename would keep that;
    # created like any other file, it gets the permissions the umask gives.
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def umask() -> int:
    """The process's umask, read without changing it where Linux shows it (setting it to
    read it back is not safe while other threads create files)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def as_created_in_place(tree: pathlib.Path) -> None:
    """Gives a local tree built in a private temporary directory (`tempfile.mkdtemp` makes
    it 0700, `mkstemp` files 0600) the modes the umask gives what is created in place,
    before it is renamed into place: otherwise what a run publishes (an export, prepared
    blocks) stays private by accident, and a team sharing the machine cannot read it."""
    mask = umask()
    for root, dirs, files in os.walk(tree):
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~mask)
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~mask)
    os.chmod(tree, 0o777 & ~mask)


def _filesystem(uri: str):
    """(the fsspec file system of a bucket URI, the path within it, the scheme): for the
    listings epath has no call for."""
    import fsspec

    fs, inner = fsspec.core.url_to_fs(uri)
    return fs, inner, uri.split("://", 1)[0]


def files_under(directory: Path) -> list[Path]:
    """Every file below `directory`, recursively, sorted ([] if it does not exist)."""
    if is_local(directory):
        root = pathlib.Path(directory)
        return sorted(Path(p) for p in root.rglob("*") if p.is_file())
    fs, root, scheme = _filesystem(os.fspath(directory))
    # One listing call for the whole tree (walking it costs a request per directory).
    return sorted(Path(f"{scheme}://{p}") for p in fs.find(root))


def glob(pattern: str) -> list[str]:
    """The paths that match `pattern` (``**`` spans directories), files and directories."""
    if is_local(pattern):
        return glob_lib.glob(pattern, recursive=True)
    fs, inner, scheme = _filesystem(pattern)
    return [f"{scheme}://{match}" for match in fs.glob(inner)]


def object_info(uri: str) -> tuple[dict, str]:
    """(the metadata of an object in a bucket: size, checksums, ...; fsspec's ukey, a
    version that changes with the object)."""
    fs, inner, _ = _filesystem(uri)
    return fs.info(inner), fs.ukey(inner)


def read_ranges(uri: str, starts: list[int], ends: list[int]) -> list[bytes]:
    """Byte ranges [start, end) of one object in a bucket, fetched concurrently (gcsfs
    sends the requests at once)."""
    fs, inner, _ = _filesystem(uri)
    return fs.cat_ranges([inner] * len(starts), starts, ends)


def upload(local: pathlib.Path, target: Path) -> None:
    """Copies a local file to `target` (local or in a bucket), streaming it."""
    Path(local).copy(target, overwrite=True)


class LocalMirror:
    """A local directory standing in for `target` while the files in it grow.

    For a local `target` it is the target itself and `sync` has nothing to do. For a
    directory in a bucket, files are written into a local temporary directory (an object
    cannot be appended to, and libraries such as tensorboardX write local files) and
    `sync` uploads each file that changed since its last upload, whole.
    """

    def __init__(self, target: Path, interval: float = 60.0):
        """`interval`: seconds between uploads when `sync(force=False)` is called often."""
        self.target = target
        self.remote = is_uri(target)
        self.local = (pathlib.Path(tempfile.mkdtemp(prefix="maelm-mirror-")) if self.remote
                      else pathlib.Path(target))
        self._interval = interval
        self._last_sync = time.monotonic()
        self._uploaded: dict[pathlib.Path, tuple[int, int]] = {}  # file -> (size, mtime)

    def sync(self, force: bool = True) -> None:
        """Uploads the changed files (unless not `force`d and the interval has not
        passed)."""
        if not self.remote or (not force and
                               time.monotonic() - self._last_sync < self._interval):
            return
        for file in sorted(p for p in self.local.rglob("*") if p.is_file()):
            stat = file.stat()
            version = (stat.st_size, stat.st_mtime_ns)
            if self._uploaded.get(file) != version:
                upload(file, self.target / file.relative_to(self.local).as_posix())
                self._uploaded[file] = version
        self._last_sync = time.monotonic()

    def close(self) -> None:
        """A last upload; the local copy of a bucket's directory is then removed."""
        self.sync()
        if self.remote:
            shutil.rmtree(self.local, ignore_errors=True)

