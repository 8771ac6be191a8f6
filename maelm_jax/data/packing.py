"""Tokenise the corpus once and pack it into blocks of exactly L tokens.

RoBERTa FULL-SENTENCES packing: documents are joined by ``</s>`` into one token stream and
cut into blocks of L - 1 tokens, each preceded by ``<s>``. No padding, so every training
array has a static shape. The tail shorter than a block is dropped.

Blocks are stored once per (corpus, tokenizer, L, split) as raw little-endian arrays read
through ``np.memmap``: random access by index makes shuffling, per-process sharding and
exact resumption free. Documents are assigned to the validation split by a hash of their
text, so the split does not depend on corpus order. Preparation writes into a temporary
directory and renames it when complete, so an interrupted run never leaves data that a
later run would trust.

The cache may be in a bucket (``gs://``). Blocks are then packed in a local temporary
directory and uploaded with ``meta.json`` last (its presence is what marks a set as
complete), and every process reads the arrays whole into memory, since a bucket's
object cannot be memory-mapped.
"""

from __future__ import annotations

import dataclasses
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

from maelm_jax import errors, paths
from maelm_jax import tokenizer as tokenizer_lib

FORMAT_VERSION = 1
_ENCODE_CHUNK = 512  # documents per sentencepiece batch call
_ENCODE_CHUNK_CHARS = 8_000_000  # ... or fewer, so progress is logged every few seconds
_PROGRESS_SECONDS = 10.0


def is_validation(document: str, validation_fraction: float) -> bool:
    """Stable per-document split decision from a CRC of the text."""
    return zlib.crc32(document.encode("utf-8")) % 100_000 < validation_fraction * 100_000


class BlockPacker:
    """Streams token ids into [<s>, L-1 tokens] blocks; `</s>` ends every document."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len
        self._buffer: list[int] = []

    def add(self, ids: Sequence[int]) -> list[list[int]]:
        """Adds one document; returns the blocks completed by it (in time linear in the
        document's length, however long)."""
        self._buffer.extend(ids)
        self._buffer.append(tokenizer_lib.EOS_ID)
        body = self.seq_len - 1
        n = len(self._buffer) // body
        blocks = [[tokenizer_lib.BOS_ID] + self._buffer[i * body:(i + 1) * body]
                  for i in range(n)]
        del self._buffer[:n * body]
        return blocks


@dataclasses.dataclass
class _SplitWriter:
    """Appends blocks of one split of one source to a raw file."""

    path: pathlib.Path
    dtype: np.dtype
    blocks: int = 0

    def __post_init__(self):
        self._file = open(self.path, "wb")

    def write(self, blocks: list[list[int]]) -> None:
        if blocks:
            self._file.write(np.asarray(blocks, dtype=self.dtype).tobytes())
            self.blocks += len(blocks)

    def close(self) -> None:
        self._file.close()


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
) -> dict:
    """Tokenises and packs one source into `<split>_<name>.bin` files; returns counts."""
    dtype = token_dtype(tok.vocab_size)
    writers = {
        split: _SplitWriter(out_dir / f"{split}_{name}.bin", dtype) for split in ("train", "valid")
    }
    packers = {split: BlockPacker(seq_len) for split in writers}
    docs = tokens = 0
    start = last_report = time.monotonic()
    for chunk in chunks(documents):
        for doc, ids in zip(chunk, tok.encode(chunk), strict=False):
            split = "valid" if is_validation(doc, validation_fraction) else "train"
            writers[split].write(packers[split].add(ids))
            docs += 1
            tokens += len(ids) + 1
        now = time.monotonic()
        if now - last_report > _PROGRESS_SECONDS:
            last_report = now
            logging.info(
                "preparing %s: %d documents, %.1fM tokens, %d blocks (%.0f tokens/s)",
                name,
                docs,
                tokens / 1e6,
                writers["train"].blocks,
                tokens / (now - start),
            )
    for w in writers.values():
        w.close()
    logging.info(
        "prepared %s: %d documents, %d tokens -> %d train / %d valid blocks in %.1fs",
        name,
        docs,
        tokens,
        writers["train"].blocks,
        writers["valid"].blocks,
        time.monotonic() - start,
    )
    return {
        "documents": docs,
        "tokens": tokens,
        "train_blocks": writers["train"].blocks,
        "valid_blocks": writers["valid"].blocks,
    }


