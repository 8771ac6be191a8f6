"""Corpus sources: where the pretraining text comes from.

A source is a config mapping (an ``ml_collections.ConfigDict`` or a dict) with a ``kind``,
a mixing ``weight`` (a number > 0, default 1.0; the mixture itself is the loader's job)
and the kind's own fields:

=================  ==========================================================================
kind               fields (default)
=================  ==========================================================================
``builtin``        none: English prose from the Python stdlib docstrings (no download).
``text``           ``path``; ``doc_separator``: ``"blank_line"`` (documents are separated by
                   blank lines) or ``"line"`` (one document per line).
``jsonl``          ``path``; ``text_field`` (``"text"``): one JSON object per line.
``wikiextractor``  ``path``: WikiExtractor output (``<doc id=.. title=..>`` ... ``</doc>``);
                   a document is the article body without its title line; title-only stubs
                   are dropped.
``tfds``           ``name``; ``split`` (``"train"``); ``data_dir`` (None: the TFDS default);
                   ``feature`` (``"text"``); ``download`` (False: the dataset must already be
                   prepared in ArrayRecord format; True lets TFDS download and prepare it).
``parquet``        ``path``; ``text_field`` (``"text"``); ``filter_field``, ``filter_value``
                   (keep the rows whose column equals the value): Parquet files, one
                   document per row (maelm_jax/data/columnar.py).
``hf_disk``        ``path``: a ``datasets.save_to_disk`` directory; ``split`` (``"train"``,
                   for a DatasetDict); ``text_field``, ``filter_field``, ``filter_value``.
=================  ==========================================================================

``path`` is a file, a directory (all its files, recursively, hidden files skipped), a glob
(``**`` allowed) or several of those separated by commas (or a list), local or in a
bucket (``gs://bucket/corpus/*.txt``). Compressed files (gzip, bzip2, xz, zstd: ``.gz``,
``.bz2``, ``.xz``, ``.zst``, or recognised by their first bytes) are decompressed as they
are read, by fsspec's codecs. Files are read as
UTF-8, line by line, so a multi-GB file is never held in memory; invalid bytes are either
replaced by U+FFFD and counted (``encoding_errors="replace"``) or fatal (``"strict"``).
TFDS sources read through ``tfds.data_source`` (ArrayRecord random access), which needs no
TensorFlow.

Pathological text (a minified file, a whole book on one line, a file without blank lines,
text8's single 100 MB line, stray NUL bytes) is cleaned and bounded here, for every kind,
before the tokenizer sees it:

* control characters (C0 and C1: NUL, form feed, vertical tab, a carriage return inside a
  line, ...; tab and newline excepted) become spaces, as the tokenizer's normaliser would
  treat them as whitespace at best and Python's ``splitlines`` as line breaks;
* a line longer than ``MAX_LINE_CHARS`` is split at whitespace into lines of at most that
  length (the tokenizer treats a line break like a space, so the tokens do not change;
  SentencePiece's trainer would otherwise skip the whole line);
* a document longer than ``MAX_DOCUMENT_CHARS`` is no real document (Wikipedia's longest
  articles are a fifth of that): it is cut at line breaks into consecutive parts of at
  most ``DOCUMENT_PART_CHARS``, each a document of its own, so that no document takes long
  to tokenise or pack and a corpus without document boundaries still has enough documents
  for the validation split (held out by document).

All three are counted in ``ReadStats`` and logged by the preparation.
"""

import dataclasses
import hashlib
import json
import platform
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from maelm_jax.data import builtin_corpus, columnar, digests

# The file layer: SourceError is this module's error too; resolve_paths and compression
# are part of what a source is.
from maelm_jax.data.files import (  # noqa: F401
    SourceError,
    check_readable,
    compression,
    decode,
    read_lines,
    resolve_paths,
)

ENCODING_ERRORS = ("replace", "strict")
DOC_SEPARATORS = ("blank_line", "line")
# Kinds whose documents come from files, one work item each in the Beam preparation: the
# text kinds, read line by line, and the columnar ones (data/columnar.py).
TEXT_KINDS = ("text", "jsonl", "wikiextractor")
FILE_KINDS = (*TEXT_KINDS, *columnar.KINDS)

