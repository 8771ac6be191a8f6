"""Corpora as users have them: compressed files (locally and in a bucket), NUL and other
control bytes, text8-like single-line files, a vocabulary the text cannot fill, and a
corpus copied to another path."""

import bz2
import gzip
import json
import logging
import lzma
import shutil

import numpy as np
import pytest

from maelm_jax.data import run_data, sources
from maelm_jax.pretrain import train as pretrain_train
from maelm_jax.text import tokenizer as tokenizer_lib

from fake_bucket import fake_gcs
from support import train_metrics
from tiny_config import tiny_config

pytestmark = pytest.mark.tier("unit")

try:  # the standard library's zstd (Python 3.14), else its backport (requirements.txt)
    from compression import zstd
except ImportError:
    from backports import zstd

COMPRESS = {"gz": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress,
            "zst": zstd.compress}
DOCUMENTS = ["The first document.\nIts second line.", "The second document, with ünïcode."]
# The same documents as each file kind writes them.
FILES = {
    "text": "\n\n".join(DOCUMENTS) + "\n",
    "jsonl": "".join(json.dumps({"text": d}) + "\n" for d in DOCUMENTS),
    "wikiextractor": "".join(f'<doc id="{i}" url="u" title="T{i}">\nT{i}\n{d}\n</doc>\n'
                             for i, d in enumerate(DOCUMENTS)),
}


@pytest.mark.parametrize("suffix", sorted(COMPRESS))
@pytest.mark.parametrize("kind", sorted(FILES))
def test_compressed_files_are_read_as_their_content(tmp_path, kind, suffix):
    packed = COMPRESS[suffix](FILES[kind].encode("utf-8"))
    named = tmp_path / f"corpus.{kind}.{suffix}"
    named.write_bytes(packed)
    assert list(sources.iter_documents({"kind": kind, "path": str(named)})) == DOCUMENTS
    # Recognised by its first bytes when the name does not say.
    unnamed = tmp_path / f"corpus_{kind}"
    unnamed.write_bytes(packed)
    assert sources.compression(str(unnamed)) == sources.compression(str(named))
    assert list(sources.iter_documents({"kind": kind, "path": str(unnamed)})) == DOCUMENTS


