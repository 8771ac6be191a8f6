r"""Preparation throughput: in-job packing against the Beam pipeline of mode "prepare".

    python benchmarks/prepare_throughput.py --corpus=/data/wiki_large \
        [--kind=wikiextractor --seq_len=128 --vocab_size=8192 --workers=2 --parquet]

Trains one tokenizer on the corpus (not timed; both paths use it), then, each in a fresh
process so that peak memory is its own: the in-job path (maelm_jax/data/run_data.py, one
process, what a training job does when the cache is cold) and mode "prepare" with the
DirectRunner and --workers worker processes. Printed per path: wall seconds, tokens/s in
total and per core used, and peak resident memory (the process's, and its children's: the
Beam workers). Both write the same blocks (tests/data/test_prepare.py); the extrapolation to
16 GB and 160 GB of text assumes the measured tokens per byte and linear scaling with
cores, which the per-file work items allow and the single-process in-job path does not.

With --parquet the corpus's documents (as its kind reads them) are also written as Parquet,
one file per corpus file (zstd, --row_group rows per row group; not timed), and mode
"prepare" runs on them too: the same documents, tokenizer and workers, so the ratio of the
two Beam rates is the cost of reading Parquet instead of text (the token counts must agree).

Each run writes its record (recording.py) to --record_dir (default benchmarks/results/; ""
writes none); the tables of README.md and docs/ are generated from the committed ones
(`python benchmarks/tables.py`).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from benchmarks import recording
from maelm_jax.infra import cli

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("corpus", None, "A corpus path (file, directory or glob).")
    flags.DEFINE_string("kind", "wikiextractor", "Its source kind (maelm_jax/data/sources.py).")
    flags.DEFINE_integer("seq_len", 128, "Block length.", lower_bound=2)
    flags.DEFINE_integer("vocab_size", 8192, "Tokenizer size.", lower_bound=262)
    flags.DEFINE_integer("workers", os.cpu_count() or 1, "Beam worker processes.",
                         lower_bound=1)
    flags.DEFINE_bool("parquet", False, "Also time mode 'prepare' on the corpus as Parquet.")
    flags.DEFINE_integer("row_group", 8192, "Rows per Parquet row group (--parquet).",
                         lower_bound=1)
    recording.define_flag("prepare_throughput")
    flags.DEFINE_string("child", "", "Internal: 'job' or 'beam', and the output directory.")
    flags.DEFINE_string("tokenizer", "", "Internal: the tokenizer both paths use.")
    flags.mark_flag_as_required("corpus")


def _config(tokenizer: str):
    from maelm_jax.pretrain import config as pretrain_config

    c = pretrain_config.pretrain_defaults()
    c.data.sources = {"main": {"kind": FLAGS.kind, "path": FLAGS.corpus}}
    c.data.seq_len = FLAGS.seq_len
    c.tokenizer.vocab_size = FLAGS.vocab_size
    c.tokenizer.model_path = tokenizer
    c.prepare.num_workers = FLAGS.workers
    pretrain_config.validate(c)
    return pretrain_config.resolve_paths(c)


def _child(path: str, out: str) -> None:
    from maelm_jax.data import run_data, shards
    from maelm_jax.infra import paths

    c = _config(FLAGS.tokenizer)
    start = time.perf_counter()
    if path == "job":
        tok = run_data.setup_tokenizer(c, paths.Path(out))
        data = run_data.build_blocks(c, paths.Path(out), tok)
        manifest = shards.read_manifest(data.directory)
    else:
        from maelm_jax.data import prepare

        manifest = prepare.run(c, out)
    tokens = sum(manifest["sources"]["main"][s]["tokens"] for s in ("train", "valid"))
    seconds = time.perf_counter() - start
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            + resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 2 ** 20  # kB -> GB
    print(json.dumps({"seconds": seconds, "tokens": tokens, "peak_gb": peak}))


def _write_parquet(files: list[str], out: str) -> int:
    """Writes each corpus file's documents to out/NNNNN.parquet; returns the bytes written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from maelm_jax.data import sources

    os.makedirs(out)
    schema = pa.schema([("text", pa.string())])
    for i, path in enumerate(files):
        target = os.path.join(out, f"{i:05d}.parquet")
        with pq.ParquetWriter(target, schema, compression="zstd") as writer:
            rows: list[str] = []
            for document in sources.iter_documents({"kind": FLAGS.kind, "path": path}):
                rows.append(document)
                if len(rows) == FLAGS.row_group:
                    writer.write_table(pa.table({"text": rows}, schema=schema))
                    rows = []
            if rows:
                writer.write_table(pa.table({"text": rows}, schema=schema))
    return sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))


