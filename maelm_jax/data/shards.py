"""Inputs data as block shards: the one on-disk format of packed blocks, written by
`prepare` mode and by in-job preparation alike, and the one reader training uses.

A prepared directory (mode prepare's workdir, or an in-job set under
``<data.cache_dir>/<fingerprint>/``) holds, for every source and split, the blocks of
`seq_len` tokens in order, cut into shards of at most `blocks_per_shard` blocks::

    manifest.json                    written last: its presence marks the set complete
    tokenizer.model | tokenizer.json the tokenizer the blocks were cut with
    train_<source>-00000-of-00004.blocks, ...
    valid_<source>-00000-of-00001.blocks, ...

A shard is an array of fixed-size records, one per block: its `seq_len` tokens as
little-endian integers of the manifest's dtype, then the CRC-32 of those bytes (4 bytes,
little-endian). Block i of a shard is bytes [i * R, (i + 1) * R) for a record of R bytes,
so a host reads any block with one ranged read, from a local disk (memory-mapped) or a
bucket, and checks it by its own checksum.

``manifest.json``: the format, dtype and seq_len, the fingerprint (the same as in-job
preparation's: sources' content, tokenizer, seq_len, validation fraction), the validation
fraction, the tokenizer's file name, vocabulary size, SHA-256 and special ids, and per
source and split the shards in order with their block counts, sizes and SHA-256, plus
the source's statistics (documents, tokens, blocks, what the readers cleaned).

Before a run trusts a prepared directory (`check_run`), the manifest must fit the run
(seq_len, validation fraction, vocabulary), the tokenizer must be the one it records,
and every shard must exist with its recorded size; a local set of at most
DIGEST_UP_FRONT_BYTES is also hashed whole. Every block is checked by its CRC-32 as it is
read: a damaged one stops the run with one line naming its file.

Reading (`load`) is random access by global block index: a process reads only the blocks
it is asked for (its rows of each batch), so the loader's (seed, step) order and exact
resume are the in-job path's. From a bucket, a host never copies a set: the blocks a
batch needs are fetched with ranged reads, many at once, and kept in a local cache of
sparse files (the user cache, under the fingerprint) bounded by `data.prepared_cache_gb`:
past the bound the least recently used shards' copies are dropped. A cached block is
trusted only if it passes its checksum (a hole reads as zeros, which never do).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import pathlib
import threading
import zlib
from collections.abc import Sequence

import numpy as np

from maelm_jax.infra import errors, paths, user_cache
from maelm_jax.workdirs import layout

FORMAT = "maelm_jax.blocks/3"
# What earlier versions wrote (ArrayRecord shards): refused with what to do.
FORMERLY = ("maelm_jax.blocks/1", "maelm_jax.blocks/2")
# A prepared set of at most this many bytes is hashed whole before training (a cost that
# grows with its size); a larger one is checked by size up front, its records as they are
# read.
DIGEST_UP_FRONT_BYTES = 2**30
SPLITS = ("train", "valid")
# Records of a shard: 2**16 blocks of 512 int32 tokens is 128 MB.
BLOCKS_PER_SHARD = 65536
SUFFIX = ".blocks"


class PreparedDataError(errors.UserError):
    """A prepared directory that cannot be read (one-line message)."""


def shard_name(split: str, source: str, index: int, count: int) -> str:
    return f"{split}_{source}-{index:05d}-of-{count:05d}{SUFFIX}"


def record_dtype(seq_len: int, dtype: str | np.dtype) -> np.dtype:
    """One block's record: its tokens, little-endian, then their CRC-32."""
    return np.dtype([("tokens", np.dtype(dtype).newbyteorder("<"), (seq_len,)),
                     ("crc", "<u4")])


def _checksums(tokens: np.ndarray) -> np.ndarray:
    """The CRC-32 of each row's little-endian bytes: [n] uint32."""
    rows = np.ascontiguousarray(tokens)
    return np.fromiter((zlib.crc32(row.tobytes()) for row in rows), np.uint32, len(rows))


def _records(blocks: np.ndarray) -> np.ndarray:
    """[n, L] blocks as their n records (tokens and their CRC-32)."""
    records = np.empty(len(blocks), record_dtype(blocks.shape[1], blocks.dtype))
    records["tokens"] = blocks
    records["crc"] = _checksums(records["tokens"])
    return records


