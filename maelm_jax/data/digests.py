"""What a corpus file holds, as an identity that does not depend on where it lies.

Inputs data is keyed by its sources' content (`sources.source_fingerprint`), so a corpus
copied to another directory or machine finds the blocks prepared from it. A local file is
known by its size and SHA-256, computed once per (path, size, modification time, inode)
and remembered in the user cache (`maelm_jax.infra.user_cache`, ``file_digests/``), so a run
reads a file again only after it changed. An object in a bucket is known by its size and
the checksum its store keeps (MD5 or CRC32C), and hashed like a local file where the store
keeps none.
"""

from __future__ import annotations

import hashlib
import json
import os

from absl import logging

from maelm_jax.infra import paths, user_cache

_CHUNK = 1 << 20
# Object metadata that is a checksum of the content, in order of preference.
_STORE_CHECKSUMS = ("md5Hash", "crc32c")


def content_identity(path: str) -> list:
    """[size, "<algorithm>:<digest>"] of a local file or bucket object."""
    if paths.is_uri(path):
        info, version = paths.object_info(path)
        for name in _STORE_CHECKSUMS:
            if info.get(name):
                return [info["size"], f"{name}:{info[name]}"]
        return [info["size"], _remembered(path, [path, info["size"], version])]
    stat = os.stat(path)
    key = [os.path.abspath(path), stat.st_size, stat.st_mtime_ns, stat.st_ino]
    return [stat.st_size, _remembered(path, key)]


def _remembered(path: str, key: list) -> str:
    """The file's "sha256:<hex>", from the cache entry of `key` or computed (and kept)."""
    name = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]
    entry = user_cache.directory("file_digests", name[:2], name)
    if entry.is_file():  # written whole (atomically) or not at all
        return entry.read_text()
    value = f"sha256:{sha256_of(path)}"
    try:
        paths.write_atomically(paths.Path(entry), value)
    except OSError as e:  # a read-only home: correct, only slower next time
        logging.info("cannot keep the digest of %s in %s: %s", path, entry, e)
    return value


def sha256_of(path: str) -> str:
    """The hex SHA-256 of a file's bytes, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with paths.Path(path).open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
