"""Mode "prepare": the Apache Beam pipeline writes exactly the blocks in-job preparation
cuts, as block shards; training reads them by global index (each process its own
rows), resumes exactly, and reads them from a bucket."""

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time

import hf_tokenizers
import numpy as np
import pytest

from maelm_jax.data import loader, prepare, run_data, shards, sources
from maelm_jax.infra import paths
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.pretrain import train as pretrain_train
from maelm_jax.text import tokenizer as tokenizer_lib
from maelm_jax.workdirs import layout

from conftest import HANG_SECONDS, REPO_ROOT, subprocess_env
from fake_bucket import fake_gcs
from support import log_tail, made_up_documents, train_metrics
from tiny_config import tiny_config

# End-to-end: left out of the fast inner loop (pytest -m "not slow").
pytestmark = pytest.mark.tier("slow")


def _corpus(root):
    """Two sources: three text files (one gzipped) and a JSONL file."""
    documents = made_up_documents(360, seed=1)
    (root / "text").mkdir(parents=True)
    for i in range(3):
        text = "\n\n".join(documents[i * 100:(i + 1) * 100]) + "\n"
        if i == 1:
            (root / "text" / f"part-{i}.txt.gz").write_bytes(gzip.compress(text.encode()))
        else:
            (root / "text" / f"part-{i}.txt").write_text(text)
    (root / "web.jsonl").write_text("".join(json.dumps({"text": d}) + "\n"
                                            for d in documents[300:]))
    return {"books": {"kind": "text", "path": str(root / "text"), "weight": 2.0},
            "web": {"kind": "jsonl", "path": str(root / "web.jsonl"), "weight": 1.0}}


def _config(root, tokenizer_path, **prepare_fields):
    c = tiny_config("maelm", tokenizer_path)
    c.data.sources = _corpus(root)
    c.data.validation_fraction = 0.1
    c.prepare.update(blocks_per_shard=128, **prepare_fields)
    pretrain_config.validate(c)
    return pretrain_config.resolve_paths(c)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_tokenizer):
    """The corpus prepared by Beam (DirectRunner, two worker processes) and in the job."""
    from apache_beam.runners.portability import prism_runner

    root = tmp_path_factory.mktemp("prepare")
    c = _config(root, tiny_tokenizer.model_path, num_workers=2)
    tried = []  # Beam's DirectRunner would try Prism first (a download from GitHub)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prism_runner.PrismRunner, "run_pipeline",
                      lambda *args, **kwargs: tried.append(args) or 1 / 0)
        manifest = prepare.run(c, str(root / "shards"))
    assert not tried, "the DirectRunner's preparation tried Prism"
    in_job = run_data.build_blocks(c, paths.Path(root / "job"), tiny_tokenizer)
    return root, c, manifest, in_job


def test_beam_writes_exactly_the_blocks_of_in_job_preparation(prepared):
    root, c, manifest, in_job = prepared
    data = shards.load(root / "shards", run_data.source_weights(c))
    assert manifest["fingerprint"] == in_job.directory.name  # the same inputs, hashed alike
    assert data.weights == {"books": 2.0, "web": 1.0}
    for split in ("train", "valid"):
        for name in ("books", "web"):
            want = np.asarray(getattr(in_job, split)[name])
            got = getattr(data, split)[name]
            assert len(got) == len(want) > 0, (split, name)
            np.testing.assert_array_equal(got[:], want)
            assert got.shape == want.shape and got.dtype == want.dtype
            np.testing.assert_array_equal(got[len(want) - 1], want[-1])
            np.testing.assert_array_equal(got[[5, 0, 2]], want[[5, 0, 2]])
    # One format: the in-job set is the same files and the same manifest, byte for byte
    # (but the Beam run's seconds).
    in_job_manifest = shards.read_manifest(in_job.directory)
    assert in_job_manifest == {k: v for k, v in manifest.items() if k != "seconds"}
    for entry in shards._entries(manifest):
        assert (in_job.directory / entry["file"]).read_bytes() == (
            root / "shards" / entry["file"]).read_bytes()
    books = manifest["sources"]["books"]["train"]
    assert len(books["shards"]) > 1  # several shards, read as one sequence
    assert all(s["blocks"] == 128 for s in books["shards"][:-1])
    assert books["documents"] > 0 and books["tokens"] > books["blocks"] * (c.data.seq_len - 1)
    assert (root / "shards" / layout.TOKENIZER_FILE).read_bytes() == paths.Path(
        c.tokenizer.model_path).read_bytes()
    assert not (root / "shards" / prepare.NOTES).exists()
    assert layout.unexpected_entries(root / "shards", "prepare") == []