def write_shard(path: pathlib.Path, blocks: np.ndarray) -> None:
    """One local shard file: a record per block [L] (tokens and their CRC-32), in order."""
    with open(path, "wb") as f:
        _write(f, _records(blocks))


def _write(f, records: np.ndarray) -> None:
    """Writes `records`' bytes through Python's file object, not numpy's `tofile`: a
    Ctrl-C arriving in tofile's C code comes out of it as a TypeError (exit 1, a
    traceback), through a write as the KeyboardInterrupt it is."""
    f.write(records.view(np.uint8).data)


class ShardWriter:
    """Streams the blocks of one source and split into shards of `blocks_per_shard`
    blocks in a local directory (what write_shard writes, a shard at a time); `close()`
    gives each its final name (…-of-<count>) and returns the manifest's shard entries."""

    def __init__(self, directory: pathlib.Path, split: str, source: str, seq_len: int,
                 dtype: np.dtype, blocks_per_shard: int = BLOCKS_PER_SHARD):
        self.directory, self.split, self.source = directory, split, source
        self.seq_len, self.dtype, self.per_shard = seq_len, np.dtype(dtype), blocks_per_shard
        self.blocks = 0
        self._open: tuple[pathlib.Path, object] | None = None
        self._written: list[pathlib.Path] = []

    def write(self, blocks) -> None:
        """Appends [n, L] blocks (a list of rows or an array)."""
        blocks = np.asarray(blocks, self.dtype).reshape(-1, self.seq_len)
        while len(blocks):
            room = self.per_shard - self.blocks % self.per_shard
            if self.blocks % self.per_shard == 0:
                self._next_shard()
            _write(self._open[1], _records(blocks[:room]))
            self.blocks += len(blocks[:room])
            blocks = blocks[room:]

    def _next_shard(self) -> None:
        if self._open:
            self._open[1].close()
        path = self.directory / f".{self.split}_{self.source}-{len(self._written):05d}"
        self._open = (path, open(path, "wb"))
        self._written.append(path)

    def close(self) -> list[dict]:
        if self._open:
            self._open[1].close()
        entries = []
        for index, path in enumerate(self._written):
            name = shard_name(self.split, self.source, index, len(self._written))
            os.replace(path, self.directory / name)
            size, sha256 = file_digest(self.directory / name)
            entries.append({"file": name, "blocks": size // record_dtype(
                self.seq_len, self.dtype).itemsize, "bytes": size, "sha256": sha256})
        return entries


def manifest(fingerprint: str, dtype: str, seq_len: int, validation_fraction: float,
             tok, sources: dict) -> dict:
    """A prepared set's manifest.json (see the module docstring): `tok`, the tokenizer
    that cut the blocks (text/tokenizer.py; its file is recorded by name, kind and
    digest, its special ids for the record); `sources`: per source
    {"train": {"shards": [...], "documents", "tokens"}, "valid": {...}, "read": {...}}
    (each split's "blocks" is added from its shards)."""
    for entry in sources.values():
        for split in SPLITS:
            entry[split]["blocks"] = sum(s["blocks"] for s in entry[split]["shards"])
    return {"format": FORMAT, "fingerprint": fingerprint, "dtype": np.dtype(dtype).str,
            "seq_len": seq_len, "validation_fraction": validation_fraction,
            "tokenizer": layout.TOKENIZER_FILES[tok.kind], "vocab_size": tok.vocab_size,
            "tokenizer_sha256": file_digest(tok.model_path)[1],
            "special_ids": tok.special.to_json(), "sources": sources}


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
    found = manifest.get("format") if isinstance(manifest, dict) else None
    if found in FORMERLY:
        raise PreparedDataError(f"config.data.prepared: {path} is format {found!r} "
                                f"(ArrayRecord shards), which this version no longer reads; "
                                f"prepare the corpus again (format {FORMAT!r})")
    if found != FORMAT:
        raise PreparedDataError(f"config.data.prepared: {path} is format {found!r}, "
                                f"expected {FORMAT!r}")
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
    if not any(s.get("blocks") for source in manifest["sources"].values()
               for s in source["valid"]["shards"]):
        # A run evaluates (at its last step at least): over no block it would log loss 0.
        raise PreparedDataError(
            f"config.data.prepared: {directory / layout.MANIFEST_FILE} records no validation "
            "block, and a run evaluates on them; prepare it again (a larger "
            "data.validation_fraction or more text)")
    tokenizer = directory / manifest.get("tokenizer", layout.TOKENIZER_FILE)
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


