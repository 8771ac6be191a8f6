"""A stand-in for Google Cloud Storage: ``gs://<bucket>/<object>`` on a local directory.

`fake_gcs(root)` makes every ``gs://`` path in the process land under ``root/<bucket>/``,
through the same doors a real run uses: fsspec's ``gs``/``gcs`` protocol (which
etils.epath uses without TensorFlow, in place of gcsfs) and, for orbax's arrays,
TensorStore's kvstore (its ``gcs`` driver replaced by the ``file`` driver). Like a
bucket, it has no directories of their own: creating one does nothing, and one appears
with its first object; and an object written through fsspec appears whole when its
upload completes (a reader never sees part of it). Test-only: nothing of it belongs in
maelm_jax.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import pathlib
import uuid

import pytest
from etils.epath import backend as epath_backend
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem
from orbax.checkpoint._src.path import gcs_utils


class _Upload(io.BytesIO):
    """An object being uploaded: its bytes appear at `path` whole once it is closed."""

    def __init__(self, path: str):
        super().__init__()
        self._path = path

    def close(self):
        if not self.closed:
            directory, name = os.path.split(self._path)
            tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex}.upload")
            with open(tmp, "wb") as f:
                f.write(self.getvalue())
            os.replace(tmp, self._path)
        super().close()


class _Uploads(LocalFileSystem):
    """Local files written as a bucket's objects are (`_Upload`), so that a reader never
    sees part of one."""

    def _open(self, path, mode="rb", block_size=None, **kwargs):
        if "w" not in mode:
            return super()._open(path, mode, block_size, **kwargs)
        path = self._strip_protocol(path)
        self.makedirs(self._parent(path), exist_ok=True)
        return _Upload(path)


def _bucket_filesystem(root: pathlib.Path) -> type:
    class FakeGCSFileSystem(DirFileSystem):
        protocol = ("gs", "gcs")

        def __init__(self, *args, **storage_options):
            # gcsfs's options (finalize_on_close, project, ...) mean nothing here.
            super().__init__(path=str(root), fs=_Uploads(auto_mkdir=True))

        def mkdir(self, path, create_parents=True, **kwargs):
            pass  # a bucket has no directories: one appears with its first object

        def makedirs(self, path, exist_ok=False):
            pass

    return FakeGCSFileSystem


def _kvstore_for(root: pathlib.Path):
    def get_kvstore_for_gcs(ckpt_path: str) -> dict:
        bucket, inner = gcs_utils.parse_gcs_path(ckpt_path, add_trailing_slash=False)
        return {"driver": "file", "path": os.path.join(str(root), bucket, inner)}

    return get_kvstore_for_gcs


@contextlib.contextmanager
def fake_gcs(root: pathlib.Path):
    """Within the block, gs://<bucket>/... is root/<bucket>/... (create the bucket as a
    directory of root); everything is undone afterwards."""
    cls = _bucket_filesystem(root)
    forget = epath_backend.fsspec_backend._get_filesystem.cache_clear
    with contextlib.ExitStack() as undo:
        # epath caches the file system per protocol: forget it on the way in and, last,
        # on the way out.
        forget()
        undo.callback(forget)
        mp = undo.enter_context(pytest.MonkeyPatch.context())
        for protocol in cls.protocol:
            # fsspec has no call to unregister; monkeypatch restores its registry entry.
            mp.setitem(importlib.import_module("fsspec.registry")._registry, protocol, cls)
        mp.setattr(gcs_utils, "get_kvstore_for_gcs", _kvstore_for(root))
        # Orbax asks the Cloud Storage API whether a bucket has a hierarchical namespace.
        mp.setattr(gcs_utils, "is_hierarchical_namespace_enabled", lambda path: False)
        yield
