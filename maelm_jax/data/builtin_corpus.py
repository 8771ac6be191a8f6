"""The built-in corpus: English prose from the Python standard library's docstrings.

It lets a quickstart run train a tokenizer and pretrain a small encoder with no download.
The text is real, human-written English (module, class and function documentation of the
installed Python standard library), read from the ``.py`` sources under
``sysconfig.get_paths()["stdlib"]`` with :mod:`ast`; no module is ever imported.

One document per module: its module, class and function docstrings in source order, each
cleaned with :func:`inspect.cleandoc` and separated by a blank line. Doctest examples (a
``>>>`` line, its ``...`` continuations and its expected output up to the next blank line)
are dropped because they are code, not prose; so are docstrings of fewer than
``MIN_DOCSTRING_WORDS`` words (``"Return self."``) and modules with fewer than
``MIN_DOCUMENT_WORDS`` words in total. Test suites (``test/``, ``tests/``,
``idlelib/idle_test``, ...), ``site-packages`` and caches are skipped.

Size on CPython 3.11.7 (732 source files visited): 422 documents, 1,618,548 characters,
250,412 whitespace-separated words, 31,165 non-empty lines: about 1.6 MB of UTF-8 text,
0.35 M tokens with the quickstart's 8K BPE vocabulary. Enough to train a tokenizer and
a tiny encoder end to end, not to pretrain a useful one. Reading it takes about 2 s the
first time and nothing afterwards (the documents are cached in memory).

The corpus is deterministic for a given Python version: files are visited in sorted order
and the cleaning has no randomness. Another Python version (or a distribution that strips
or patches the stdlib sources) gives a slightly different corpus, so record the Python
version next to anything derived from it.
"""

import ast
import functools
import inspect
import os
import sysconfig
from typing import Iterator

# Docstrings shorter than this are boilerplate ("Return self.", "Deprecated.").
MIN_DOCSTRING_WORDS = 8
# Modules with less text than this carry too little context to be a useful document.
MIN_DOCUMENT_WORDS = 40

# Directory names never entered: test suites (their docstrings are mostly one-line test
# descriptions and fixtures), third-party packages and byte-code caches.
_SKIPPED_DIRS = frozenset({
    "test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
    "__phello__",
})

_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def iter_documents() -> Iterator[str]:
    """Yields the built-in corpus, one non-empty document (str) per stdlib module."""
    documents = _cached_documents(sysconfig.get_paths()["stdlib"])
    if not documents:
        raise RuntimeError(
            "the built-in corpus is empty: this Python installation ships no stdlib "
            "sources with docstrings; use another data source (kind='text', ...)")
    yield from documents


@functools.lru_cache(maxsize=2)
def _cached_documents(stdlib_dir: str) -> tuple[str, ...]:
    # Tokenizer training and packing both read the corpus; parse the sources once.
    return tuple(documents_under(stdlib_dir))


def documents_under(root: str) -> Iterator[str]:
    """Yields one document per ``.py`` file under ``root`` (sorted, skipped dirs pruned)."""
    for path in _python_files(root):
        document = module_document(path)
        if document:
            yield document


def _python_files(root: str) -> Iterator[str]:
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk descending; sorting makes the order deterministic.
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith("test_"):
                yield os.path.join(dirpath, name)


def module_document(path: str) -> str:
    """Returns the cleaned docstrings of one source file as a document, or "" if too short."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)  # bytes: honours coding cookies
    except (SyntaxError, ValueError, OSError):
        return ""  # a broken or unreadable file contributes nothing
    docstrings = [clean_docstring(d) for d in _docstrings_in_source_order(tree)]
    kept = [d for d in docstrings if len(d.split()) >= MIN_DOCSTRING_WORDS]
    document = "\n\n".join(kept)
    return document if len(document.split()) >= MIN_DOCUMENT_WORDS else ""


def _docstrings_in_source_order(node: ast.AST) -> Iterator[str]:
    # ast.walk is breadth-first; a depth-first walk over bodies keeps source order.
    if isinstance(node, _DOC_NODES):
        docstring = ast.get_docstring(node, clean=False)
        if docstring:
            yield docstring
    for child in ast.iter_child_nodes(node):
        yield from _docstrings_in_source_order(child)


def clean_docstring(docstring: str) -> str:
    """Dedents a docstring and removes doctest examples (they are code, not prose)."""
    lines = []
    in_example = False
    for line in inspect.cleandoc(docstring).splitlines():
        stripped = line.strip()
        if stripped.startswith(">>>"):
            in_example = True  # the expected output runs to the next blank line
        elif not stripped:
            in_example = False
        if not in_example and not stripped.startswith("..."):
            lines.append(line.rstrip())
    return _collapse_blank_lines(lines)


def _collapse_blank_lines(lines: list[str]) -> str:
    # Removing examples can leave runs of blank lines; keep single paragraph breaks.
    out: list[str] = []
    for line in lines:
        if line or (out and out[-1]):
            out.append(line)
    return "\n".join(out).strip()