def _run_child(path: str, out: str, tokenizer: str, corpus: str, kind: str) -> dict:
    argv = [sys.executable, sys.argv[0], f"--corpus={corpus}", f"--kind={kind}",
            f"--seq_len={FLAGS.seq_len}", f"--vocab_size={FLAGS.vocab_size}",
            f"--workers={FLAGS.workers}", f"--tokenizer={tokenizer}", f"--child={path},{out}"]
    run = subprocess.run(argv, capture_output=True, text=True, check=False)
    if run.returncode:
        cli.fail(f"the {path} path on {kind} failed: "
                 f"{(run.stderr.strip().splitlines() or ['(no output)'])[-1]}", cli.program())
    return json.loads(run.stdout.strip().splitlines()[-1])


def _print_rate(label: str, r: dict, cores: int) -> None:
    rate = r["tokens"] / r["seconds"]
    print(f"{label:26s} {r['seconds']:7.1f} s  {rate / 1e6:6.2f}M tokens/s  "
          f"{rate / cores / 1e6:6.2f}M tokens/s per core  peak {r['peak_gb']:.2f} GB",
          flush=True)


def main(argv) -> None:
    del argv
    if FLAGS.child:
        path, out = FLAGS.child.split(",", 1)
        _child(path, out)
        return
    from maelm_jax.data import run_data, sources
    from maelm_jax.infra import paths

    try:
        files = sources.resolve_paths(FLAGS.corpus, "--corpus")
    except sources.SourceError as e:
        cli.fail(str(e), cli.program())
    corpus_bytes = sum(os.path.getsize(f) for f in files)
    with tempfile.TemporaryDirectory(prefix="prepare-bench-") as tmp:
        c = _config("")
        start = time.perf_counter()
        tok = run_data.setup_tokenizer(c, paths.Path(tmp))
        print(f"corpus {FLAGS.corpus}: {corpus_bytes / 1e6:.0f} MB; tokenizer "
              f"({FLAGS.vocab_size} pieces) trained in {time.perf_counter() - start:.0f} s "
              f"(not timed below); {os.cpu_count()} CPUs")
        results = {}
        for path, cores in (("job", os.cpu_count() or 1), ("beam", FLAGS.workers)):
            r = results[path] = _run_child(path, f"{tmp}/{path}", tok.model_path,
                                           FLAGS.corpus, FLAGS.kind)
            _print_rate("in-job (1 process)" if path == "job" else f"Beam ({cores} workers)",
                        r, cores)
        print("(in-job: one process, whose sentencepiece encodes on every core, so per core "
              "is over all cores; Beam: one thread per worker. Peak: the driver's resident "
              "memory plus its largest child's.)")
        tokens_per_byte = results["job"]["tokens"] / corpus_bytes
        for size in (16e9, 160e9):
            tokens = size * tokens_per_byte
            job = tokens / (results["job"]["tokens"] / results["job"]["seconds"])  # one host
            per_core = (results["beam"]["tokens"] / results["beam"]["seconds"]) / FLAGS.workers
            print(f"{size / 1e9:.0f} GB of text ~ {tokens / 1e9:.1f}B tokens: in-job "
                  f"{job / 3600:.1f} h; Beam {tokens / per_core / 3600:.1f} core-hours "
                  f"({tokens / per_core / 3600 / 64:.2f} h on 64 cores)")
        if FLAGS.parquet:
            start = time.perf_counter()
            parquet_bytes = _write_parquet(files, f"{tmp}/parquet")
            print(f"as Parquet: {len(files)} files, {parquet_bytes / 1e6:.0f} MB (zstd, "
                  f"{FLAGS.row_group} rows per row group), written in "
                  f"{time.perf_counter() - start:.0f} s (not timed)")
            r = results["parquet"] = _run_child("beam", f"{tmp}/beam-parquet", tok.model_path,
                                                f"{tmp}/parquet", "parquet")
            _print_rate(f"Beam on Parquet ({FLAGS.workers} w.)", r, FLAGS.workers)
            if r["tokens"] != results["beam"]["tokens"]:
                cli.fail(f"Parquet gave {r['tokens']} tokens, the text {results['beam']['tokens']}"
                         ": not the same documents", cli.program())
            ratio = ((r["tokens"] / r["seconds"])
                     / (results["beam"]["tokens"] / results["beam"]["seconds"]))
            print(f"Parquet / text (Beam tokens/s): {ratio:.3f} ({(ratio - 1) * 100:+.1f} %)")
            r["bytes"] = parquet_bytes
        recording.save("prepare_throughput", {
            "corpus": {"name": os.path.basename(os.path.normpath(FLAGS.corpus)),
                       "bytes": corpus_bytes, "files": len(files)},
            "kind": FLAGS.kind, "seq_len": FLAGS.seq_len, "vocab_size": FLAGS.vocab_size,
            "workers": FLAGS.workers, "paths": results})


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.tool_flags_parser)
