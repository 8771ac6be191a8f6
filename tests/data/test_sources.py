"""Tests for corpus sources: every kind, path syntax, errors, encodings, fingerprints."""

import json
import os
import re
import shutil
from pathlib import Path

import ml_collections
import numpy as np
import pytest

from maelm_jax.data import builtin_corpus, digests, sources

pytestmark = pytest.mark.tier("unit")

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def _docs(source, **kwargs):
    return list(sources.iter_documents(source, **kwargs))


def _write(path: Path, content: str | bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return str(path)


# --- builtin -----------------------------------------------------------------------------

def test_builtin_source_yields_the_builtin_corpus():
    documents = _docs({"kind": "builtin", "weight": 1.0})
    assert documents == list(builtin_corpus.iter_documents())
    assert len(documents) > 300


# --- text --------------------------------------------------------------------------------

TEXT = "First doc, line one.\nFirst doc, line two.\n\n\n  \nSecond doc.\r\n\r\nThird doc.\n"


def test_text_blank_line_separator_is_the_default(tmp_path):
    path = _write(tmp_path / "a.txt", TEXT)
    expected = ["First doc, line one.\nFirst doc, line two.", "Second doc.", "Third doc."]
    assert _docs({"kind": "text", "path": path}) == expected
    assert _docs({"kind": "text", "path": path, "doc_separator": "blank_line"}) == expected


def test_text_line_separator_gives_one_document_per_line(tmp_path):
    path = _write(tmp_path / "a.txt", TEXT)
    assert _docs({"kind": "text", "path": path, "doc_separator": "line"}) == [
        "First doc, line one.", "First doc, line two.", "Second doc.", "Third doc."]


def test_text_accepts_a_config_dict_and_counts_files_and_documents(tmp_path):
    path = _write(tmp_path / "a.txt", TEXT)
    stats = sources.ReadStats()
    source = ml_collections.ConfigDict({"kind": "text", "path": path, "weight": 2.0})
    assert len(list(sources.iter_documents(source, stats=stats))) == 3
    assert (stats.files, stats.documents, stats.replaced) == (1, 3, 0)


def test_paths_globs_directories_and_commas_expand_in_a_fixed_order(tmp_path):
    b = _write(tmp_path / "shards" / "b.txt", "from b")
    a = _write(tmp_path / "shards" / "a.txt", "from a")
    nested = _write(tmp_path / "shards" / "sub" / "c.txt", "from c")
    _write(tmp_path / "shards" / ".hidden", "never read")
    extra = _write(tmp_path / "extra.txt", "from extra")
    assert sources.resolve_paths(str(tmp_path / "shards")) == [a, b, nested]
    assert sources.resolve_paths(f"{extra}, {tmp_path}/shards/*.txt,{a}") == [extra, a, b]
    assert sources.resolve_paths(str(tmp_path / "**" / "c.txt")) == [nested]
    source = {"kind": "text", "path": [extra, str(tmp_path / "shards")]}
    assert _docs(source) == ["from extra", "from a", "from b", "from c"]


def test_a_utf8_byte_order_mark_is_not_text(tmp_path):
    text = _write(tmp_path / "bom.txt", "\ufeffFirst line.\n\nSecond.\n".encode("utf-8"))
    assert _docs({"kind": "text", "path": text}) == ["First line.", "Second."]
    jsonl = _write(tmp_path / "bom.jsonl", '\ufeff{"text": "x"}\n'.encode("utf-8"))
    assert _docs({"kind": "jsonl", "path": jsonl}) == ["x"]


# --- jsonl -------------------------------------------------------------------------------

def test_jsonl_reads_the_text_field(tmp_path):
    lines = [{"text": "  one  ", "id": 1}, {"text": "two\nlines"}, {"text": ""}, {"body": "x"}]
    path = _write(tmp_path / "d.jsonl", "\n".join(json.dumps(r) for r in lines[:3]) + "\n\n")
    assert _docs({"kind": "jsonl", "path": path}) == ["one", "two\nlines"]
    other = _write(tmp_path / "e.jsonl", json.dumps(lines[3]) + "\n")
    assert _docs({"kind": "jsonl", "path": other, "text_field": "body"}) == ["x"]


def test_jsonl_line_lacking_the_field_names_file_and_line(tmp_path):
    path = _write(tmp_path / "d.jsonl", '{"text": "ok"}\n{"content": "no text"}\n')
    message = re.escape(f"{path}:2: record has no field 'text'")
    with pytest.raises(sources.SourceError, match=message):
        _docs({"kind": "jsonl", "path": path})


def test_jsonl_invalid_json_and_non_string_field_are_errors(tmp_path):
    bad_json = _write(tmp_path / "bad.jsonl", '{"text": "ok"}\n{"text": \n')
    with pytest.raises(sources.SourceError, match=re.escape(f"{bad_json}:2: invalid JSON")):
        _docs({"kind": "jsonl", "path": bad_json})
    number = _write(tmp_path / "num.jsonl", '{"text": 3}\n')
    with pytest.raises(sources.SourceError, match=r"num.jsonl:1: field 'text' is int"):
        _docs({"kind": "jsonl", "path": number})


# --- wikiextractor -----------------------------------------------------------------------

WIKI = """<doc id="1" url="?curid=1" title="Stub Title">
Stub Title


</doc>
<doc id="2" url="?curid=2" title="Real Article">
Real Article

Real Article is the body's first sentence.
Section.
More body text.

</doc>
"""


def test_wikiextractor_drops_titles_and_stubs(tmp_path):
    _write(tmp_path / "AA" / "wiki_00", WIKI)
    _write(tmp_path / "AB" / "wiki_00", WIKI.replace("Real Article", "Second"))
    documents = _docs({"kind": "wikiextractor", "path": str(tmp_path)})
    assert documents == [
        "Real Article is the body's first sentence.\nSection.\nMore body text.",
        "Second is the body's first sentence.\nSection.\nMore body text.",
    ]


def test_wikiextractor_reads_the_shared_wikipedia_sample():
    wiki = SHARED_DATA / "wiki"
    if not wiki.is_dir():
        pytest.skip(f"shared reference data not found at {wiki} (only on the dev machine)")
    source = {"kind": "wikiextractor", "path": str(wiki)}
    sources.validate_source(source, "data.sources.wiki")
    stats = sources.ReadStats()
    documents = list(sources.iter_documents(source, stats=stats))
    # The README: 24 files, ~36K docs of which ~14K have a body.
    assert stats.files == 24
    assert 13_000 < len(documents) < 15_000
    assert documents[0].startswith("Jarred Shaw (born September 28, 1990)")
    assert not any(d.startswith("<doc") or "</doc>" in d for d in documents)


# --- tfds --------------------------------------------------------------------------------

TFDS_TEXTS = ["hello world", "", "  second document  ", "café"]


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
    """A tiny TFDS dataset in ArrayRecord format, built here without TensorFlow."""
    tfds = pytest.importorskip("tensorflow_datasets")
    tfds.disable_progress_bar()

    # skip_registration: the dataset is then found from its files, as a user's would be.
    class TinyCorpus(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            features = tfds.features.FeaturesDict(
                {"text": tfds.features.Text(), "label": np.int64})
            # disable_shuffling keeps the generation order, so slices are predictable.
            return tfds.core.DatasetInfo(builder=self, features=features,
                                         disable_shuffling=True)

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(TFDS_TEXTS),
                    "test": self._generate_examples(["a test example"])}

        def _generate_examples(self, texts):
            for i, text in enumerate(texts):
                yield i, {"text": text, "label": i}

    data_dir = tmp_path_factory.mktemp("tfds")
    TinyCorpus(data_dir=str(data_dir), file_format="array_record").download_and_prepare()
    return str(data_dir)


def test_tfds_source_reads_array_record_without_tensorflow(tfds_dir):
    source = {"kind": "tfds", "name": "tiny_corpus", "data_dir": tfds_dir}
    sources.validate_source(source, "data.sources.tfds")
    documents = _docs(source)
    assert documents == ["hello world", "second document", "café"]  # "" dropped
    assert _docs({**source, "split": "test"}) == ["a test example"]
    assert _docs({**source, "split": "train[1:3]"}) == ["second document"]


def test_tfds_source_errors_name_the_field(tfds_dir):
    base = {"kind": "tfds", "name": "tiny_corpus", "data_dir": tfds_dir}
    with pytest.raises(sources.SourceError, match=r"^d\.s\.split: .*no split 'dev'"):
        sources.validate_source({**base, "split": "dev"}, "d.s")
    with pytest.raises(sources.SourceError, match=r"^d\.s\.feature: .*available: "):
        sources.validate_source({**base, "feature": "body"}, "d.s")
    with pytest.raises(sources.SourceError, match=r"^d\.s\.name: .*'no_such_dataset_xyz'"):
        sources.validate_source({**base, "name": "no_such_dataset_xyz"}, "d.s")
    with pytest.raises(sources.SourceError, match=r"TFDS feature 'label' .* is int"):
        _docs({**base, "feature": "label"})


def test_tfds_fingerprint_is_stable(tfds_dir):
    source = {"kind": "tfds", "name": "tiny_corpus", "data_dir": tfds_dir}
    assert sources.source_fingerprint(source) == sources.source_fingerprint(dict(source))
    assert sources.source_fingerprint(source) != sources.source_fingerprint(
        {**source, "split": "test"})


# --- validation --------------------------------------------------------------------------

@pytest.mark.parametrize("source, message", [
    ({"kind": "csv", "path": "x"}, r"^data\.sources\.main\.kind: unknown source kind 'csv'"),
    ({"kind": "jsonl"}, r"^data\.sources\.main\.path: required for a 'jsonl' source$"),
    ({"kind": "text", "path": "x", "text_feild": "t"},
     r"^data\.sources\.main\.text_feild: unknown field"),
    ({"kind": "builtin", "weight": 0}, r"^data\.sources\.main\.weight: expected a number > 0"),
    ({"kind": "builtin", "weight": "1"}, r"^data\.sources\.main\.weight: expected a number"),
    ({"kind": "text", "path": "x", "doc_separator": "para"},
     r"^data\.sources\.main\.doc_separator: expected one of blank_line, line"),
    ({"kind": "jsonl", "path": "x", "text_field": 3},
     r"^data\.sources\.main\.text_field: expected a string, got 3$"),
    ({"kind": "tfds", "name": "x", "download": "yes"},
     r"^data\.sources\.main\.download: expected True or False, got 'yes'$"),
])
def test_validate_rejects_bad_settings(source, message):
    with pytest.raises(sources.SourceError, match=message):
        sources.validate_source(source, "data.sources.main")


def test_validate_rejects_missing_unmatched_empty_and_unreadable_files(tmp_path):
    field = "data.sources.main"
    with pytest.raises(sources.SourceError, match=r"^data\.sources\.main\.path: no file "
                                                  r"matches the glob '.*/\*\.txt'$"):
        sources.validate_source({"kind": "text", "path": f"{tmp_path}/*.txt"}, field)
    with pytest.raises(sources.SourceError, match=r"\.path: no such file or directory"):
        sources.validate_source({"kind": "text", "path": str(tmp_path / "nope.txt")}, field)
    empty = _write(tmp_path / "empty.txt", "")
    with pytest.raises(sources.SourceError, match=re.escape(f".path: file '{empty}' is empty")):
        sources.validate_source({"kind": "text", "path": empty}, field)
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(sources.SourceError, match=r"\.path: '.*emptydir' contains no files$"):
        sources.validate_source({"kind": "text", "path": str(tmp_path / "emptydir")}, field)
    if os.geteuid() != 0:  # root reads any file, so the unreadable case cannot be built
        locked = _write(tmp_path / "locked.txt", "secret")
        os.chmod(locked, 0)
        with pytest.raises(sources.SourceError, match=r"\.path: cannot read '.*locked.txt'"):
            sources.validate_source({"kind": "text", "path": locked}, field)
    good = _write(tmp_path / "good.txt", "fine")
    sources.validate_source({"kind": "text", "path": good, "weight": 0.5}, field)


# --- encodings ---------------------------------------------------------------------------

LATIN1 = "caf\u00e9 au lait\n\nna\u00efve \ufffd kept\n".encode("latin-1", errors="ignore")


def test_invalid_utf8_is_replaced_and_counted(tmp_path, caplog):
    # latin-1 "é" and "ï" are single bytes, invalid as UTF-8 (the U+FFFD was dropped).
    path = _write(tmp_path / "latin1.txt", LATIN1 + "real \ufffd\n".encode("utf-8"))
    stats = sources.ReadStats()
    documents = list(sources.iter_documents({"kind": "text", "path": path}, stats=stats))
    assert documents == ["caf\ufffd au lait", "na\ufffdve  kept\nreal \ufffd"]
    assert stats.replaced == 2  # the U+FFFD already in the file is not counted
    assert "replaced 2 invalid UTF-8 byte sequence(s)" in caplog.text


def test_invalid_utf8_fails_in_strict_mode_naming_the_file(tmp_path):
    path = _write(tmp_path / "latin1.txt", LATIN1)
    message = "^" + re.escape(f"{path}:1: invalid UTF-8 at byte 3")
    with pytest.raises(sources.SourceError, match=message):
        _docs({"kind": "text", "path": path}, encoding_errors="strict")
    with pytest.raises(sources.SourceError, match=r"encoding_errors: expected one of"):
        _docs({"kind": "text", "path": path}, encoding_errors="ignore")


# --- fingerprints ------------------------------------------------------------------------

def test_fingerprint_changes_when_a_file_or_a_setting_changes(tmp_path):
    path = tmp_path / "a.txt"
    _write(path, "some text")
    source = {"kind": "text", "path": str(path), "weight": 1.0}
    first = sources.source_fingerprint(source)
    assert sources.source_fingerprint(dict(source)) == first
    # Defaults filled in and the mixing weight do not change what the source yields.
    assert sources.source_fingerprint({**source, "doc_separator": "blank_line"}) == first
    assert sources.source_fingerprint({**source, "weight": 3.0}) == first
    assert sources.source_fingerprint({**source, "doc_separator": "line"}) != first

    _write(path, "some text, longer now")
    second = sources.source_fingerprint(source)
    assert second != first
    # The content decides, not the modification time...
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert sources.source_fingerprint(source) == second
    # ... which tells when to read the file again: the same size, other bytes.
    _write(path, "some text, LONGER now")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))
    assert sources.source_fingerprint(source) not in (first, second)
    _write(tmp_path / "b.txt", "another file")
    assert sources.source_fingerprint({**source, "path": f"{tmp_path}/*.txt"}) != (
        sources.source_fingerprint(source))