@dataclasses.dataclass(frozen=True)
class PreparedData:
    """The blocks of every source, each split and source an [num_blocks, seq_len] array
    or ShardedBlocks (read on demand), and the mixture's weights."""

    directory: paths.Path
    seq_len: int
    train: dict[str, np.ndarray | ShardedBlocks]
    valid: dict[str, np.ndarray | ShardedBlocks]
    weights: dict[str, float]


class BlockCache:
    """Local sparse copies of shards that live in a bucket, holding the blocks read so far,
    bounded by `limit_bytes` of disk: past it, the least recently used shards' copies are
    dropped whole. A block in a copy counts only if it passes its checksum, so a copy
    needs no index of what it holds, and one damaged on disk is fetched again."""

    def __init__(self, root: pathlib.Path, limit_bytes: int):
        self.root, self.limit = root, int(limit_bytes)
        self._maps: collections.OrderedDict[str, np.memmap] = collections.OrderedDict()

    def _copy(self, name: str, size: int, rec: np.dtype) -> np.memmap:
        if name not in self._maps:
            self.root.mkdir(parents=True, exist_ok=True)
            path = self.root / name
            with open(path, "ab") as f:  # a sparse file of the shard's size: holes read as 0
                if f.tell() != size:
                    f.truncate(size)
            self._maps[name] = np.memmap(path, rec, "r+")
        self._maps.move_to_end(name)
        return self._maps[name]

    def records(self, name: str, size: int, rec: np.dtype, keys: np.ndarray,
                fetch) -> np.ndarray:
        """The records `keys` of shard `name` (`size` bytes of `rec`), those the copy lacks
        fetched by `fetch(keys) -> records` and kept."""
        copy = self._copy(name, size, rec)
        got = copy[keys]
        missing = got["crc"] != _checksums(got["tokens"])
        if missing.any():
            fetched = fetch(keys[missing])
            got[missing] = fetched
            copy[keys[missing]] = fetched
            self._bound()
        return got

    def _bound(self) -> None:
        """Drops the least recently used copies while the copies exceed the limit."""
        used = {name: os.stat(self.root / name).st_blocks * 512 for name in self._maps}
        while sum(used.values()) > self.limit and len(self._maps) > 1:
            name, copy = self._maps.popitem(last=False)
            del copy
            (self.root / name).unlink(missing_ok=True)
            used.pop(name)


