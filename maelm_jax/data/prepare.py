"""`prepare` mode: tokenise and pack a corpus into block shards with Apache Beam.

    python main.py --config=configs/pretrain/base.py --config.mode=prepare \
        --workdir=/data/prepared/wiki --config.data.sources.main.kind=wikiextractor \
        --config.data.sources.main.path=/data/wiki
    # then train from it on any number of hosts:
    python main.py --config=configs/pretrain/base.py --workdir=runs/base \
        --config.data.prepared=/data/prepared/wiki

The blocks are exactly those in-job preparation cuts (maelm_jax/data/packing.py: per source
and split, documents joined by </s> in corpus order, blocks of L - 1 tokens after <s>, the
tail dropped), computed as a data-parallel pipeline:

1. one work item per corpus file (a TFDS or built-in source is one item): its documents
   are read (the same readers, cleaning and bounds), split by the hash of their text and
   tokenised: ((source, split), (file, document, tokens + </s>));
2. per source and split, the documents' lengths in corpus order give each its offset in
   the token stream (one integer per document crosses the network);
3. each document cuts its tokens into pieces of the blocks they fall in, keyed by shard;
4. each shard assembles its blocks (the incomplete tail left out) and writes one
   shard file (maelm_jax/data/shards.py), and a note of its block count.

The driver trains the tokenizer first (a capped sample, streamed: `tokenizer.max_sentences`
lines) unless `tokenizer.model_path` names one, and writes `manifest.json` last
(maelm_jax/data/shards.py), so an interrupted preparation is never read.

Runners (`prepare.runner`): "DirectRunner" runs on this machine with
`prepare.num_workers` processes (Beam's FnApiRunner, never Prism: `pipeline_runner`); the
same pipeline runs on Dataflow, Flink or Spark with `prepare.beam_options`, e.g.
("--runner=DataflowRunner", "--project=P", "--region=R", "--temp_location=gs://B/tmp",
"--requirements_file=requirements.txt") and a workdir in a bucket.
"""

from __future__ import annotations

import contextlib
import json
import logging as stdlib_logging
import os
import pathlib
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import apache_beam as beam
import ml_collections
import numpy as np
from absl import logging
from apache_beam.options.pipeline_options import PipelineOptions

from maelm_jax.data import packing, run_data, shards, sources
from maelm_jax.infra import errors, paths
from maelm_jax.text import tokenizer as tokenizer_lib
from maelm_jax.workdirs import guard as workdir_lib
from maelm_jax.workdirs import layout

NOTES = "notes"  # shard and source notes the workers leave for the driver


def work_items(config: ml_collections.ConfigDict) -> list[tuple[str, int, dict]]:
    """(source, item index, the source's settings restricted to the item): a file of a
    file source, or the whole of any other source, in corpus order."""
    items = []
    for name, source in config.data.sources.items():
        settings = sources.source_settings(source, run_data.source_field(name))
        if settings["kind"] in sources.FILE_KINDS:
            files = sources.source_files(settings, run_data.source_field(name))
            items += [(name, i, {**settings, "path": [file]}) for i, file in enumerate(files)]
        else:
            items.append((name, 0, settings))
    return items


class _Tokenise(beam.DoFn):
    """Beam DoFn: one work item's documents, split and tokenised; notes its statistics."""

    def __init__(self, tokenizer_file: tuple[bytes, str], validation_fraction: float,
                 encoding_errors: str, notes_dir: str):
        super().__init__()
        self.tokenizer_file = tokenizer_file  # (its bytes, its path: the kind)
        self.validation_fraction = validation_fraction
        self.encoding_errors = encoding_errors
        self.notes_dir = notes_dir
        self._tok = None

    def setup(self):  # once per worker: the file is a few hundred KB to a few MB
        self._tok = tokenizer_lib.from_bytes(*self.tokenizer_file)

    def process(self, item) -> Iterator[tuple[tuple[str, str], tuple[int, int, np.ndarray]]]:
        name, index, settings = item
        stats = sources.ReadStats()
        counts = {"train": [0, 0], "valid": [0, 0]}  # documents, tokens
        documents = sources.iter_documents(settings, self.encoding_errors, stats)
        position = 0
        for chunk in packing.chunks(documents):
            # One thread: the runner's workers are the parallelism.
            encoded = self._tok.encode(chunk, num_threads=1)
            for text, ids in zip(chunk, encoded, strict=True):
                split = ("valid" if packing.is_validation(text, self.validation_fraction)
                         else "train")
                tokens = np.asarray(ids + [self._tok.special.eos], np.int32)
                counts[split][0] += 1
                counts[split][1] += len(tokens)
                yield (name, split), (index, position, tokens)
                position += 1
        note = {"source": name, "item": index, "counts": counts, "read": vars(stats)}
        paths.write_text(paths.Path(self.notes_dir) / f"source-{name}-{index:06d}.json",
                         json.dumps(note))


