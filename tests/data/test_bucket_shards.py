"""Inputs shards in a real Cloud Storage protocol (tests/gcs_emulator.py): a host reads
only the blocks it is asked for, by ranged reads, keeps them in a bounded local cache, and
names a damaged block's object; a run whose workdir and prepared data are in the bucket
is killed and resumes exactly (Orbax's checkpoints through TensorStore's gcs driver)."""

import json
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from maelm_jax.data import shards
from maelm_jax.workdirs import layout

from conftest import HANG_SECONDS, REPO_ROOT, subprocess_env
from gcs_emulator import emulator
from support import log_tail

pytestmark = pytest.mark.tier("integration")

SEQ_LEN, SHARD_BLOCKS, SHARDS = 64, 512, 3


def _prepared_set(directory):
    """Three shards of one source ([1536, 64] int32 blocks, each block's tokens its own
    index and position) and their manifest, written locally; returns the blocks."""
    directory.mkdir()
    blocks = (np.arange(SHARDS * SHARD_BLOCKS)[:, None] * 1000
              + np.arange(SEQ_LEN)).astype(np.int32)
    entries = []
    for i in range(SHARDS):
        name = shards.shard_name("train", "a", i, SHARDS)
        shards.write_shard(directory / name, blocks[i * SHARD_BLOCKS:(i + 1) * SHARD_BLOCKS])
        size, digest = shards.file_digest(directory / name)
        entries.append({"file": name, "blocks": SHARD_BLOCKS, "bytes": size, "sha256": digest})
    manifest = {"format": shards.FORMAT, "fingerprint": "f" * 16, "dtype": "int32",
                "seq_len": SEQ_LEN, "sources": {"a": {"train": {"shards": entries},
                                                      "valid": {"shards": []}}}}
    (directory / layout.MANIFEST_FILE).write_text(json.dumps(manifest))
    return blocks


# Uploads the set, then reads it through shards.load as training does, counting the bytes
# the ranged reads fetch; prints what it saw.
_READER = """
import json, os, pathlib, sys
import numpy as np
from maelm_jax.infra import paths, errors
from maelm_jax.data import shards
local, limit = pathlib.Path(sys.argv[1]), int(sys.argv[2])
for f in sorted(local.iterdir()):
    paths.upload(f, paths.Path("gs://bkt/prepared") / f.name)
fetched, real = [], paths.read_ranges
def counting(uri, starts, ends):
    fetched.append(sum(e - s for s, e in zip(starts, ends)))
    return real(uri, starts, ends)
paths.read_ranges = counting
manifest = shards.read_manifest(paths.Path("gs://bkt/prepared"))
shards.verify_shards(paths.Path("gs://bkt/prepared"), manifest)
blocks = shards.load("gs://bkt/prepared", cache_bytes=limit).train["a"]
keys = [5, 700, 6, 1535, 7, 700]
out = {"got": blocks[keys][:, 0].tolist()}
out["first"] = sum(fetched); fetched.clear()
out["again_same"] = blocks[keys][:, 0].tolist(); out["again"] = sum(fetched); fetched.clear()
whole = blocks[:]
out["all"] = bool((whole[:, 0] == np.arange(len(whole)) * 1000).all())
cache = pathlib.Path(os.environ["MAELM_JAX_CACHE"], "prepared", "f" * 16)
out["cached"] = sum(f.stat().st_blocks * 512 for f in cache.iterdir())
# One block damaged in the bucket (a byte of its tokens flipped), read without a cache.
name = manifest["sources"]["a"]["train"]["shards"][1]["file"]
data = bytearray(local.joinpath(name).read_bytes())
data[7 * blocks._rec.itemsize + 3] ^= 0xFF
paths.Path("gs://bkt/prepared", name).write_bytes(bytes(data))
try:
    shards.load("gs://bkt/prepared", cache_bytes=0).train["a"][[512 + 7]]
except errors.UserError as e:
    out["damaged"] = str(e)
paths.Path("gs://bkt/prepared", name).write_bytes(bytes(data[:-10]))
try:
    shards.verify_shards(paths.Path("gs://bkt/prepared"), manifest)
except errors.UserError as e:
    out["short"] = str(e)
print("RESULT", json.dumps(out), flush=True)
"""


