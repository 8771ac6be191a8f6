"""Tokenise the corpus once and pack it into blocks of exactly L tokens, in the job.

RoBERTa FULL-SENTENCES packing: documents are joined by ``</s>`` into one token stream and
cut into blocks of L - 1 tokens, each preceded by ``<s>``. No padding, so every training
array has a static shape. The tail shorter than a block is dropped.

Blocks are written once per (corpus, tokenizer, L, split) in the format mode prepare
writes (maelm_jax/data/shards.py: CRC-checked shards, ``manifest.json``, the tokenizer),
under ``<cache_dir>/<fingerprint>/``, and read by the same reader: random access by index
makes shuffling, per-process sharding and exact resumption free. Documents are assigned
to the validation split by a hash of their text, so the split does not depend on corpus
order. Preparation writes into a temporary directory and renames it when complete, so an
interrupted run never leaves data that a later run would trust; a set of the earlier
in-job format (``meta.json`` and ``.bin`` files) is a cache, prepared again.

The cache may be in a bucket (``gs://``). Blocks are then packed in a local temporary
directory and uploaded with ``manifest.json`` last (its presence is what marks a set as
complete), and read by ranges as mode prepare's shards are.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import tempfile
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
from absl import logging

from maelm_jax.data import shards
from maelm_jax.infra import errors, paths
from maelm_jax.text import tokenizer as tokenizer_lib
from maelm_jax.workdirs import layout, lock

FORMAT_VERSION = 1  # of the blocks' content (in the fingerprint): not of their files
_EARLIER_FORMAT_FILE = "meta.json"  # what in-job preparation wrote before it wrote shards
_ENCODE_CHUNK = 512  # documents per sentencepiece batch call
_ENCODE_CHUNK_CHARS = 8_000_000  # ... or fewer, so progress is logged every few seconds
_PROGRESS_SECONDS = 10.0


def is_validation(document: str, validation_fraction: float) -> bool:
    """Stable per-document split decision from a CRC of the text."""
    return zlib.crc32(document.encode("utf-8")) % 100_000 < validation_fraction * 100_000


class BlockPacker:
    """Streams token ids into [BOS, L-1 tokens] blocks; EOS ends every document (the
    tokenizer's `special` ids: <s> and </s>, or BERT's [CLS] and [SEP])."""

    def __init__(self, seq_len: int, special: tokenizer_lib.SpecialIds):
        self.seq_len = seq_len
        self.special = special
        self._buffer: list[int] = []

    def add(self, ids: Sequence[int]) -> list[list[int]]:
        """Adds one document; returns the blocks completed by it (in time linear in the
        document's length, however long)."""
        self._buffer.extend(ids)
        self._buffer.append(self.special.eos)
        body = self.seq_len - 1
        n = len(self._buffer) // body
        blocks = [[self.special.bos] + self._buffer[i * body:(i + 1) * body]
                  for i in range(n)]
        del self._buffer[:n * body]
        return blocks


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype("<i4")


def chunks(documents: Iterable[str], size: int = _ENCODE_CHUNK,
           max_chars: int = _ENCODE_CHUNK_CHARS) -> Iterator[list[str]]:
    """Documents in lists for one sentencepiece batch call each."""
    chunk, chars = [], 0
    for doc in documents:
        chunk.append(doc)
        chars += len(doc)
        if len(chunk) == size or chars >= max_chars:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def pack_source(
    documents: Iterable[str],
    tok: tokenizer_lib.Tokenizer,
    seq_len: int,
    validation_fraction: float,
    out_dir: pathlib.Path,
    name: str,
    blocks_per_shard: int = shards.BLOCKS_PER_SHARD,
) -> dict:
    """Tokenises and packs one source into shards of each split in `out_dir`; returns
    the source's manifest entry ({split: {"shards", "documents", "tokens"}})."""
    dtype = token_dtype(tok.vocab_size)
    writers = {split: shards.ShardWriter(out_dir, split, name, seq_len, dtype, blocks_per_shard)
               for split in shards.SPLITS}
    packers = {split: BlockPacker(seq_len, tok.special) for split in writers}
    counts = {split: {"documents": 0, "tokens": 0} for split in writers}
    start = last_report = time.monotonic()
    for chunk in chunks(documents):
        for doc, ids in zip(chunk, tok.encode(chunk), strict=False):
            split = "valid" if is_validation(doc, validation_fraction) else "train"
            writers[split].write(packers[split].add(ids))
            counts[split]["documents"] += 1
            counts[split]["tokens"] += len(ids) + 1
        now = time.monotonic()
        if now - last_report > _PROGRESS_SECONDS:
            last_report = now
            tokens = sum(c["tokens"] for c in counts.values())
            logging.info("preparing %s: %d documents, %.1fM tokens, %d blocks (%.0f tokens/s)",
                         name, sum(c["documents"] for c in counts.values()), tokens / 1e6,
                         writers["train"].blocks, tokens / (now - start))
    entry = {split: {"shards": writers[split].close(), **counts[split]} for split in writers}
    logging.info("prepared %s: %d documents, %d tokens -> %d train / %d valid blocks in %.1fs",
                 name, sum(c["documents"] for c in counts.values()),
                 sum(c["tokens"] for c in counts.values()), writers["train"].blocks,
                 writers["valid"].blocks, time.monotonic() - start)
    return entry


def data_fingerprint(
    source_fingerprints: dict[str, str],
    tokenizer_path: str,
    seq_len: int,
    validation_fraction: float,
) -> str:
    """Everything the prepared blocks depend on, hashed."""
    h = hashlib.sha256()
    h.update(paths.Path(tokenizer_path).read_bytes())
    h.update(
        json.dumps(
            {
                "format": FORMAT_VERSION,
                "seq_len": seq_len,
                "validation_fraction": validation_fraction,
                "sources": source_fingerprints,
            },
            sort_keys=True,
        ).encode()
    )
    return h.hexdigest()[:16]


def pack_blocks(
    sources: dict[str, Iterable[str]],
    source_fingerprints: dict[str, str],
    tok: tokenizer_lib.Tokenizer,
    seq_len: int,
    validation_fraction: float,
    cache_dir: paths.Path,
    weights: dict[str, float] | None = None,
    read: dict | None = None,
    blocks_per_shard: int = shards.BLOCKS_PER_SHARD,
    cache_bytes: int = 16 * 2**30,
) -> shards.PreparedData:
    """Packs every source (name -> documents) unless already prepared.

    Returns the blocks, mixed by `weights` (the config's; the prepared blocks do not
    depend on them, so a cache shared by runs of other mixtures serves them all). `read`:
    per source, the reader's statistics object, recorded in the manifest once read.
    `cache_bytes`: the bound of this host's cache of blocks read from a bucket.
    Raises UserError naming a source that yields no training block, or when the
    validation split is empty.
    """
    fingerprint = data_fingerprint(
        source_fingerprints, tok.model_path, seq_len, validation_fraction
    )
    final = cache_dir / fingerprint
    field, read = "config.data.cache_dir", read or {}
    if (final / layout.MANIFEST_FILE).exists():
        logging.info("reusing prepared data in %s", final)
        return shards.load(final, weights, fingerprint, cache_bytes, field)
    if (final / _EARLIER_FORMAT_FILE).exists():
        logging.warning("%s holds blocks of the earlier in-job format (%s and .bin files); "
                        "it is a cache: preparing it again as shards", final,
                        _EARLIER_FORMAT_FILE)
        paths.remove(final)
    local = paths.is_local(cache_dir)
    paths.make_dirs(cache_dir)
    # Packed beside the final directory, which one rename then completes; for a cache in a
    # bucket, on local disk and then uploaded.
    if local:  # what a killed run left, and nobody writes any more
        lock.remove_unowned(pathlib.Path(cache_dir))
    with lock.scratch(pathlib.Path(cache_dir) if local
                      else pathlib.Path(tempfile.gettempdir())) as tmp:
        if _pack_into(tmp, final, sources, tok, seq_len,
                      validation_fraction, fingerprint, read, blocks_per_shard, local):
            logging.info("another run finished packing %s first: using its blocks", final)
    return shards.load(final, weights, fingerprint, cache_bytes, field)


def _pack_into(tmp: pathlib.Path, final: paths.Path, sources, tok,
               seq_len: int, validation_fraction: float, fingerprint: str, read: dict,
               blocks_per_shard: int, local: bool) -> bool:
    """Packs into `tmp` and renames it to `final` (uploads it there, for a bucket); True
    when another run sharing the cache finished `final` first (the same blocks: its
    fingerprint names them), which is then used as it is, after the checks of loading."""
    try:
        entries = {}
        for name, documents in sources.items():
            entry = pack_source(documents, tok, seq_len, validation_fraction, tmp, name,
                                blocks_per_shard)
            train_blocks = sum(s["blocks"] for s in entry["train"]["shards"])
            if train_blocks == 0:
                tokens = entry["train"]["tokens"] + entry["valid"]["tokens"]
                raise errors.UserError(
                    f"config.data.sources.{name}: {tokens} tokens do not fill one "
                    f"training block of data.seq_len={seq_len}; add text or lower seq_len"
                )
            entry["read"] = dict(vars(read[name])) if name in read else {}
            entries[name] = entry
        if not any(s for e in entries.values() for s in e["valid"]["shards"]):
            raise errors.UserError(
                "config.data.validation_fraction: no validation block of "
                f"data.seq_len={seq_len} was held out; raise it or add text"
            )
        (tmp / layout.TOKENIZER_FILES[tok.kind]).write_bytes(
            paths.Path(tok.model_path).read_bytes())
        manifest = shards.manifest(fingerprint, token_dtype(tok.vocab_size).str, seq_len,
                                   validation_fraction, tok, entries)
        (tmp / layout.MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))
        lock.unlocked(tmp)
        if local:
            paths.as_created_in_place(tmp)
            try:
                os.replace(tmp, final)
            except OSError:
                if not (final / layout.MANIFEST_FILE).exists():
                    raise
                return True
        else:  # the manifest last: a set without it is incomplete and is prepared again
            for file in sorted(tmp.iterdir(), key=lambda f: f.name == layout.MANIFEST_FILE):
                paths.upload(file, final / file.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return False