def test_a_second_prepare_keeps_what_is_there_and_another_corpus_is_refused(prepared):
    root, c, manifest, _ = prepared
    assert prepare.run(c, str(root / "shards")) == shards.read_manifest(root / "shards")
    other = c.copy_and_resolve_references()
    other.data.validation_fraction = 0.2
    with pytest.raises(shards.PreparedDataError, match="holds another preparation"):
        prepare.run(other, str(root / "shards"))


def _recording(data):
    """`data` whose blocks note every index read (per source, on each object)."""
    for blocks in data.train.values():
        blocks.__class__ = _Recording
        blocks.read = []
    return data


class _Recording(shards.ShardedBlocks):
    def __getitem__(self, index):
        keys = np.arange(len(self))[index] if isinstance(index, slice) else np.atleast_1d(index)
        self.read.extend(int(k) for k in keys)
        return super().__getitem__(index)


def test_each_process_reads_only_its_rows(prepared):
    """Two processes' halves of every global batch: each the rows a single process has
    there, and every block a half reads is one it delivers (soon: prefetching reads a few
    steps ahead), never one of the other half's rows. Each half has its own data, as a
    process has (a half's prefetching thread would otherwise read on into the other's
    record)."""
    root, c, _, _ = prepared
    weights = run_data.source_weights(c)
    data = shards.load(root / "shards", weights)
    whole = loader.train_batches(data, 8, seed=3)
    batches = [next(whole) for _ in range(12)]
    # Which block a row is, by content (the blocks of this corpus are all distinct).
    key_of = {bytes(np.asarray(b, np.int32)): (name, i)
              for name, blocks in data.train.items() for i, b in enumerate(blocks[:])}
    for start in (0, 4):
        own = _recording(shards.load(root / "shards", weights))
        half = loader.train_batches(own, 8, seed=3, spans=[(start, start + 4)])
        rows = [next(half) for _ in range(3)]
        for step in range(3):
            np.testing.assert_array_equal(rows[step], batches[step][start:start + 4])
        read = {(name, i) for name, blocks in own.train.items() for i in list(blocks.read)}
        delivered = {key_of[bytes(row)] for b in batches for row in b[start:start + 4]}
        assert len(read) >= 12 and read <= delivered, read - delivered


def test_training_resumes_exactly_from_shards(prepared, tmp_path, tiny_tokenizer):
    root, c, _, _ = prepared
    c = c.copy_and_resolve_references()
    c.data.prepared = str(root / "shards")
    c.train.update(num_steps=6, checkpoint_every=3, eval_every=3, log_every=1)
    pretrain_train.train_and_evaluate(c, str(tmp_path / "straight"))
    c.train.num_steps = 3
    pretrain_train.train_and_evaluate(c, str(tmp_path / "stopped"))
    c.train.num_steps = 6
    pretrain_train.train_and_evaluate(c, str(tmp_path / "stopped"))
    straight, resumed = train_metrics(tmp_path / "straight"), train_metrics(tmp_path / "stopped")
    assert sorted(resumed) == list(range(1, 7))
    for step in range(1, 7):  # the same program on the same machine: the same numbers
        assert resumed[step]["loss"] == straight[step]["loss"], step
    assert (tmp_path / "straight" / "tokenizer.model").read_bytes() == (
        root / "shards" / layout.TOKENIZER_FILE).read_bytes()
    assert not (tmp_path / "straight" / "data").exists()  # nothing prepared in the job


