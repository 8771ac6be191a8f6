"""Prepared data as ArrayRecord shards: what `prepare` mode writes and training reads.

A prepared directory holds, for every source and split, the blocks of `seq_len` tokens in
order, cut into shards of at most `blocks_per_shard` records (one record per block: its
tokens as little-endian bytes of the manifest's dtype)::

    manifest.json                         written last: its presence marks the set complete
    tokenizer.model                       the tokenizer the blocks were cut with
    train_<source>-00000-of-00004.array_record, ...
    valid_<source>-00000-of-00001.array_record, ...

``manifest.json``: the format, dtype and seq_len, the fingerprint (the same as in-job
preparation's: sources' content, tokenizer, seq_len, validation fraction), and per source
and split the shards in order with their block counts, plus the source's statistics
(documents, tokens, blocks, what the readers cleaned).

Reading (`load`) is random access by global block index through grain's
`ArrayRecordDataSource`: a process reads only the blocks it is asked for, so the loader's
(seed, step) order and exact resume are the in-job path's. Shards in a bucket are copied
once per host to local disk (the user cache, under the fingerprint) and read from there:
never held in memory.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Sequence

import numpy as np

from maelm_jax import errors, paths, user_cache
from maelm_jax.data import packing

FORMAT = "maelm_jax.blocks/1"
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.model"
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
    path = directory / MANIFEST
    if not path.is_file():
        raise PreparedDataError(f"config.data.prepared: {directory} has no {MANIFEST}; "
                                "write it with --config.mode=prepare (an interrupted "
                                "preparation leaves none)")
    manifest = json.loads(paths.read_text(path))
    if manifest.get("format") != FORMAT:
        raise PreparedDataError(f"config.data.prepared: {path} is format "
                                f"{manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


class ShardedBlocks:
    """[N, L] blocks of one source and split, read from its shards on demand: len(),
    .shape, and indexing by an int, a slice or an index array, as the loader uses a numpy
    array."""

    def __init__(self, files: Sequence[str], counts: Sequence[int], seq_len: int,
                 dtype: np.dtype):
        self.shape = (int(sum(counts)), seq_len)
        self.dtype = np.dtype(dtype)
        self._files = list(files)
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

    def __getitem__(self, index):
        if isinstance(index, (int, np.integer)):
            i = int(index) + (len(self) if index < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(f"block {index} of {len(self)}")
            return self._decode([self._records()[i]])[0]
        keys = np.arange(len(self))[index] if isinstance(index, slice) else np.asarray(index)
        if len(keys) == 0:
            return np.zeros((0, self.shape[1]), self.dtype)
        return self._decode(self._records().__getitems__([int(k) for k in keys]))

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
