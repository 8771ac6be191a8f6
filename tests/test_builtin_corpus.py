"""Tests for the built-in corpus (Python stdlib docstrings)."""

import textwrap

from maelm_jax.data import builtin_corpus

MODULE_SOURCE = textwrap.dedent('''
    """Module docstring: the first paragraph of prose in this small fake module.

    >>> 1 + 1
    2
    >>> for i in range(2):
    ...     print(i)
    0
    1

    Text after the example stays in the document.
    """

    def first(x):
        """Short doc."""

    class Second:
        """The class docstring comes after the first function in source order.

        Its second paragraph is kept as well.
        """

        def method(self):
            """A method docstring that is long enough to be kept in the document."""

            def inner():
                """A nested function docstring, visited after its enclosing method."""

    def third():
        """The last function docstring, written after the class and its methods."""
''')


def _write(root, relative, text):
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_module_document_keeps_source_order_and_drops_doctests_and_short_docstrings(tmp_path):
    _write(tmp_path, "mod.py", MODULE_SOURCE)
    document = builtin_corpus.module_document(str(tmp_path / "mod.py"))
    assert document == (
        "Module docstring: the first paragraph of prose in this small fake module.\n\n"
        "Text after the example stays in the document.\n\n"
        "The class docstring comes after the first function in source order.\n\n"
        "Its second paragraph is kept as well.\n\n"
        "A method docstring that is long enough to be kept in the document.\n\n"
        "A nested function docstring, visited after its enclosing method.\n\n"
        "The last function docstring, written after the class and its methods.")


def test_documents_under_skips_test_suites_caches_and_broken_or_short_files(tmp_path):
    for relative in ["b.py", "pkg/a.py", "test/x.py", "pkg/tests/y.py",
                     "idlelib/idle_test/z.py", "site-packages/w.py", "__pycache__/v.py"]:
        _write(tmp_path, relative, MODULE_SOURCE.replace("fake module", relative))
    _write(tmp_path, "broken.py", '"""An unterminated docstring that is quite long indeed')
    _write(tmp_path, "short.py", '"""A module with far too little text to be a document."""')
    _write(tmp_path, "notes.txt", '"""Not a Python file at all, even if it looks like one."""')
    documents = list(builtin_corpus.documents_under(str(tmp_path)))
    # Sorted walk: files of the root first ("b.py"), then the "pkg" directory.
    assert [d.split("\n")[0] for d in documents] == [
        "Module docstring: the first paragraph of prose in this small b.py.",
        "Module docstring: the first paragraph of prose in this small pkg/a.py.",
    ]


def test_clean_docstring_dedents_and_collapses_blank_lines():
    docstring = "Title line.\n\n    Indented body.\n\n    >>> x\n    1\n\n\n    End."
    assert builtin_corpus.clean_docstring(docstring) == "Title line.\n\nIndented body.\n\nEnd."


def test_iter_documents_reads_the_real_stdlib():
    documents = list(builtin_corpus.iter_documents())
    # CPython 3.11.7 gives 422 documents and 1.62 M characters; other versions differ a
    # little, so only the order of magnitude is pinned here.
    assert 300 < len(documents) < 1000
    assert 1_000_000 < sum(map(len, documents)) < 5_000_000
    for document in documents:
        assert document == document.strip() and document
        assert len(document.split()) >= builtin_corpus.MIN_DOCUMENT_WORDS
        assert not any(line.lstrip().startswith(">>>") for line in document.splitlines())
    assert any("Record of phased-in incompatible language changes." in d for d in documents)
    assert list(builtin_corpus.iter_documents()) == documents  # deterministic
