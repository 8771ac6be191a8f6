"""maelm_jax/infra/paths.py: which paths are accepted, and the local behaviour of its helpers
(tests/test_cloud_paths.py runs whole runs in a fake bucket)."""

import importlib.util
import os
import stat
import threading

import pytest

from maelm_jax.infra import errors, paths
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.pretrain import train as pretrain_train

from tiny_config import tiny_config

pytestmark = pytest.mark.tier("unit")


def test_local_paths_are_made_absolute_and_uris_are_left_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert paths.absolute("runs/a") == str(tmp_path / "runs" / "a")
    assert paths.absolute("") == ""
    assert paths.is_uri("gs://b/x") and paths.is_local("/b/x")
    assert [str(p) for p in paths.lineage(paths.Path("gs://b/x/y"))] == [
        "gs://b/x/y", "gs://b/x", "gs://b"]
    assert paths.contains(tmp_path, tmp_path / "a" / "b")
    assert not paths.contains(tmp_path / "a", tmp_path)
    assert not paths.contains("gs://b/x", str(tmp_path))


def test_write_atomically_leaves_no_temporary_file(tmp_path):
    target = paths.Path(tmp_path) / "new" / "file.json"
    paths.write_atomically(target, "{}")
    paths.write_atomically(target, b"[1]")
    assert target.read_bytes() == b"[1]"
    assert [p.name for p in (tmp_path / "new").iterdir()] == ["file.json"]


def test_a_reader_sees_the_old_text_or_the_new_never_a_part(tmp_path):
    """Another process of the job may read a file (config.json) while process 0 rewrites
    it: every read is whole."""
    target = paths.Path(tmp_path) / "config.json"
    texts = ["a" * 2**20, "b" * 2**21]
    paths.write_text(target, texts[0])
    seen, done = set(), threading.Event()

    def read():
        while not done.is_set():
            seen.add(len(paths.read_text(target)))

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(60):
        paths.write_text(target, texts[i % 2])
    done.set()
    reader.join()
    assert seen <= {len(t) for t in texts}
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_files_written_get_the_permissions_the_umask_gives(tmp_path):
    old = os.umask(0o027)
    try:
        paths.write_text(paths.Path(tmp_path) / "results.json", "{}")
        paths.write_atomically(paths.Path(tmp_path) / "tokenizer.model", b"x")
    finally:
        os.umask(old)
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()} == {
        "results.json": 0o640, "tokenizer.model": 0o640}


def test_a_local_mirror_is_the_directory_itself(tmp_path):
    mirror = paths.LocalMirror(paths.Path(tmp_path))
    (mirror.local / "metrics.jsonl").write_text("{}\n")
    mirror.close()
    assert (tmp_path / "metrics.jsonl").read_text() == "{}\n"


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None,
                    reason="gcsfs is installed: gs:// paths are usable")
def test_without_gcsfs_a_bucket_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(errors.UserError,
                       match=r"^--workdir: gs://bucket/run: gs:// paths need the gcsfs package "
                             r"\(pip install -r requirements-gcs.txt\)$"):
        pretrain_train.train_and_evaluate(tiny_config(), "gs://bucket/run")
    assert list(tmp_path.iterdir()) == []


def test_other_object_stores_are_refused_in_one_line():
    c = tiny_config()
    c.tokenizer.model_path = "s3://bucket/tokenizer.model"
    with pytest.raises(errors.UserError, match=r"^config.tokenizer.model_path: "
                                               r"s3://bucket/tokenizer.model: s3:// is not "
                                               r"supported; use a local path or gs://$"):
        pretrain_config.resolve_paths(c)