# Bump when a reader changes what it yields, so fingerprints of prepared data change too.
_READER_VERSION = 3
# Longest line yielded (characters). 4 bytes per character at most, so every line fits
# SentencePiece's max_sentence_length (tokenizer._MAX_SENTENCE_BYTES = 16384 bytes).
MAX_LINE_CHARS = 4096
# Longest document yielded whole (characters): about 250K tokens, well under a second to
# encode. A longer one is cut into parts of at most DOCUMENT_PART_CHARS (about 5K tokens):
# a 20 MB line becomes about a thousand documents, of which validation_fraction = 0.01
# holds out about ten.
MAX_DOCUMENT_CHARS = 1_000_000
DOCUMENT_PART_CHARS = 20_000
# Control characters (Unicode category Cc) but tab and newline.
_CONTROL_CHARS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# Records fetched per ArrayRecord read: amortises the per-call overhead.
_TFDS_BATCH = 1024

# kind -> (required fields, optional fields with their defaults).
_KIND_FIELDS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "builtin": ((), {}),
    "text": (("path",), {"doc_separator": "blank_line"}),
    "jsonl": (("path",), {"text_field": "text"}),
    "wikiextractor": (("path",), {}),
    "tfds": (("name",), {"split": "train", "data_dir": None, "feature": "text",
                         "download": False}),
    "parquet": (("path",), {"text_field": "text", "filter_field": "", "filter_value": None}),
    "hf_disk": (("path",), {"split": "train", "text_field": "text", "filter_field": "",
                            "filter_value": None}),
}

# Field types (weight is checked on its own: it must also be > 0).
_FIELD_TYPES: dict[str, tuple[type | tuple[type, ...], str]] = {
    "path": ((str, list, tuple), "a path, a glob, comma-separated paths or a list"),
    "doc_separator": (str, "a string"),
    "text_field": (str, "a string"),
    "name": (str, "a TFDS dataset name"),
    "split": (str, "a TFDS split such as 'train' or 'train[:90%]'"),
    "data_dir": ((str, type(None)), "a directory or None"),
    "feature": (str, "a feature name"),
    "download": (bool, "True or False"),
    "filter_field": (str, "a column name, or empty for no filter"),
    "filter_value": ((str, int, float, bool, type(None)), "a column value"),
}


@dataclasses.dataclass
class ReadStats:
    """Counters filled in while a source is read; pass one to ``iter_documents``."""

    files: int = 0
    documents: int = 0
    # Invalid UTF-8 byte sequences replaced by U+FFFD (encoding_errors="replace").
    replaced: int = 0
    # Lines longer than MAX_LINE_CHARS, split into shorter ones.
    long_lines: int = 0
    # Documents longer than MAX_DOCUMENT_CHARS, cut into parts.
    long_documents: int = 0
    # Control characters replaced by spaces.
    control_chars: int = 0
    # Null values of a columnar source's text column, skipped.
    nulls: int = 0
    # Rows of a columnar source left out by its filter (filter_field != filter_value).
    filtered: int = 0
    # Documents (rows, records) read, and those of them empty once cleaned.
    read: int = 0
    empty: int = 0

    def merge(self, other: "ReadStats") -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))

    def nothing_read(self, settings: dict[str, Any], field_name: str) -> str:
        """Why a source gave no document, in words: what was read and what was skipped."""
        where = settings.get("path") or settings.get("name") or settings["kind"]
        counts = [f"{self.read + self.nulls + self.filtered} row(s) or document(s) read in "
                  f"{self.files} file(s)"]
        if self.nulls:
            counts.append(f"{self.nulls} null {settings.get('text_field', 'text')!r} value(s) "
                          "skipped")
        if self.filtered:
            counts.append(f"{self.filtered} row(s) whose {settings['filter_field']!r} is not "
                          f"{settings['filter_value']!r} left out")
        if self.empty:
            counts.append(f"{self.empty} empty once cleaned (whitespace and control "
                          "characters)")
        if self.filtered and not self.read:
            hint = f"check {field_name}.filter_value"
        elif self.nulls and not self.read:
            hint = f"check {field_name}.text_field"
        else:
            hint = "give a source with text"
        return (f"{field_name}: {where} yields no document ({'; '.join(counts)}); {hint}")

    def bounded_summary(self) -> str:
        """What the cleaning and the length bounds did, for the preparation log ("" when
        nothing)."""
        parts = []
        if self.nulls:
            parts.append(f"{self.nulls} null text value(s) skipped")
        if self.control_chars:
            parts.append(f"{self.control_chars} control character(s) (NUL, form feed, ...) "
                         "replaced by spaces")
        if self.long_lines:
            parts.append(f"{self.long_lines} line(s) longer than {MAX_LINE_CHARS} characters "
                         "split at whitespace")
        if self.long_documents:
            parts.append(f"{self.long_documents} document(s) longer than {MAX_DOCUMENT_CHARS} "
                         f"characters cut into parts of at most {DOCUMENT_PART_CHARS}")
        return "; ".join(parts)


