"""The built-in corpus: English prose the Python standard library ships with.

It lets a quickstart run train a tokenizer and pretrain a small encoder with no download.
The text is real, human-written English, read from the installed standard library
(``sysconfig.get_paths()["stdlib"]``) with :mod:`ast`; no module is ever imported:

* **Docstrings** of the ``.py`` sources, one document per module: its module, class and
  function docstrings in source order, each cleaned with :func:`inspect.cleandoc` and
  separated by a blank line. Doctest examples (a ``>>>`` line, its ``...`` continuations
  and its expected output up to the next blank line) are dropped because they are code,
  not prose; so are docstrings of fewer than ``MIN_DOCSTRING_WORDS`` words (``"Return
  self."``) and modules with fewer than ``MIN_DOCUMENT_WORDS`` words in total. Test
  suites (``test/``, ``tests/``, ``idlelib/idle_test``, ...), ``site-packages`` and caches
  are skipped.
* **The Language Reference topics** that ``pydoc`` shows for ``help("if")``
  (``pydoc_data/topics.py``, present in every CPython installation): one document per
  topic, in sorted order, without its indented blocks (grammar rules and code examples)
  and heading underlines.

A few hundred docstring documents and some seventy topics, about 2 MB of UTF-8 text:
enough to train a tokenizer and a small encoder end to end, not to pretrain a useful one.
The sources are parsed once per process (the documents are cached in memory).

The corpus is deterministic for a given Python version: files and topics are visited in
sorted order and the cleaning has no randomness. Another Python version (or a
distribution that strips or patches the stdlib sources) gives a slightly different
corpus, so record the Python version next to anything derived from it.
"""

import ast
import functools
import inspect
import os
import sysconfig
from collections.abc import Iterator

# Bumped whenever what the corpus holds changes: prepared data is keyed on it.
CORPUS_VERSION = 2
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

# The Language Reference topics pydoc shows (help("if")), relative to the stdlib directory.
TOPICS_FILE = ("pydoc_data", "topics.py")
# Topic text is reST rendered as plain text: literal blocks (grammar, code) are indented.
_CODE_INDENT = "   "

_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def iter_documents() -> Iterator[str]:
    """Yields the built-in corpus: a document (str) per stdlib module, then per topic."""
    documents = _cached_documents(sysconfig.get_paths()["stdlib"])
    if not documents:
        raise RuntimeError(
            "the built-in corpus is empty: this Python installation ships no stdlib "
            "sources with docstrings; use another data source (kind='text', ...)")
    yield from documents


@functools.lru_cache(maxsize=2)
def _cached_documents(stdlib_dir: str) -> tuple[str, ...]:
    # Tokenizer training and packing both read the corpus; parse the sources once.
    topics_path = os.path.join(stdlib_dir, *TOPICS_FILE)
    return tuple(documents_under(stdlib_dir)) + tuple(topic_documents(topics_path))


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


def topic_documents(path: str) -> Iterator[str]:
    """Yields one document per Language Reference topic of pydoc's ``topics`` dictionary
    (sorted by topic name), read with :func:`ast.literal_eval`; nothing if the file is
    absent or not a dictionary of strings."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, ValueError, OSError):
        return
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "topics" for t in node.targets):
            try:
                topics = ast.literal_eval(node.value)
            except ValueError:
                return
            if isinstance(topics, dict):
                for name in sorted(topics):
                    document = clean_topic(topics[name]) if isinstance(topics[name], str) else ""
                    if len(document.split()) >= MIN_DOCUMENT_WORDS:
                        yield document
            return


def clean_topic(text: str) -> str:
    """Removes a topic's indented blocks (grammar and code), interactive examples and
    heading underlines."""
    lines = [line for line in text.splitlines()
             if not line.startswith(_CODE_INDENT) and not _is_underline(line)]
    return _collapse_blank_lines(_without_examples(lines))


def _is_underline(line: str) -> bool:
    stripped = line.strip()
    return len(stripped) >= 3 and len(set(stripped)) == 1 and stripped[0] in "*=-~^"


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
    return _collapse_blank_lines(_without_examples(inspect.cleandoc(docstring).splitlines()))


def _without_examples(lines: list[str]) -> list[str]:
    kept = []
    in_example = False
    for line in lines:
        stripped = line.strip()
        if stripped.startswith(">>>"):
            in_example = True  # the expected output runs to the next blank line
        elif not stripped:
            in_example = False
        if not in_example and not stripped.startswith("..."):
            kept.append(line.rstrip())
    return kept


def _collapse_blank_lines(lines: list[str]) -> str:
    # Removing examples can leave runs of blank lines; keep single paragraph breaks.
    out: list[str] = []
    for line in lines:
        if line or (out and out[-1]):
            out.append(line)
    return "\n".join(out).strip()
