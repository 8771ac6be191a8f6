"""Prepared data as ArrayRecord shards: what `prepare` mode writes and training reads.

A prepared directory holds, for every source and split, the blocks of `seq_len` tokens in
order, cut into shards of at most `blocks_per_shard` records (one record per block: its
tokens as little-endian bytes of the manifest's dtype)::

    manifest.json                         written last: its presence marks the set complete
    tokenizer.model                       the tokenizer the blocks were cut with
    train_<source>-00000-of-00004.array_record, ...
    valid_<source>-00000-of-00001.array_record, ...

``manifest.json``: the format, dtype and seq_len, the fingerprint (the same as in-job
preparation's: sources' content, tokenizer, seq_len, validation fraction), the validation
fraction, the tokenizer's vocabulary size and SHA-256, and per source and split the
shards in order with their block counts, sizes and SHA-256, plus the source's statistics
(documents, tokens, blocks, what the readers cleaned).

Before a run trusts a prepared directory (`check_run`), the manifest must fit the run
(seq_len, validation fraction, vocabulary), the tokenizer must be the one it records,
and every shard must exist with its recorded size; a set of at most
DIGEST_UP_FRONT_BYTES is also hashed whole. A larger one is checked as it is read: each
record group carries ArrayRecord's own checksum, and a damaged one stops the run with
one line naming its file.

Reading (`load`) is random access by global block index through grain's
`ArrayRecordDataSource`: a process reads only the blocks it is asked for, so the loader's
(seed, step) order and exact resume are the in-job path's. Shards in a bucket are copied
once per host to local disk (the user cache, under the fingerprint) and read from there:
never held in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
from collections.abc import Sequence

import numpy as np
from absl import logging

from maelm_jax import errors, layout, paths, user_cache
from maelm_jax.data import packing

FORMAT = "maelm_jax.blocks/2"
# Formats this code reads: /1 (shards without sizes and digests in the manifest) and /2.
READABLE = ("maelm_jax.blocks/1", FORMAT)
# A prepared set of at most this many bytes is hashed whole before training (about a
# second per GB); a larger one is checked by size up front, its records as they are read.
DIGEST_UP_FRONT_BYTES = 2**30
SPLITS = ("train", "valid")
# Records of a shard: 2**16 blocks of 512 int32 tokens is 128 MB.
BLOCKS_PER_SHARD = 65536


class PreparedDataError(errors.UserError):
    """A prepared directory that cannot be read (one-line message)."""


def shard_name(split: str, source: str, index: int, count: int) -> str:
    return f"{split}_{source}-{index:05d}-of-{count:05d}.array_record"


def write_shard(path: pathlib.Path, blocks: np.ndarray) -> None:
    """One local shard file: a record per block [L], in order (group_size 1: random access
    by record)."""
    from array_record.python import array_record_module

    writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
    try:
        for block in blocks:
            writer.write(block.tobytes())
    finally:
        writer.close()


def read_manifest(directory: paths.Path) -> dict:
    path = directory / layout.MANIFEST_FILE
    if not path.is_file():
        raise PreparedDataError(f"config.data.prepared: {directory} has no {layout.MANIFEST_FILE}; "
                                "write it with --config.mode=prepare (an interrupted "
                                "preparation leaves none)")
    try:
        manifest = json.loads(paths.read_text(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PreparedDataError(f"config.data.prepared: {path} is not valid JSON ({e}); "
                                "prepare again") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in READABLE:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise PreparedDataError(f"config.data.prepared: {path} is format {found!r}, "
                                f"expected one of {', '.join(READABLE)}")
    return manifest


def file_digest(path: str | os.PathLike) -> tuple[int, str]:
    """(size in bytes, SHA-256 hex) of a file, read in 1 MB pieces."""
    digest, size = hashlib.sha256(), 0
    with paths.Path(path).open("rb") as f:
        while piece := f.read(1 << 20):
            digest.update(piece)
            size += len(piece)
    return size, digest.hexdigest()


def _size(path: paths.Path) -> int | None:
    """A file's size, None if it does not exist."""
    try:
        if paths.is_local(path):
            return os.path.getsize(path)
        return int(paths.object_info(os.fspath(path))[0]["size"])
    except (FileNotFoundError, KeyError):
        return None