def test_a_host_reads_its_blocks_by_ranges_through_a_bounded_cache(tmp_path):
    blocks = _prepared_set(tmp_path / "local")
    record = SEQ_LEN * 4 + 4
    limit = 2 * SHARD_BLOCKS * record  # two of the three shards
    with emulator("bkt") as env:
        env = dict(env, MAELM_JAX_CACHE=str(tmp_path / "cache"), **{
            k: v for k, v in subprocess_env().items() if k in ("PYTHONPATH", "XLA_FLAGS")})
        run = subprocess.run([sys.executable, "-c", _READER, str(tmp_path / "local"),
                              str(limit)], cwd=REPO_ROOT, env=env, capture_output=True,
                             text=True, timeout=HANG_SECONDS)
    assert run.returncode == 0, log_tail(run.stdout + run.stderr)
    out = json.loads(next(line for line in run.stdout.splitlines()
                          if line.startswith("RESULT"))[len("RESULT "):])
    keys = [5, 700, 6, 1535, 7, 700]
    assert out["got"] == out["again_same"] == blocks[keys][:, 0].tolist()
    assert out["first"] == 5 * record  # the five distinct blocks asked for, nothing more
    assert out["again"] == 0  # then from the cache
    assert out["all"]
    assert out["cached"] <= limit + 4096  # the least recently used shard was dropped
    name = shards.shard_name("train", "a", 1, SHARDS)
    assert out["damaged"] == (f"config.data.prepared: shard gs://bkt/prepared/{name} is "
                              "damaged (block 7 fails its checksum); prepare again")
    assert re.fullmatch(rf"config.data.prepared: shard gs://bkt/prepared/{name} is "
                        rf"{SHARD_BLOCKS * record - 10} bytes, its manifest says "
                        rf"{SHARD_BLOCKS * record}: damaged or cut short; prepare again",
                        out["short"]), out["short"]


# Prints a file of the bucket (or uploads a local directory into it: "put <dir> <uri>").
_BUCKET_TOOL = """
import pathlib, sys
from maelm_jax.infra import paths
if sys.argv[1] == "put":
    for f in sorted(pathlib.Path(sys.argv[2]).iterdir()):
        paths.upload(f, paths.Path(sys.argv[3]) / f.name)
else:
    print(paths.Path(sys.argv[2]).read_text(), end="")
"""


def _bucket(env, *args) -> str:
    run = subprocess.run([sys.executable, "-c", _BUCKET_TOOL, *args], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=HANG_SECONDS)
    assert run.returncode == 0, log_tail(run.stderr)
    return run.stdout


def _losses(env, workdir: str) -> dict[int, float]:
    records = map(json.loads, _bucket(env, "cat", f"{workdir}/metrics.jsonl").splitlines())
    return {r["step"]: r["loss"] for r in records if r["split"] == "train"}


@pytest.mark.slow
def test_a_run_in_the_bucket_is_killed_and_resumes_exactly(tmp_path, tiny_tokenizer):
    """Workdir and prepared shards in the bucket: SIGKILL between checkpoints, run the same
    command again; every loss is the uninterrupted run's."""
    from maelm_jax.data import prepare
    from maelm_jax.pretrain import config as pretrain_config

    from support import made_up_documents
    from tiny_config import tiny_config

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(made_up_documents(300, seed=3)) + "\n")
    c = tiny_config("maelm", tiny_tokenizer.model_path)
    c.data.sources = {"main": {"kind": "text", "path": str(corpus)}}
    c.prepare.update(num_workers=1, blocks_per_shard=64)
    pretrain_config.validate(c)
    prepare.run(pretrain_config.resolve_paths(c), str(tmp_path / "prepared"))
    steps = 30
    command = [sys.executable, "main.py", "--config=tests/tiny_config.py",
               "--config.data.prepared=gs://bkt/prepared", f"--config.train.num_steps={steps}",
               "--config.train.checkpoint_every=5", "--config.train.eval_every=10"]
    with emulator("bkt") as env:
        env = dict(env, **{k: v for k, v in subprocess_env().items()
                           if k in ("PYTHONPATH", "XLA_FLAGS")})
        _bucket(env, "put", str(tmp_path / "prepared"), "gs://bkt/prepared")
        full = subprocess.run(command + ["--workdir=gs://bkt/full"], cwd=REPO_ROOT, env=env,
                              capture_output=True, text=True, timeout=HANG_SECONDS)
        assert full.returncode == 0, log_tail(full.stderr)
        log_path = tmp_path / "killed.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(command + ["--workdir=gs://bkt/killed"], cwd=REPO_ROOT,
                                    env=env, stdout=subprocess.DEVNULL, stderr=log)
            deadline = time.monotonic() + HANG_SECONDS
            while "[train] step 17 " not in log_path.read_text():
                assert proc.poll() is None, log_tail(log_path.read_text())
                assert time.monotonic() < deadline
                time.sleep(0.01)
            proc.send_signal(signal.SIGKILL)
            assert proc.wait() == -signal.SIGKILL
        again = subprocess.run(command + ["--workdir=gs://bkt/killed"], cwd=REPO_ROOT,
                               env=env, capture_output=True, text=True, timeout=HANG_SECONDS)
        assert again.returncode == 0, log_tail(again.stderr)
        [resumed] = re.findall(r"resumed from checkpoint at step (\d+)", again.stderr)
        assert 10 <= int(resumed) < steps
        reference, after = _losses(env, "gs://bkt/full"), _losses(env, "gs://bkt/killed")
    assert sorted(after) == sorted(reference) == list(range(1, steps + 1))
    for step in range(1, steps + 1):  # the same program on the same machine
        assert after[step] == reference[step], step
