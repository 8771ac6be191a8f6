"""The suite's own scheduling: under pytest-xdist's `--dist loadgroup` (pyproject.toml), the
tests that share a module-scoped fixture go to one worker, so the fixture is built once
(conftest.py marks them). pytest-xdist does it by renaming each marked test's node id to end
in "@<group>"; pytest 9 no longer reads the attribute it renames, and every worker then
built every module fixture again (the export's runs, 3 minutes each, twice), silently."""

import pytest


@pytest.fixture(scope="module")
def shared() -> object:
    return object()


def test_tests_sharing_a_module_fixture_are_one_group(request, shared):
    if not getattr(request.config.option, "loadgroup", False):  # set in xdist workers
        pytest.skip("not run by pytest-xdist with --dist loadgroup (-n 0, or no xdist)")
    assert request.node.nodeid.endswith("@" + request.module.__name__), request.node.nodeid