def test_two_processes_read_disjoint_rows_of_the_shards(prepared, tmp_path):
    """Two processes on localhost train from the prepared directory alone (the config's
    sources are not read: here they do not even exist) and say which rows they read."""
    root, _, _, _ = prepared
    common = [sys.executable, "main.py", "--config=tests/tiny_config.py",
              f"--config.data.prepared={root / 'shards'}",
              "--config.data.sources.main.kind=text",
              f"--config.data.sources.main.path={tmp_path / 'not_here.txt'}",
              "--config.data.validation_fraction=0.1",  # as prepared
              "--config.train.num_steps=2", "--config.mesh.shape=(4,2,1)",
              f"--workdir={tmp_path / 'multi'}"]
    port = _free_port()
    procs = [subprocess.Popen(common + [f"--coordinator_address=127.0.0.1:{port}",
                                        "--num_processes=2", f"--process_id={i}"],
                              cwd=REPO_ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=subprocess_env(4))
             for i in range(2)]
    outputs = [p.communicate(timeout=HANG_SECONDS)[0] for p in procs]
    rows = []
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, log_tail(out)
        [(start, end)] = re.findall(r"reads rows \[(\d+), (\d+)\) of every global batch of 8 "
                                    r"\(the shards of ", out)
        rows.append(range(int(start), int(end)))
    assert sorted(i for r in rows for i in r) == list(range(8))  # disjoint, all of the batch
    assert sorted(train_metrics(tmp_path / "multi")) == [1, 2]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_shards_in_a_bucket(prepared, tmp_path, tiny_tokenizer):
    """Inputs into a bucket (the in-process runner: the fake bucket lives in this
    process), then read from it: the same blocks, by ranged reads."""
    root, c, _, in_job = prepared
    c = c.copy_and_resolve_references()
    c.prepare.num_workers = 1
    (tmp_path / "gcs" / "bucket").mkdir(parents=True)
    with fake_gcs(tmp_path / "gcs"):
        prepare.run(c, "gs://bucket/prepared")
        data = shards.load("gs://bucket/prepared")
        np.testing.assert_array_equal(data.train["books"][:], np.asarray(in_job.train["books"]))
    assert (tmp_path / "gcs" / "bucket" / "prepared" / layout.MANIFEST_FILE).is_file()


def test_the_throughput_benchmark_runs_and_records(prepared, tmp_path):
    root, _, _, _ = prepared
    run = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "prepare_throughput.py"),
         f"--corpus={root / 'text'}", "--kind=text", "--vocab_size=300", "--seq_len=32",
         "--workers=2", f"--record_dir={tmp_path}"], cwd=REPO_ROOT.parent,
        env=subprocess_env(), capture_output=True, text=True, timeout=HANG_SECONDS, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert any(line.startswith("in-job (1 process)") and "tokens/s per core" in line
               for line in lines), run.stdout
    assert any(line.startswith("Beam (2 workers)") and "peak" in line for line in lines)
    assert any(line.startswith("160 GB of text") for line in lines)
    # Its record, for the generated tables: the two paths' figures and the machine.
    [path] = (tmp_path / "prepare_throughput").glob("*.json")
    record = json.loads(path.read_text())
    assert record["benchmark"] == "prepare_throughput" and record["workers"] == 2
    assert record["paths"]["job"]["tokens"] == record["paths"]["beam"]["tokens"] > 0
    assert record["machine"]["cores"] and record["machine"]["matmul_gflops"] > 0
    assert record["corpus"] == {"name": "text", "bytes": sum(
        f.stat().st_size for f in (root / "text").iterdir()), "files": 3}


