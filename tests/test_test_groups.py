"""The suite's own scheduling: under pytest-xdist's `--dist loadgroup` (pyproject.toml), the
tests that share a module-scoped fixture go to one worker, so the fixture is built once
(conftest.py marks them). pytest-xdist does it by renaming each marked test's node id to end
in "@<group>"; pytest 9 no longer reads the attribute it renames, and every worker then
built every module fixture again (the export's runs, 3 minutes each, twice), silently."""

import pytest

pytestmark = pytest.mark.tier("unit")


@pytest.fixture(scope="module")
def shared() -> object:
    return object()


def test_tests_sharing_a_module_fixture_are_one_group(request, shared):
    if not getattr(request.config.option, "loadgroup", False):  # set in xdist workers
        pytest.skip("not run by pytest-xdist with --dist loadgroup (-n 0, or no xdist)")
    assert request.node.nodeid.endswith("@" + request.module.__name__), request.node.nodeid


def test_every_test_file_declares_its_tier():
    """The tiers are the files' own declarations (conftest.py), not a list beside them: a
    new file without one would stop the collection; this names every such file at once."""
    import ast

    import conftest

    missing = []
    for path in sorted(conftest.TESTS_DIR.rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        declared = [ast.unparse(n.value) for n in tree.body if isinstance(n, ast.Assign)
                    and any(getattr(t, "id", None) == "pytestmark" for t in n.targets)]
        if not any(f"pytest.mark.tier('{t}')" in d for d in declared for t in conftest.TIERS):
            missing.append(path.relative_to(conftest.TESTS_DIR).as_posix())
    assert missing == []