def _entries(manifest: dict) -> list[dict]:
    return [s for source in manifest["sources"].values() for split in SPLITS
            for s in source[split]["shards"]]


def check_run(config) -> dict:
    """The manifest of config.data.prepared, once it is known to fit the run and its files
    to be whole (see the module docstring); else PreparedDataError naming the field or
    file (and both values). Reads nothing but the manifest, the tokenizer and the shards'
    sizes (their bytes too when DIGEST_UP_FRONT_BYTES allows)."""
    directory = paths.Path(config.data.prepared)
    manifest = read_manifest(directory)
    d = config.data
    recorded = (("config.data.seq_len", d.seq_len, manifest["seq_len"]),
                ("config.data.validation_fraction", d.validation_fraction,
                 manifest.get("validation_fraction", d.validation_fraction)),
                ("config.tokenizer.vocab_size", config.tokenizer.vocab_size,
                 manifest.get("vocab_size", config.tokenizer.vocab_size)))
    for field, ours, theirs in recorded:
        if ours != theirs:
            raise PreparedDataError(
                f"{field}: {ours}, but config.data.prepared {directory} was prepared with "
                f"{theirs}; set {theirs}, or prepare again with {ours}")
    tokenizer = directory / layout.TOKENIZER_FILE
    if "tokenizer_sha256" in manifest and (
            not tokenizer.is_file() or file_digest(tokenizer)[1] != manifest["tokenizer_sha256"]):
        raise PreparedDataError(f"config.data.prepared: {tokenizer} is missing or not the "
                                "tokenizer the shards were cut with; prepare again")
    verify_shards(directory, manifest)
    return manifest


def verify_shards(directory: paths.Path, manifest: dict, digests: bool | None = None) -> None:
    """Every shard of the manifest exists in `directory` with its recorded size, and with
    `digests` (default: when they fit DIGEST_UP_FRONT_BYTES, for a local directory) its
    recorded SHA-256; else PreparedDataError naming the file."""
    entries = _entries(manifest)
    if not all("bytes" in s for s in entries):
        logging.warning("config.data.prepared: %s was prepared before shards had sizes and "
                        "digests in the manifest; they are checked as they are read", directory)
        return
    for s in entries:
        path = directory / s["file"]
        size = _size(path)
        if size is None:
            raise PreparedDataError(f"config.data.prepared: shard {path} is missing; "
                                    "prepare again")
        if size != s["bytes"]:
            raise PreparedDataError(f"config.data.prepared: shard {path} is {size} bytes, its "
                                    f"manifest says {s['bytes']}: damaged or cut short; "
                                    "prepare again")
    if digests is None:
        digests = paths.is_local(directory) and sum(
            s["bytes"] for s in entries) <= DIGEST_UP_FRONT_BYTES
    for s in entries if digests else ():
        if file_digest(directory / s["file"])[1] != s["sha256"]:
            raise PreparedDataError(f"config.data.prepared: shard {directory / s['file']} "
                                    "does not match its SHA-256 in the manifest: damaged; "
                                    "prepare again")