def test_a_damaged_file_is_one_line_and_leaves_nothing(prepared, tmp_path):
    root, c, _, _ = prepared
    c = c.copy_and_resolve_references()
    bad = tmp_path / "corpus"
    bad.mkdir()
    (bad / "good.txt").write_text((root / "text" / "part-0.txt").read_text())
    packed = gzip.compress((root / "text" / "part-2.txt").read_bytes())
    (bad / "cut.txt.gz").write_bytes(packed[:len(packed) // 2])
    c.data.sources = {"books": {"kind": "text", "path": str(bad)}}
    with pytest.raises(shards.PreparedDataError,
                       match=r"^\S+cut.txt.gz: cannot read past line \d+ .*truncated gzip file\?$"):
        prepare.run(c, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def _copy(prepared, tmp_path):
    import shutil

    root, _, manifest, _ = prepared
    copy = tmp_path / "shards"
    shutil.copytree(root / "shards", copy)
    first = manifest["sources"]["books"]["train"]["shards"][0]["file"]
    return copy, copy / first


def _main(prepared_dir, workdir, *flags):
    return subprocess.run(
        [sys.executable, "main.py", "--config=tests/tiny_config.py",
         f"--config.data.prepared={prepared_dir}", "--config.data.validation_fraction=0.1",
         "--config.train.num_steps=2", f"--workdir={workdir}", *flags],
        cwd=REPO_ROOT, env=subprocess_env(1), capture_output=True, text=True,
        timeout=HANG_SECONDS)


@pytest.mark.parametrize("flag, message", [
    ("--config.data.seq_len=64",
     r"config.data.seq_len: 64, but config.data.prepared \S+ was prepared with 32"),
    ("--config.tokenizer.vocab_size=600",
     r"config.tokenizer.vocab_size: 600, but config.data.prepared \S+ was prepared with 512"),
    ("--config.data.validation_fraction=0.2",
     r"config.data.validation_fraction: 0.2, but config.data.prepared \S+ was prepared "
     r"with 0.1"),
])
def test_shards_that_do_not_fit_the_run_are_one_line(prepared, tmp_path, flag, message):
    root, _, _, _ = prepared
    run = _main(root / "shards", tmp_path / "run", flag)
    assert run.returncode == 1, run.stderr[-2000:]
    assert re.search(message, run.stderr) and "Traceback" not in run.stderr
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.parametrize("damage, message", [
    (lambda path: path.write_bytes(path.read_bytes()[:-100]),
     r"shard \S+-00000-of-\d+.blocks is \d+ bytes, its manifest says \d+"),
    (lambda path: path.unlink(), r"shard \S+-00000-of-\d+.blocks is missing"),
    (lambda path: path.write_bytes(_flipped(path.read_bytes())),
     r"shard \S+-00000-of-\d+.blocks does not match its SHA-256"),
])
def test_a_damaged_or_missing_shard_is_found_before_training(prepared, tmp_path, damage,
                                                             message):
    copy, shard = _copy(prepared, tmp_path)
    damage(shard)
    run = _main(copy, tmp_path / "run")
    assert run.returncode == 1, run.stderr[-2000:]
    assert re.search(message, run.stderr) and "Traceback" not in run.stderr
    assert not (tmp_path / "run").exists()


def _flipped(data: bytes) -> bytes:
    """The same bytes with a few in the middle changed (the size stays)."""
    middle = len(data) // 2
    return data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 8]) + data[middle + 8:]


def test_a_damaged_shard_of_a_large_set_is_named_when_read(prepared, tmp_path, monkeypatch):
    """Too large to hash up front: the damaged block stops the run with one line naming its
    file (each block's own CRC-32), not a library traceback."""
    from maelm_jax.infra import errors

    root, c, _, _ = prepared
    copy, shard = _copy(prepared, tmp_path)
    shard.write_bytes(_flipped(shard.read_bytes()))
    monkeypatch.setattr(shards, "DIGEST_UP_FRONT_BYTES", 0)
    data = shards.load(copy)
    with pytest.raises(errors.UserError, match=rf"shard {re.escape(str(shard))} is damaged"):
        np.asarray(data.train["books"][:])
    # And a run reading it (through the loader's prefetching) stops with the same line.
    run_config = tiny_config("maelm")
    run_config.data.prepared, run_config.data.validation_fraction = str(copy), 0.1
    run_config.train.num_steps = 50
    with pytest.raises(errors.UserError, match=rf"shard {re.escape(str(shard))} is damaged"):
        pretrain_train.train_and_evaluate(run_config, str(tmp_path / "run"))


def test_a_failed_prepare_is_one_line_not_the_workers_tracebacks(prepared, tmp_path):
    """Through main.py with two Beam worker processes: the damaged file's one line, not
    the tracebacks each worker prints, and nothing written."""
    root, _, _, _ = prepared
    bad = tmp_path / "corpus"
    bad.mkdir()
    (bad / "good.txt").write_text((root / "text" / "part-0.txt").read_text())
    packed = gzip.compress((root / "text" / "part-2.txt").read_bytes())
    (bad / "cut.txt.gz").write_bytes(packed[:len(packed) // 2])
    run = subprocess.run(
        [sys.executable, "main.py", "--config=tests/tiny_config.py", "--config.mode=prepare",
         f"--workdir={tmp_path / 'out'}", "--config.data.sources.main.kind=text",
         f"--config.data.sources.main.path={bad}", "--config.prepare.num_workers=2",
         f"--config.tokenizer.model_path={root / 'shards' / layout.TOKENIZER_FILE}"],
        cwd=REPO_ROOT, env=subprocess_env(1), capture_output=True, text=True,
        timeout=HANG_SECONDS)
    assert run.returncode == 1, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert re.search(r"error: \S+cut.txt.gz: cannot read past line \d+ .*truncated gzip file\?$",
                     run.stderr.strip().splitlines()[-1])
    assert not (tmp_path / "out").exists()


def test_prepare_refuses_a_pretraining_runs_workdir(prepared, tmp_path):
    """Through main.py: --config.mode=prepare pointed at a pretraining run's workdir is one
    line, status 1, and neither a manifest nor a shard lands beside its checkpoints."""
    root, _, _, _ = prepared
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.json").write_text('{"objective": "mlm"}')
    run = subprocess.run(
        [sys.executable, "main.py", "--config=tests/tiny_config.py", "--config.mode=prepare",
         f"--workdir={run_dir}", "--config.data.sources.main.kind=text",
         f"--config.data.sources.main.path={root / 'text'}",
         f"--config.tokenizer.model_path={root / 'shards' / layout.TOKENIZER_FILE}"],
        cwd=REPO_ROOT, env=subprocess_env(1), capture_output=True, text=True,
        timeout=HANG_SECONDS)
    assert run.returncode == 1, run.stderr[-3000:]
    assert run.stderr.strip().splitlines()[-1] == (
        f"error: --workdir {run_dir} holds a pretrain run; prepare into another directory")
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "config.json"]


def test_a_second_preparation_is_refused_and_a_ctrl_c_leaves_nothing(prepared, tmp_path):
    """Through main.py, a preparation with two Beam worker processes: the same command
    started while it runs is refused in one line naming it (one writer per prepared set),
    and a Ctrl-C at the terminal (to the whole process group, the workers too) ends it with
    status 130, one line and no traceback (the workers' held back), and no directory."""
    root, _, _, _ = prepared
    out = tmp_path / "out"
    cmd = [sys.executable, "main.py", "--config=tests/tiny_config.py", "--config.mode=prepare",
           f"--workdir={out}", "--config.data.sources.main.kind=text",
           f"--config.data.sources.main.path={root / 'text'}",
           "--config.prepare.num_workers=2",
           f"--config.tokenizer.model_path={root / 'shards' / layout.TOKENIZER_FILE}"]
    first = subprocess.Popen(cmd, cwd=REPO_ROOT, env=subprocess_env(1), text=True,
                             stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + HANG_SECONDS
    while not (out / "notes").exists():  # its Beam pipeline is starting
        assert first.poll() is None and time.monotonic() < deadline, "finished or hung"
        time.sleep(0.01)
    os.killpg(first.pid, signal.SIGSTOP)  # still running, whatever the machine's speed
    try:
        second = subprocess.run(cmd, cwd=REPO_ROOT, env=subprocess_env(1), text=True,
                                capture_output=True, timeout=HANG_SECONDS)
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    assert second.returncode == 1, second.stderr[-3000:]
    assert second.stderr.count("\n") == 1, second.stderr[-3000:]
    assert f"is in use by process {first.pid} on " in second.stderr
    os.killpg(first.pid, signal.SIGINT)  # Ctrl-C
    _, stderr = first.communicate(timeout=HANG_SECONDS)
    assert first.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith("interrupted (Ctrl-C)")
    assert not out.exists()


def test_the_workers_cut_with_a_hugging_face_tokenizer_and_its_ids(tmp_path):
    """prepare's tokenising worker rebuilds a tokenizer.json from its bytes (as Beam sends
    it) and ends each document with that tokenizer's EOS ([SEP] of BERT's layout)."""
    path = hf_tokenizers.bert_like(made_up_documents(200), tmp_path / "tokenizer.json")
    tok = tokenizer_lib.load_tokenizer(str(path))
    (tmp_path / "corpus.txt").write_text("The first document.\n\nAnd the second one.\n")
    source = {"kind": "text", "path": [str(tmp_path / "corpus.txt")],
              "doc_separator": "blank_line"}
    worker = prepare._Tokenise((path.read_bytes(), str(path)), 0.0, "replace",
                               str(tmp_path / "notes"))
    (tmp_path / "notes").mkdir()
    worker.setup()
    item = ("main", 0, sources.source_settings(source))
    cut = [tokens for _, (_, _, tokens) in worker.process(item)]
    assert [t.tolist() for t in cut] == [ids + [tok.special.eos] for ids in tok.encode(
        ["The first document.", "And the second one."])]