@pytest.mark.parametrize("suffix", sorted(COMPRESS))
def test_a_truncated_compressed_file_is_one_line_naming_it(tmp_path, suffix):
    path = tmp_path / f"corpus.txt.{suffix}"
    text = " ".join(map(str, np.random.default_rng(0).integers(0, 10**6, 20_000)))
    packed = COMPRESS[suffix](text.encode())
    path.write_bytes(packed[:len(packed) // 2])
    with pytest.raises(sources.SourceError, match=rf"^{path}: cannot read past line \d+ .*"
                                                   r"damaged or truncated"):
        list(sources.iter_documents({"kind": "text", "path": str(path)}))


def test_compressed_files_in_a_bucket(tmp_path):
    bucket = tmp_path / "gcs" / "bucket" / "corpus"
    bucket.mkdir(parents=True)
    for i, suffix in enumerate(sorted(COMPRESS)):
        (bucket / f"part-{i}.txt.{suffix}").write_bytes(
            COMPRESS[suffix](f"Document {suffix}.\n".encode()))
    with fake_gcs(tmp_path / "gcs"):
        source = {"kind": "text", "path": "gs://bucket/corpus/*"}
        got = list(sources.iter_documents(source))
        fingerprint = sources.source_fingerprint(source)
    assert got == [f"Document {suffix}." for suffix in sorted(COMPRESS)]
    assert len(fingerprint) == 20


def test_nul_and_control_bytes_in_a_file(tmp_path):
    path = tmp_path / "nul.txt"
    path.write_bytes(b"one\x00two\x0cthree\x1bfour\x7ffive\xc2\x85six\tseven\r\n\nnext doc\x00\n")
    stats = sources.ReadStats()
    documents = list(sources.iter_documents({"kind": "text", "path": str(path)}, stats=stats))
    assert documents == ["one two three four five six\tseven", "next doc"]
    assert stats.control_chars == 6
    assert "6 control character(s) (NUL, form feed, ...) replaced by spaces" in (
        stats.bounded_summary())


def _text8_like(path, megabytes, seed=0):
    """One line of `megabytes` MB of lowercase words (text8's layout), with two NUL bytes."""
    rng = np.random.default_rng(seed)
    syllables = np.array(["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "da", "pe", "qu", "ze"])
    vocabulary = np.array(["".join(rng.choice(syllables, size=rng.integers(1, 4)))
                           for _ in range(3000)])
    words = vocabulary[rng.zipf(1.3, size=megabytes * 250_000) % len(vocabulary)]
    text = " ".join(words)[: megabytes * 1_000_000]
    third = len(text) // 3
    path.write_text(text[:third] + "\x00" + text[third:2 * third] + "\x00" + text[2 * third:])
    return path


@pytest.mark.tier("integration")  # seconds: a run
def test_a_text8_like_single_line_corpus_prepares_and_trains(tmp_path, caplog):
    line = _text8_like(tmp_path / "text8", 20)
    c = tiny_config()
    c.data.sources.main.kind = "text"
    c.data.sources.main.path = str(line)
    c.data.validation_fraction = 0.01  # the default
    c.train.num_steps, c.train.eval_every, c.train.checkpoint_every = 2, 2, 2
    with caplog.at_level(logging.WARNING):
        pretrain_train.train_and_evaluate(c, str(tmp_path / "run"))
    assert ("config.data.sources.main: 2 control character(s) (NUL, form feed, ...) replaced "
            "by spaces; 1 line(s) longer than 4096 characters split at whitespace; 1 "
            "document(s) longer than 1000000 characters cut into parts of at most 20000"
            ) in caplog.text
    manifest = json.loads(next((tmp_path / "run" / "data").glob("*/manifest.json")).read_text())
    stats = manifest["sources"]["main"]
    assert stats["train"]["documents"] + stats["valid"]["documents"] >= 1000
    assert stats["valid"]["blocks"] > 0 and stats["read"]["long_lines"] == 1
    assert set(train_metrics(tmp_path / "run")) == {1, 2}
    assert set(train_metrics(tmp_path / "run", "eval")) == {2}


def test_a_vocabulary_the_text_cannot_fill_is_one_line(tmp_path):
    documents = ["alpha beta gamma delta " * 50] * 20  # a dozen distinct characters
    with pytest.raises(tokenizer_lib.TokenizerError,
                       match=r"^vocab_size=1024: the training text yields at most \d+ bpe "
                             r"pieces; lower config.tokenizer.vocab_size or add text$"):
        tokenizer_lib.train_tokenizer(documents, str(tmp_path / "t.model"), 1024)
    assert not (tmp_path / "t.model").exists()


def test_prepared_data_is_reused_for_a_copy_of_the_corpus(tmp_path, tiny_tokenizer, caplog):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt.gz").write_bytes(gzip.compress(
        "\n\n".join(f"document {i} " + "words and more words " * 20 for i in range(300))
        .encode()))
    c = tiny_config("maelm", tiny_tokenizer.model_path)
    c.data.sources.main.kind = "text"
    c.data.sources.main.path = str(corpus)
    c.data.cache_dir = str(tmp_path / "cache")
    first = run_data.build_blocks(c, tmp_path, tiny_tokenizer)
    shutil.copytree(corpus, tmp_path / "moved")
    shutil.rmtree(corpus)
    c.data.sources.main.path = str(tmp_path / "moved")
    with caplog.at_level(logging.INFO):
        second = run_data.build_blocks(c, tmp_path, tiny_tokenizer)
    assert second.directory == first.directory
    assert f"reusing prepared data in {first.directory}" in caplog.text