def source_settings(source: Mapping[str, Any], field_name: str = "source") -> dict[str, Any]:
    """Returns the source as a plain dict with defaults filled in; checks kind and fields.

    Files are not looked at here (see ``validate_source``).
    """
    settings = source.to_dict() if hasattr(source, "to_dict") else dict(source)
    kind = settings.get("kind")
    if kind not in _KIND_FIELDS:
        raise SourceError(f"{field_name}.kind: unknown source kind {kind!r}; expected one of "
                          f"{', '.join(_KIND_FIELDS)}")
    required, optional = _KIND_FIELDS[kind]
    allowed = {"kind", "weight", *required, *optional}
    unknown = sorted(set(settings) - allowed)
    if unknown:
        raise SourceError(f"{field_name}.{unknown[0]}: unknown field for a {kind!r} source; "
                          f"expected fields: {', '.join(sorted(allowed))}")
    for name in required:
        if settings.get(name) in (None, ""):
            raise SourceError(f"{field_name}.{name}: required for a {kind!r} source")
    weight = settings.setdefault("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
        raise SourceError(f"{field_name}.weight: expected a number > 0, got {weight!r}")
    for name, default in optional.items():
        if settings.get(name) is None:
            settings[name] = default
    for name, value in settings.items():
        expected = _FIELD_TYPES.get(name)
        if expected and not isinstance(value, expected[0]):
            raise SourceError(f"{field_name}.{name}: expected {expected[1]}, got {value!r}")
    if kind == "text" and settings["doc_separator"] not in DOC_SEPARATORS:
        raise SourceError(f"{field_name}.doc_separator: expected one of "
                          f"{', '.join(DOC_SEPARATORS)}, got {settings['doc_separator']!r}")
    return settings


def validate_source(source: Mapping[str, Any], field_name: str) -> None:
    """Raises SourceError unless the source can be read.

    Checks the kind and fields; for file kinds that every path or glob matches readable,
    non-empty files; for tfds that the dataset is prepared (unless ``download``) and has
    the split. ``field_name`` (e.g. ``"data.sources.main"``) prefixes every message.
    """
    settings = source_settings(source, field_name)
    if settings["kind"] in FILE_KINDS:
        for path in source_files(settings, field_name):
            check_readable(path, f"{field_name}.path")
        if settings["kind"] in columnar.KINDS:
            columnar.check(settings, field_name)
    elif settings["kind"] == "tfds":
        _tfds_builder(settings, field_name)


def source_files(settings: dict[str, Any], field_name: str = "source") -> list[str]:
    """The files a file kind's source reads, in order (settings as source_settings gives
    them)."""
    if settings["kind"] in columnar.KINDS:
        return columnar.files(settings, field_name)
    return resolve_paths(settings["path"], f"{field_name}.path")


def iter_documents(source: Mapping[str, Any], encoding_errors: str = "replace",
                   stats: ReadStats | None = None,
                   required: str | None = None) -> Iterator[str]:
    """Yields the source's documents: non-empty strings, stripped, in a fixed order.

    Args:
      source: the source config (see the module docstring).
      encoding_errors: "replace" (invalid UTF-8 becomes U+FFFD, counted in
        ``stats.replaced`` and logged per file) or "strict" (SourceError naming the file).
      stats: optional counters, updated as documents are read.
      required: the source's config field; when given, a source that yields no document
        is a SourceError naming it, with what was read and skipped (a part of a source,
        as a work item of mode prepare reads, may hold none).
    """
    if encoding_errors not in ENCODING_ERRORS:
        raise SourceError(f"encoding_errors: expected one of {', '.join(ENCODING_ERRORS)}, "
                          f"got {encoding_errors!r}")
    settings = source_settings(source)
    own = ReadStats()  # this source's (`stats` may be shared by several)
    try:
        for raw in _raw_documents(settings, encoding_errors, own):
            own.read += 1
            raw, replaced = _CONTROL_CHARS.subn(" ", raw)
            own.control_chars += replaced
            kept = 0
            for document in _bounded(raw.strip(), own):
                document = document.strip()
                if document:
                    own.documents += 1
                    kept += 1
                    yield document
            own.empty += not kept
        if required and not own.documents:
            raise SourceError(own.nothing_read(settings, required))
    finally:
        if stats is not None:
            stats.merge(own)


def first_document(source: Mapping[str, Any], field_name: str,
                   encoding_errors: str = "replace") -> str:
    """The source's first document; a SourceError naming `field_name`, with what was read
    and skipped, when it yields none (before a tokenizer is trained on nothing)."""
    for document in iter_documents(source, encoding_errors, required=field_name):
        return document
    raise AssertionError("iter_documents(required=...) yields or raises")


def _bounded(document: str, stats: ReadStats) -> list[str]:
    """The document as one or more documents whose lines and lengths are within bounds."""
    if len(document) <= MAX_LINE_CHARS:
        return [document]  # the common case: nothing to look at
    lines = document.split("\n")
    if any(len(line) > MAX_LINE_CHARS for line in lines):
        stats.long_lines += sum(len(line) > MAX_LINE_CHARS for line in lines)
        lines = [piece for line in lines for piece in split_line(line, MAX_LINE_CHARS)]
    if len(document) <= MAX_DOCUMENT_CHARS:
        return ["\n".join(lines)]
    stats.long_documents += 1
    return _parts(lines)


def _parts(lines: list[str]) -> list[str]:
    """Consecutive lines joined into parts of at most DOCUMENT_PART_CHARS (a longer line
    is a part of its own)."""
    parts, part, size = [], [], 0
    for line in lines:
        if part and size + len(line) + 1 > DOCUMENT_PART_CHARS:
            parts.append("\n".join(part))
            part, size = [], 0
        part.append(line)
        size += len(line) + 1
    parts.append("\n".join(part))
    return parts


def split_line(line: str, max_chars: int) -> list[str]:
    """Pieces of at most `max_chars`, cut at the last whitespace of each window (the
    whitespace itself dropped), or hard when a window has none."""
    pieces = []
    start = 0
    while len(line) - start > max_chars:
        window_end = start + max_chars
        cut = max(line.rfind(" ", start + 1, window_end + 1),
                  line.rfind("\t", start + 1, window_end + 1))
        if cut <= start:
            pieces.append(line[start:window_end])
            start = window_end
        else:
            pieces.append(line[start:cut])
            start = cut + 1
    pieces.append(line[start:])
    return pieces


def source_fingerprint(source: Mapping[str, Any]) -> str:
    """Returns a stable hex digest of what the source yields, to reuse prepared data.

    It covers the settings (with defaults filled in; ``weight`` excluded because it changes
    the mixture, not this source's documents), the reader version and: for file kinds each
    matched file's size and content digest, in order (`digests.content_identity`; not the
    path, so a copy of the corpus elsewhere is the same source); for builtin the Python
    version; for tfds the prepared dataset's version and per-split sizes.
    ``encoding_errors`` is an argument of ``iter_documents``, not a setting: callers that
    vary it must hash it themselves.
    """
    settings = source_settings(source)
    settings.pop("weight")
    payload: dict[str, Any] = {"reader_version": _READER_VERSION, "settings": settings}
    kind = settings["kind"]
    if kind in FILE_KINDS:
        # What the files hold, in order; not where they are (a copied corpus is the same).
        files = source_files(settings)
        settings.pop("path")
        payload["files"] = [digests.content_identity(file) for file in files]
    elif kind == "builtin":
        payload["python"] = platform.python_version()
        payload["builtin"] = [builtin_corpus.CORPUS_VERSION, builtin_corpus.MIN_DOCSTRING_WORDS,
                              builtin_corpus.MIN_DOCUMENT_WORDS]
    elif kind == "tfds":
        info = _tfds_builder(settings, "source").info
        payload["tfds"] = {"version": str(info.version), "splits": {
            name: [split.num_examples, split.num_bytes] for name, split in info.splits.items()}}
    blob = json.dumps(payload, sort_keys=True, default=str).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:20]