class ShardedBlocks:
    """[N, L] blocks of one source and split, read from its shards on demand: len(),
    .shape, and indexing by an int, a slice or an index array, as the loader uses a numpy
    array."""

    def __init__(self, files: Sequence[str], counts: Sequence[int], seq_len: int,
                 dtype: np.dtype):
        self.shape = (int(sum(counts)), seq_len)
        self.dtype = np.dtype(dtype)
        self._files = list(files)
        self._ends = np.cumsum(counts)  # the first block index after each file's
        self._source = None  # opened lazily: nothing is read until a block is asked for

    def __len__(self) -> int:
        return self.shape[0]

    def _records(self):
        if self._source is None:
            import grain

            self._source = grain.sources.ArrayRecordDataSource(self._files)
        return self._source

    def _decode(self, records) -> np.ndarray:
        return np.frombuffer(b"".join(records), self.dtype).reshape(len(records), -1)

    def _read(self, keys: list[int]) -> list[bytes]:
        """The records of `keys`; a damaged record group is one line naming its file."""
        try:
            return list(self._records().__getitems__(keys))
        except Exception as e:  # array_record reports damage as RuntimeError, among others
            for key in keys:  # which block (and so which file) it was
                try:
                    self._records()[key]
                except Exception:  # noqa: BLE001 - this one is the damaged record
                    file = self._files[int(np.searchsorted(self._ends, key, side="right"))]
                    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e)
                    raise PreparedDataError(
                        f"config.data.prepared: shard {file} is damaged (block {key}: "
                        f"{reason}); prepare again") from None
            raise

    def __getitem__(self, index):
        if isinstance(index, (int, np.integer)):
            i = int(index) + (len(self) if index < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(f"block {index} of {len(self)}")
            return self._decode(self._read([i]))[0]
        keys = np.arange(len(self))[index] if isinstance(index, slice) else np.asarray(index)
        if len(keys) == 0:
            return np.zeros((0, self.shape[1]), self.dtype)
        return self._decode(self._read([int(k) for k in keys]))

    def __array__(self, dtype=None, copy=None):
        blocks = self[:]
        return blocks if dtype is None else blocks.astype(dtype)


def _local_copy(directory: paths.Path, fingerprint: str, names: list[str]) -> pathlib.Path:
    """The shards of a prepared directory in a bucket, copied once to this host's disk."""
    local = user_cache.directory("prepared", fingerprint)
    local.mkdir(parents=True, exist_ok=True)
    for name in names:
        target = local / name
        if not target.exists():
            partial = local / f".{name}.partial"
            (directory / name).copy(paths.Path(partial), overwrite=True)
            os.replace(partial, target)
    return local


def load(directory: str | paths.Path, weights: dict[str, float] | None = None,
         fingerprint: str | None = None) -> packing.PreparedData:
    """The blocks of a prepared directory as `packing.PreparedData` (what in-job
    preparation gives), mixed by `weights` (every source 1.0 when None). `fingerprint`,
    when given, must be the manifest's (the config's sources, tokenizer and lengths)."""
    directory = paths.Path(directory)
    manifest = read_manifest(directory)
    if fingerprint is not None and manifest["fingerprint"] != fingerprint:
        raise PreparedDataError(
            f"config.data.prepared: {directory} was prepared from other sources, another "
            f"tokenizer or other lengths (fingerprint {manifest['fingerprint']}, this config "
            f"{fingerprint}); prepare again or use the config it was prepared with")
    names = [s["file"] for source in manifest["sources"].values()
             for split in SPLITS for s in source[split]["shards"]]
    root = (pathlib.Path(directory) if paths.is_local(directory)
            else _local_copy(directory, manifest["fingerprint"], names))
    if not paths.is_local(directory):  # the copies on this host, whole
        verify_shards(paths.Path(root), manifest)
    dtype, seq_len = np.dtype(manifest["dtype"]), manifest["seq_len"]

    def split(name: str) -> dict[str, ShardedBlocks | np.ndarray]:
        out = {}
        for source, entry in manifest["sources"].items():
            shards = entry[name]["shards"]
            out[source] = (ShardedBlocks([str(root / s["file"]) for s in shards],
                                         [s["blocks"] for s in shards], seq_len, dtype)
                           if shards else np.zeros((0, seq_len), dtype))
        return out

    return packing.PreparedData(
        directory, seq_len, split("train"), split("valid"),
        {name: float((weights or {}).get(name, 1.0)) for name in manifest["sources"]})
