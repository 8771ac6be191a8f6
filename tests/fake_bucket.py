"""A stand-in for Google Cloud Storage: ``gs://<bucket>/<object>`` on a local directory.

`fake_gcs(root)` makes every ``gs://`` path in the process land under ``root/<bucket>/``,
through the same doors a real run uses: fsspec's ``gs``/``gcs`` protocol (which
etils.epath uses without TensorFlow, in place of gcsfs) and, for orbax's arrays,
TensorStore's kvstore (its ``gcs`` driver replaced by the ``file`` driver). Like a
bucket, it has no directories of their own: creating one does nothing, and one appears
with its first object. Test-only: nothing of it belongs in maelm_jax.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pathlib

import pytest
from etils.epath import backend as epath_backend
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem
from orbax.checkpoint._src.path import gcs_utils


def _bucket_filesystem(root: pathlib.Path) -> type:
    class FakeGCSFileSystem(DirFileSystem):
        protocol = ("gs", "gcs")

        def __init__(self, *args, **storage_options):
            # gcsfs's options (finalize_on_close, project, ...) mean nothing here.
            super().__init__(path=str(root), fs=LocalFileSystem(auto_mkdir=True))

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