def _raw_documents(settings: dict[str, Any], encoding_errors: str,
                   stats: ReadStats) -> Iterator[str]:
    kind = settings["kind"]
    if kind == "builtin":
        yield from builtin_corpus.iter_documents()
        return
    if kind == "tfds":
        yield from _tfds_documents(settings, encoding_errors, stats)
        return
    if kind in columnar.KINDS:
        yield from columnar.documents(settings, stats)
        return
    for path in resolve_paths(settings["path"]):
        check_readable(path, "path")
        stats.files += 1
        lines = read_lines(path, encoding_errors, stats)
        if kind == "text" and settings["doc_separator"] == "line":
            yield from (line for _, line in lines)
        elif kind == "text":
            yield from _blank_line_documents(lines, stats)
        elif kind == "jsonl":
            yield from _jsonl_documents(lines, path, settings["text_field"])
        else:
            yield from _wikiextractor_documents(lines)


def _blank_line_documents(lines: Iterable[tuple[int, str]], stats: ReadStats) -> Iterator[str]:
    paragraph: list[str] = []
    size, continued = 0, False
    for _, line in lines:
        if line.strip():
            if paragraph and size + len(line) > MAX_DOCUMENT_CHARS:
                # A file without blank lines is not one document to hold in memory: it is
                # cut into parts as it is read, as _bounded cuts other over-long documents.
                stats.long_documents += not continued  # once per document
                continued = True
                yield from _parts(paragraph)
                paragraph, size = [], 0
            paragraph.append(line)
            size += len(line) + 1
        elif paragraph:
            yield from (_parts(paragraph) if continued else ["\n".join(paragraph)])
            paragraph, size, continued = [], 0, False
    if paragraph:
        yield from (_parts(paragraph) if continued else ["\n".join(paragraph)])