@dataclasses.dataclass(frozen=True)
class PreparedData:
    """Memory-mapped blocks of every source, each [num_blocks, seq_len] (read into memory
    when the directory is in a bucket)."""

    directory: paths.Path
    seq_len: int
    train: dict[str, np.ndarray]
    valid: dict[str, np.ndarray]
    weights: dict[str, float]

    @classmethod
    def load(cls, directory: paths.Path,
             weights: dict[str, float] | None = None) -> PreparedData:
        """The blocks in `directory`, mixed by `weights` (the config's; every source 1.0
        when None). The cache never decides the mixture: its key leaves the weights out."""
        meta = json.loads(paths.read_text(directory / "meta.json"))
        dtype, L = np.dtype(meta["dtype"]), meta["seq_len"]

        def open_split(split):
            arrays = {}
            for name, stats in meta["sources"].items():
                n = stats[f"{split}_blocks"]
                arrays[name] = (_read_blocks(directory / f"{split}_{name}.bin", dtype, n, L)
                                if n else np.zeros((0, L), dtype))
            return arrays

        return cls(
            directory,
            L,
            open_split("train"),
            open_split("valid"),
            {name: float((weights or {}).get(name, 1.0)) for name in meta["sources"]},
        )


def _read_blocks(path: paths.Path, dtype: np.dtype, n: int, seq_len: int) -> np.ndarray:
    """[n, seq_len] blocks, read-only: memory-mapped from a local file, or read whole from
    a bucket (every process then holds a copy)."""
    if paths.is_local(path):
        return np.memmap(path, dtype=dtype, mode="r", shape=(n, seq_len))
    return np.frombuffer(path.read_bytes(), dtype=dtype).reshape(n, seq_len)


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


def prepare(
    sources: dict[str, tuple[Iterable[str], float]],
    source_fingerprints: dict[str, str],
    tok: tokenizer_lib.Tokenizer,
    seq_len: int,
    validation_fraction: float,
    cache_dir: paths.Path,
) -> PreparedData:
    """Packs every source (name -> (documents, weight)) unless already prepared.

    Returns the memory-mapped blocks, mixed by the weights given here: the prepared blocks
    do not depend on them, so a cache shared by runs of other mixtures serves them all.
    Raises ValueError naming a source that yields no training block, or when the
    validation split is empty.
    """
    fingerprint = data_fingerprint(
        source_fingerprints, tok.model_path, seq_len, validation_fraction
    )
    weights = {name: weight for name, (_, weight) in sources.items()}
    final = cache_dir / fingerprint
    if (final / "meta.json").exists():
        logging.info("reusing prepared data in %s", final)
        return PreparedData.load(final, weights)
    local = paths.is_local(cache_dir)
    paths.make_dirs(cache_dir)
    # Packed beside the final directory, which one rename then completes; for a cache in a
    # bucket, on local disk and then uploaded.
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".tmp-", dir=cache_dir if local else None))
    try:
        meta = {
            "format": FORMAT_VERSION,
            "seq_len": seq_len,
            "dtype": token_dtype(tok.vocab_size).str,
            "sources": {},
        }
        for name, (documents, _) in sources.items():
            stats = pack_source(documents, tok, seq_len, validation_fraction, tmp, name)
            if stats["train_blocks"] == 0:
                raise errors.UserError(
                    f"config.data.sources.{name}: {stats['tokens']} tokens do not fill one "
                    f"training block of data.seq_len={seq_len}; add text or lower seq_len"
                )
            meta["sources"][name] = stats
        if sum(s["valid_blocks"] for s in meta["sources"].values()) == 0:
            raise errors.UserError(
                "config.data.validation_fraction: no validation block of "
                f"data.seq_len={seq_len} was held out; raise it or add text"
            )
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        if local:
            os.replace(tmp, final)
        else:  # meta.json last: a set without it is incomplete and is prepared again
            for file in sorted(tmp.iterdir(), key=lambda f: f.name == "meta.json"):
                paths.upload(file, final / file.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return PreparedData.load(final, weights)
