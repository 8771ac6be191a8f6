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


def test_the_unit_tier_names_what_exists():
    """Every file and test the unit tier names (conftest.py) exists: a renamed one would
    silently leave the tier."""
    import conftest

    for name in conftest.UNIT_FILES:
        assert (conftest.TESTS_DIR / name).is_file(), name
    for test in conftest.NOT_UNIT:
        file, function = test.split("::")
        assert file in conftest.UNIT_FILES, test
        assert f"def {function}(" in (conftest.TESTS_DIR / file).read_text(), test