def _jsonl_documents(lines: Iterable[tuple[int, str]], path: str,
                     text_field: str) -> Iterator[str]:
    for lineno, line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise SourceError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
        if not isinstance(record, dict) or text_field not in record:
            raise SourceError(f"{path}:{lineno}: record has no field {text_field!r} "
                              f"(set the source's text_field)")
        text = record[text_field]
        if not isinstance(text, str):
            raise SourceError(f"{path}:{lineno}: field {text_field!r} is "
                              f"{type(text).__name__}, expected a string")
        yield text


def _wikiextractor_documents(lines: Iterable[tuple[int, str]]) -> Iterator[str]:
    body: list[str] | None = None  # None: outside a <doc> element
    title_pending = False
    for _, line in lines:
        if body is None:
            if line.startswith("<doc "):
                body, title_pending = [], True
        elif line.strip() == "</doc>":
            yield "\n".join(body)  # an empty body (a title-only stub) is dropped later
            body = None
        elif title_pending:
            title_pending = False  # WikiExtractor repeats the title as the first line
        else:
            body.append(line)


def _tfds_builder(settings: dict[str, Any], field_name: str) -> Any:
    """Returns the TFDS builder, checking that it exists, is prepared and has the split."""
    import tensorflow_datasets as tfds  # heavy import: only tfds sources pay for it

    name, data_dir = settings["name"], settings["data_dir"]
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except Exception as e:  # tfds raises many types; the first line says what was wrong
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SourceError(f"{field_name}.name: TFDS dataset {name!r}: {message}") from None
    if settings["download"]:
        return builder
    if not builder.is_prepared():
        raise SourceError(f"{field_name}.name: TFDS dataset {name!r} is not prepared in "
                          f"{builder.data_dir}; prepare it with file_format='array_record' or "
                          f"set {field_name}.download=True")
    readable = tfds.core.file_adapters.FileFormat.with_random_access()
    if not set(builder.info.available_file_formats()) & set(readable):
        raise SourceError(f"{field_name}.name: TFDS dataset {name!r} in {builder.data_dir} is "
                          f"stored as {builder.info.file_format.value}, which has no random "
                          f"access; prepare it again with file_format='array_record'")
    split = settings["split"]
    base_split = re.split(r"[\[+]", split)[0]  # "train[:10%]" -> "train"
    if base_split not in builder.info.splits:
        raise SourceError(f"{field_name}.split: TFDS dataset {name!r} has no split {split!r}; "
                          f"available: {', '.join(builder.info.splits)}")
    features = list(builder.info.features.keys())
    if settings["feature"] not in features:
        raise SourceError(f"{field_name}.feature: TFDS dataset {name!r} has no feature "
                          f"{settings['feature']!r}; available: {', '.join(features)}")
    return builder


def _tfds_documents(settings: dict[str, Any], encoding_errors: str,
                    stats: ReadStats) -> Iterator[str]:
    import tensorflow_datasets as tfds

    _tfds_builder(settings, "source")
    name, feature = settings["name"], settings["feature"]
    records = tfds.data_source(name, split=settings["split"], data_dir=settings["data_dir"],
                               download=settings["download"])
    for start in range(0, len(records), _TFDS_BATCH):
        indices = list(range(start, min(start + _TFDS_BATCH, len(records))))
        for index, record in zip(indices, records.__getitems__(indices), strict=False):
            if feature not in record:
                raise SourceError(f"source.feature: TFDS dataset {name!r} has no feature "
                                  f"{feature!r}; available: {', '.join(record)}")
            value = record[feature]
            if isinstance(value, bytes):  # Text features come back as UTF-8 bytes
                value = decode(value, encoding_errors, stats, f"tfds:{name}[{index}]")
            if not isinstance(value, str):
                raise SourceError(f"source.feature: TFDS feature {feature!r} of {name!r} is "
                                  f"{type(value).__name__}, expected text")
            yield value
