"""Corpus files: finding them (paths, directories, globs, buckets), opening them
(compressed or not) and reading them as lines of text (UTF-8, invalid bytes replaced and
counted or fatal). maelm_jax/data/sources.py turns the lines into documents.
"""

from __future__ import annotations

import codecs
import contextlib
import logging
import os
import re
from collections.abc import Iterable, Iterator
from typing import IO, Protocol

import fsspec.compression
import fsspec.utils

from maelm_jax.infra import errors, paths

_GLOB_CHARS = re.compile(r"[*?[]")
# A compressed file's first bytes (bzip2's: "BZh", the block size, a block's magic), for
# files whose name does not say (fsspec's infer_compression reads the suffix).
_MAGIC = ((b"\x1f\x8b", "gzip"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"),
          (re.compile(rb"BZh[1-9]1AY&SY"), "bz2"))


class SourceError(errors.UserError):
    """A data source whose config, files or records cannot be used (one-line message)."""


class Replacements(Protocol):
    """What decoding counts into (sources.ReadStats)."""

    replaced: int  # invalid UTF-8 sequences replaced by U+FFFD


def resolve_paths(path: str | Iterable[str], field_name: str = "path") -> list[str]:
    """Expands a path spec (files, directories, globs; comma-separated or a list) to files.

    The order is deterministic: specs in the given order, each expanded sorted; duplicates
    are dropped. Raises SourceError for a spec that matches nothing.
    """
    specs = path.split(",") if isinstance(path, str) else list(path)
    specs = [str(s).strip() for s in specs if str(s).strip()]
    specs = [s if paths.is_uri(s) else os.path.expanduser(s) for s in specs]
    if not specs:
        raise SourceError(f"{field_name}: expected a file, directory or glob, got {path!r}")
    files: dict[str, None] = {}  # an ordered set
    for spec in specs:
        if _GLOB_CHARS.search(spec):
            matches = sorted(paths.glob(spec))
            if not matches:
                raise SourceError(f"{field_name}: no file matches the glob {spec!r}")
        elif paths.Path(spec).exists():
            matches = [spec]
        else:
            raise SourceError(f"{field_name}: no such file or directory {spec!r}")
        spec_files = [file for match in matches for file in (
            _files_under(match) if paths.Path(match).is_dir() else [match])]
        if not spec_files:
            raise SourceError(f"{field_name}: {spec!r} contains no files")
        files.update(dict.fromkeys(spec_files))
    return list(files)


def _files_under(directory: str) -> Iterator[str]:
    """Files below `directory` in os.walk's order (a directory's files, then its
    subdirectories), each level sorted; hidden entries (.git, .DS_Store) are not data."""
    if paths.is_uri(directory):
        root = paths.Path(directory)
        found = [f.relative_to(root).parts for f in paths.files_under(root)]
        # The same order as os.walk below: at each level, files before subdirectories.
        found.sort(key=lambda parts: [(1, d) for d in parts[:-1]] + [(0, parts[-1])])
        yield from (os.fspath(root.joinpath(*parts)) for parts in found
                    if not any(part.startswith(".") for part in parts))
        return
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if not name.startswith("."):
                yield os.path.join(dirpath, name)


def check_readable(path: str, field_name: str) -> None:
    file = paths.Path(path)
    if not file.is_file():
        raise SourceError(f"{field_name}: {path!r} is not a regular file")
    try:
        with file.open("rb") as f:
            empty = not f.read(1)
    except OSError as e:
        raise SourceError(f"{field_name}: cannot read {path!r}: {e.strerror or e}") from None
    if empty:
        raise SourceError(f"{field_name}: file {path!r} is empty")


def compression(path: str) -> str | None:
    """The file's compression (an fsspec codec name: "gzip", "bz2", "xz", "zstd") from its
    suffix, else from its first bytes; None for a plain file."""
    by_name = fsspec.utils.infer_compression(path)
    if by_name is None and path.endswith(".zst"):
        by_name = "zstd"  # named even where fsspec has no zstd codec, to say what is missing
    if by_name:
        return by_name
    with paths.Path(path).open("rb") as f:
        head = f.read(10)
    for magic, name in _MAGIC:
        if head.startswith(magic) if isinstance(magic, bytes) else magic.match(head):
            return name
    return None


@contextlib.contextmanager
def open_bytes(path: str) -> Iterator[IO[bytes]]:
    """The file's bytes, decompressed as they are read when it is compressed; local or in a
    bucket."""
    codec_name = compression(path)
    codec = fsspec.compression.compr.get(codec_name)
    if codec_name and codec is None:
        raise SourceError(f"{path}: a {codec_name} file, and this Python has no {codec_name} "
                          "codec (pip install backports.zstd)")
    with paths.Path(path).open("rb") as raw:
        if codec is None:
            yield raw
            return
        with codec(raw, mode="rb") as f:
            yield f


def read_lines(path: str, encoding_errors: str, stats: Replacements) -> Iterator[tuple[int, str]]:
    """Yields (1-based line number, line without its newline), streaming the file (and
    decompressing it, when it is compressed)."""
    replaced_before = stats.replaced
    with open_bytes(path) as f:
        lines = enumerate(f, start=1)
        lineno = 0
        while True:
            try:
                lineno, raw = next(lines)
            except StopIteration:
                break
            except Exception as e:  # each codec has errors of its own (zlib, lzma, zstd)
                kind = compression(path)
                raise SourceError(
                    f"{path}: cannot read past line {lineno} ({e}); a damaged or truncated "
                    f"{kind} file?" if kind else f"{path}: cannot read past line {lineno} "
                    f"({e})") from None
            if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8):]  # a BOM is an encoding mark, not text
            yield lineno, decode(raw, encoding_errors, stats, f"{path}:{lineno}").rstrip("\r\n")
    if stats.replaced > replaced_before:
        logging.warning("%s: replaced %d invalid UTF-8 byte sequence(s) with U+FFFD",
                        path, stats.replaced - replaced_before)


def decode(raw: bytes, encoding_errors: str, stats: Replacements, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if encoding_errors == "strict":
            raise SourceError(f"{where}: invalid UTF-8 at byte {e.start} of the record "
                              f"(encoding_errors='strict'; use 'replace' to keep going)") from None
    text = raw.decode("utf-8", errors="replace")
    # U+FFFD already present in the input (as valid UTF-8) is not a replacement.
    stats.replaced += text.count("\ufffd") - raw.count("\ufffd".encode("utf-8"))
    return text