class ShardedBlocks:
    """[N, L] blocks of one source and split, read from its shards on demand: len(),
    .shape, and indexing by an int, a slice or an index array, as the loader uses a numpy
    array. Local shards are memory-mapped; shards in a bucket are read by ranges, through
    `cache` when given."""

    # Local shards memory-mapped at once (each mapping holds a file descriptor).
    OPEN_LOCAL = 64

    def __init__(self, files: Sequence[str], counts: Sequence[int], seq_len: int,
                 dtype: np.dtype, cache: BlockCache | None = None,
                 field: str = "config.data.prepared"):
        self.shape = (int(sum(counts)), seq_len)
        self.dtype = np.dtype(dtype)
        self._rec = record_dtype(seq_len, dtype)
        self._files = list(files)
        self._counts = list(counts)
        self._ends = np.cumsum(counts)  # the first block index after each file's
        self._cache = cache
        self._field = field  # what a damaged shard's message names
        self._local: collections.OrderedDict[str, np.memmap] = collections.OrderedDict()
        self._lock = threading.Lock()  # the loader's thread and evaluation read at once

    def __len__(self) -> int:
        return self.shape[0]

    def _mapped(self, file: str) -> np.memmap:
        if file not in self._local:
            self._local[file] = np.memmap(file, self._rec, "r")
            while len(self._local) > self.OPEN_LOCAL:
                self._local.popitem(last=False)
        self._local.move_to_end(file)
        return self._local[file]

    def _fetch(self, file: str, keys: np.ndarray) -> np.ndarray:
        """Records `keys` (sorted) of a shard in a bucket, by ranged reads (one per run of
        consecutive blocks), all at once."""
        size = self._rec.itemsize
        runs = np.split(keys, np.flatnonzero(np.diff(keys) != 1) + 1)
        pieces = paths.read_ranges(file, [int(r[0]) * size for r in runs],
                                   [(int(r[-1]) + 1) * size for r in runs])
        return np.frombuffer(b"".join(pieces), self._rec)

    def _records(self, number: int, keys: np.ndarray) -> np.ndarray:
        file = self._files[number]
        if paths.is_local(file):
            return np.asarray(self._mapped(file)[keys])
        if self._cache is None:
            return self._fetch(file, keys)
        return self._cache.records(pathlib.PurePosixPath(file).name,
                                   self._counts[number] * self._rec.itemsize, self._rec, keys,
                                   lambda wanted: self._fetch(file, wanted))

    def _read(self, keys: np.ndarray) -> np.ndarray:
        """The tokens of blocks `keys` [n] -> [n, L], each checked by its CRC-32."""
        out = np.empty((len(keys), self.shape[1]), self.dtype)
        numbers = np.searchsorted(self._ends, keys, side="right")
        for number in np.unique(numbers):
            where = np.flatnonzero(numbers == number)
            first = self._ends[number] - self._counts[number]
            # Each block once, in file order (ranged reads of runs of blocks).
            local, inverse = np.unique(keys[where] - first, return_inverse=True)
            with self._lock:
                records = self._records(int(number), local)
            damaged = np.flatnonzero(records["crc"] != _checksums(records["tokens"]))
            if len(damaged):
                raise PreparedDataError(
                    f"{self._field}: shard {self._files[number]} is damaged (block "
                    f"{int(local[damaged[0]])} fails its checksum); prepare again")
            out[where] = records["tokens"][inverse]
        return out

    def __getitem__(self, index):
        if isinstance(index, (int, np.integer)):
            i = int(index) + (len(self) if index < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(f"block {index} of {len(self)}")
            return self._read(np.array([i]))[0]
        keys = np.arange(len(self))[index] if isinstance(index, slice) else np.asarray(index)
        return self._read(keys.astype(np.int64).reshape(-1))

    def __array__(self, dtype=None, copy=None):
        blocks = self[:]
        return blocks if dtype is None else blocks.astype(dtype)


def load(directory: str | paths.Path, weights: dict[str, float] | None = None,
         fingerprint: str | None = None, cache_bytes: int = 16 * 2**30,
         field: str = "config.data.prepared") -> PreparedData:
    """The blocks of a prepared directory, mixed by `weights` (every source 1.0 when
    None; the manifest never decides the mixture). `fingerprint`, when given, must be the
    manifest's (the config's sources, tokenizer and lengths). `cache_bytes`: the bound of
    this host's cache of a bucket's blocks (0: none). `field`: the config field a damaged
    shard is reported under."""
    directory = paths.Path(directory)
    manifest = read_manifest(directory)
    if fingerprint is not None and manifest["fingerprint"] != fingerprint:
        raise PreparedDataError(
            f"config.data.prepared: {directory} was prepared from other sources, another "
            f"tokenizer or other lengths (fingerprint {manifest['fingerprint']}, this config "
            f"{fingerprint}); prepare again or use the config it was prepared with")
    cache = (BlockCache(user_cache.directory("prepared", manifest["fingerprint"]), cache_bytes)
             if paths.is_uri(directory) and cache_bytes > 0 else None)
    dtype, seq_len = np.dtype(manifest["dtype"]), manifest["seq_len"]

    def split(name: str) -> dict[str, ShardedBlocks | np.ndarray]:
        out = {}
        for source, entry in manifest["sources"].items():
            shards = entry[name]["shards"]
            out[source] = (ShardedBlocks([os.fspath(directory / s["file"]) for s in shards],
                                         [s["blocks"] for s in shards], seq_len, dtype, cache,
                                         field)
                           if shards else np.zeros((0, seq_len), dtype))
        return out

    return PreparedData(
        directory, seq_len, split("train"), split("valid"),
        {name: float((weights or {}).get(name, 1.0)) for name in manifest["sources"]})