def _offsets(keyed) -> Iterator[tuple[tuple[str, str, int, int], int]]:
    """A source and split's documents, (item, document, length), to each one's offset in
    the split's token stream, in corpus order."""
    (name, split), lengths = keyed
    offset = 0
    for item, position, length in sorted(lengths):
        yield (name, split, item, position), offset
        offset += length


def _totals(keyed) -> tuple[tuple[str, str], int]:
    (name, split), lengths = keyed
    return (name, split), sum(length for _, _, length in lengths)


class _Pieces(beam.DoFn):
    """Beam DoFn: a document's tokens cut at block boundaries, keyed by shard."""

    def __init__(self, seq_len: int, blocks_per_shard: int):
        super().__init__()
        self.body = seq_len - 1  # <s> starts every block
        self.blocks_per_shard = blocks_per_shard

    def process(self, joined, totals):
        (name, split, _, _), grouped = joined
        (tokens,), (offset,) = grouped["tokens"], grouped["offset"]
        full_blocks = totals[(name, split)] // self.body  # the tail is left out
        end = offset + len(tokens)
        for block in range(offset // self.body, min(-(-end // self.body), full_blocks)):
            lo, hi = max(offset, block * self.body), min(end, (block + 1) * self.body)
            yield ((name, split, block // self.blocks_per_shard),
                   (block, lo - block * self.body, tokens[lo - offset:hi - offset]))


class _WriteShard(beam.DoFn):
    """Beam DoFn: one shard's blocks assembled from their pieces and written."""

    def __init__(self, out_dir: str, notes_dir: str, seq_len: int, blocks_per_shard: int,
                 dtype: str, bos: int):
        super().__init__()
        self.out_dir, self.notes_dir = out_dir, notes_dir
        self.seq_len, self.blocks_per_shard = seq_len, blocks_per_shard
        self.dtype = np.dtype(dtype)
        self.bos = bos  # the tokenizer's BOS, which starts every block

    def process(self, keyed, totals):
        (name, split, shard), pieces = keyed
        full_blocks = totals[(name, split)] // (self.seq_len - 1)
        count = -(-full_blocks // self.blocks_per_shard)
        first = shard * self.blocks_per_shard
        blocks = np.zeros((min(self.blocks_per_shard, full_blocks - first), self.seq_len),
                          self.dtype)
        blocks[:, 0] = self.bos
        for block, start, tokens in pieces:
            blocks[block - first, 1 + start:1 + start + len(tokens)] = tokens
        file = shards.shard_name(split, name, shard, count)
        with tempfile.TemporaryDirectory() as local:
            shards.write_shard(pathlib.Path(local) / file, blocks)
            size, sha256 = shards.file_digest(pathlib.Path(local) / file)
            paths.upload(pathlib.Path(local) / file, paths.Path(self.out_dir) / file)
        note = {"source": name, "split": split, "shard": shard, "file": file,
                "blocks": len(blocks), "bytes": size, "sha256": sha256}
        paths.write_text(paths.Path(self.notes_dir) / f"shard-{file}.json", json.dumps(note))
        yield note


def build_pipeline(root, items: list, tok: tokenizer_lib.Tokenizer,
                   config: ml_collections.ConfigDict, out_dir: str, notes_dir: str,
                   dtype: str) -> None:
    """The preparation as transforms on the Beam pipeline `root`; the workers rebuild `tok`
    from its file's bytes."""
    d, p = config.data, config.prepare
    tokenizer_file = (paths.Path(tok.model_path).read_bytes(), tok.model_path)
    tokenised = (root
                 | "work items" >> beam.Create(items)
                 | "spread" >> beam.Reshuffle()
                 | "tokenise" >> beam.ParDo(_Tokenise(tokenizer_file, d.validation_fraction,
                                                      d.encoding_errors, notes_dir)))
    lengths = (tokenised
               | "lengths" >> beam.Map(lambda kv: (kv[0], (kv[1][0], kv[1][1], len(kv[1][2]))))
               | "per split" >> beam.GroupByKey())
    offsets = lengths | "offsets" >> beam.FlatMap(_offsets)
    totals = beam.pvalue.AsDict(lengths | "totals" >> beam.Map(_totals))
    keyed = tokenised | "by document" >> beam.Map(
        lambda kv: ((kv[0][0], kv[0][1], kv[1][0], kv[1][1]), kv[1][2]))
    _ = ({"tokens": keyed, "offset": offsets}
         | "join" >> beam.CoGroupByKey()
         | "pieces" >> beam.ParDo(_Pieces(d.seq_len, p.blocks_per_shard), totals)
         | "per shard" >> beam.GroupByKey()
         | "write" >> beam.ParDo(_WriteShard(out_dir, notes_dir, d.seq_len, p.blocks_per_shard,
                                             dtype, tok.special.bos), totals))


def pipeline_options(config: ml_collections.ConfigDict) -> PipelineOptions:
    p = config.prepare
    # The workers' own logs (a dozen lines per process, and each failure's traceback
    # several times over) drown ours; a failure reaches the driver as an exception.
    flags = [f"--runner={p.runner}", "--default_sdk_harness_log_level=CRITICAL",
             *p.beam_options]
    if p.runner == "DirectRunner":
        flags += [f"--direct_num_workers={p.num_workers}",
                  "--direct_running_mode=" + ("multi_processing" if p.num_workers > 1
                                              else "in_memory")]
    return PipelineOptions(flags)


def pipeline_runner(config: ml_collections.ConfigDict, options: PipelineOptions):
    """The runner for beam.Pipeline: for "DirectRunner", the FnApiRunner that Beam's
    DirectRunner uses for a batch pipeline like ours, built as it builds it; otherwise None
    (the runner --runner names). Beam's DirectRunner first tries Prism, a binary it
    downloads from GitHub (with no timeout) and which runs the pipeline its own way, so a
    preparation on this machine would need the network, or wait on it, and change engine
    with it."""
    if config.prepare.runner != "DirectRunner":
        return None
    from apache_beam.portability.api import beam_provision_api_pb2
    from apache_beam.runners.portability.fn_api_runner import fn_runner
    from apache_beam.runners.portability.portable_runner import JobServiceHandle

    encoded = JobServiceHandle.encode_pipeline_options(options.get_all_options())
    return fn_runner.FnApiRunner(provision_info=fn_runner.ExtendedProvisionInfo(
        beam_provision_api_pb2.ProvisionInfo(pipeline_options=encoded)))


def _manifest(notes_dir: paths.Path, config: ml_collections.ConfigDict, fingerprint: str,
              dtype: str, tok) -> dict:
    """The manifest from the workers' notes."""
    notes = [json.loads(paths.read_text(f)) for f in sorted(notes_dir.glob("*.json"))]
    entries: dict[str, Any] = {}
    for name in config.data.sources:
        entry = {split: {"shards": [], "documents": 0, "tokens": 0} for split in shards.SPLITS}
        entry["read"] = {}
        for note in notes:
            if note["source"] != name:
                continue
            if "counts" in note:
                for split, (docs, tokens) in note["counts"].items():
                    entry[split]["documents"] += docs
                    entry[split]["tokens"] += tokens
                for key, value in note["read"].items():
                    entry["read"][key] = entry["read"].get(key, 0) + value
            else:
                entry[note["split"]]["shards"].append(
                    {"file": note["file"], "blocks": note["blocks"], "bytes": note["bytes"],
                     "sha256": note["sha256"], "index": note["shard"]})
        for split in shards.SPLITS:
            entry[split]["shards"].sort(key=lambda s: s.pop("index"))
        entries[name] = entry
    return shards.manifest(fingerprint, dtype, config.data.seq_len,
                           config.data.validation_fraction, tok, entries)


def _clean(out: paths.Path) -> None:
    """Removes what an unfinished preparation wrote: notes and shards (not the tokenizer,
    which is correct whatever happened after)."""
    paths.remove(out / NOTES)
    for shard in out.glob(f"*{shards.SUFFIX}"):
        shard.unlink()


class _Captured:
    keep = True  # whether the captured output is shown when the block ends


@contextlib.contextmanager
def _workers_output() -> Iterator[_Captured]:
    """Holds back what the block writes to file descriptor 2, which the DirectRunner's
    worker processes inherit: each failure's traceback, several times over, would bury
    the one-line error it becomes. Shown when the block ends unless `keep` is set False
    (the failure is one line of ours)."""
    captured = _Captured()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if captured.keep:
                held.seek(0)
                sys.stderr.write(held.read().decode("utf-8", "replace"))
                sys.stderr.flush()


def _user_error(error: Exception) -> Exception:
    """A failure in a worker reaches the driver as a runner's exception whose text holds
    the worker's traceback; a one-line error of ours (a damaged corpus file, say) is
    raised again as one line."""
    found = re.findall(r"maelm_jax\.[\w.]+Error: (.+?)(?: \[while running '[^']*'\])?$",
                       str(error), flags=re.MULTILINE)
    return shards.PreparedDataError(found[-1]) if found else error


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Prepares the corpus of `config` (validated, its paths absolute) into `workdir` (a
    local directory or a bucket path); returns the manifest. A directory already holding
    this preparation is left as it is."""
    out = paths.resolve(workdir, "--workdir")
    workdir_lib.claim(out, "prepare", "prepare")
    run_data.validate_sources(config)
    # Removed whole if this run fails (the hold of this preparation aside: workdirs/lock.py).
    fresh = not out.exists() or all(p.name == layout.LOCK_FILE for p in out.iterdir())
    paths.make_dirs(out)
    try:  # tokenizer training, interrupted or failed, leaves no directory it made
        tok = run_data.setup_tokenizer(config, out)
        if not (out / layout.TOKENIZER_FILES[tok.kind]).exists():
            paths.Path(tok.model_path).copy(out / layout.TOKENIZER_FILES[tok.kind])
    except BaseException:
        if fresh:
            paths.remove(out)
        raise
    fingerprint = run_data.data_fingerprint(config, tok)
    if (out / layout.MANIFEST_FILE).is_file():
        manifest = shards.read_manifest(out)
        if manifest["fingerprint"] == fingerprint:
            logging.info("prepare: %s already holds this preparation", out)
            return manifest
        raise shards.PreparedDataError(
            f"--workdir: {out} holds another preparation (fingerprint "
            f"{manifest['fingerprint']}); prepare into another directory")
    notes = out / NOTES
    _clean(out)  # an interrupted preparation's
    dtype = packing.token_dtype(tok.vocab_size).str
    items = work_items(config)
    start = time.monotonic()
    logging.info("prepare: %d work items on %s", len(items), config.prepare.runner)
    beam_logs = stdlib_logging.getLogger("apache_beam")
    level = beam_logs.level
    beam_logs.setLevel(stdlib_logging.CRITICAL)
    try:
        paths.make_dirs(notes)
        with _workers_output() as workers:
            try:
                options = pipeline_options(config)
                with beam.Pipeline(runner=pipeline_runner(config, options),
                                   options=options) as root:
                    build_pipeline(root, items, tok, config, str(out), str(notes), dtype)
            except Exception as e:
                error = _user_error(e)
                # One line of ours says it all, as does an interrupt (the workers print
                # theirs of it); anything else keeps the workers' account.
                workers.keep = not (isinstance(error, shards.PreparedDataError)
                                    or errors.interrupted(e))
                raise error from None
            except BaseException:  # Ctrl-C or SIGTERM: main.py says it in one line
                workers.keep = False
                raise
    except BaseException:
        _clean(out)  # no shard of a failed or interrupted preparation stays
        if fresh:
            paths.remove(out)
        raise
    finally:
        beam_logs.setLevel(level)
    manifest = _manifest(notes, config, fingerprint, dtype, tok)
    manifest["seconds"] = time.monotonic() - start
    paths.write_text(out / layout.MANIFEST_FILE, json.dumps(manifest, indent=2))  # last
    paths.remove(notes)
    for name, entry in manifest["sources"].items():
        logging.info("prepared %s: %d + %d documents -> %d train / %d valid blocks", name,
                     entry["train"]["documents"], entry["valid"]["documents"],
                     entry["train"]["blocks"], entry["valid"]["blocks"])
    return manifest