def test_a_copied_corpus_has_the_same_fingerprint_and_is_hashed_once(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus"
    for name in ("a.txt", "b.md"):
        _write(corpus / name, f"the text of {name}")
    source = {"kind": "text", "path": str(corpus)}
    first = sources.source_fingerprint(source)
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(corpus, copy)
    assert sources.source_fingerprint({**source, "path": str(copy)}) == first
    assert sources.source_fingerprint({**source, "path": f"{copy}/*"}) == first
    # Another order of the same files is another stream of documents.
    assert sources.source_fingerprint({**source, "path": f"{copy}/b.md,{copy}/a.txt"}
                                      ) != first
    # Remembered: an unchanged file is not read again.
    hashed = []
    sha256_of = digests.sha256_of
    monkeypatch.setattr(digests, "sha256_of", lambda p: hashed.append(p) or sha256_of(p))
    assert sources.source_fingerprint({**source, "path": str(copy)}) == first
    assert not hashed
    (copy / "a.txt").write_text("changed")
    sources.source_fingerprint({**source, "path": str(copy)})
    assert hashed == [str(copy / "a.txt")]


def test_builtin_fingerprint_is_stable():
    fingerprint = sources.source_fingerprint({"kind": "builtin"})
    assert fingerprint == sources.source_fingerprint({"kind": "builtin", "weight": 5})
    assert len(fingerprint) == 20 and int(fingerprint, 16) >= 0
