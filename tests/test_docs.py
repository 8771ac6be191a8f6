"""README.md and docs/: every relative link points at a file that exists and, with a
#fragment, at one of its headings (GitHub's anchors)."""

import re

import pytest

from conftest import REPO_ROOT

pytestmark = pytest.mark.tier("unit")

LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path) -> set[str]:
    return {_anchor(line.lstrip("#")) for line in path.read_text().splitlines()
            if line.startswith("#")}


def test_links_between_readme_and_docs_resolve():
    files = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    assert len(files) > 5
    broken = []
    for source in files:
        in_code = False
        for line in source.read_text().splitlines():
            in_code ^= line.startswith("```")
            for target in ([] if in_code else LINK.findall(line)):
                if "://" in target or target.startswith(("mailto:", "#!")):
                    continue
                file_part, _, fragment = target.partition("#")
                path = (source.parent / file_part).resolve() if file_part else source
                if not path.exists():
                    broken.append(f"{source.name}: {target} (no such file)")
                elif fragment and path.suffix == ".md" and fragment not in _anchors(path):
                    broken.append(f"{source.name}: {target} (no such heading)")
    assert not broken, broken


# A repository path as the docs and messages write it: under a top-level folder of the
# project (or main.py), no placeholder (<...>, *, NAME in capitals).
REPO_PATH = re.compile(r"^(?:maelm_jax|tests|benchmarks|scripts|configs|docs)/[\w./-]*$"
                       r"|^main\.py$")


def _missing(candidates) -> list[str]:
    missing = []
    for where, text in candidates:
        path = re.sub(r"\.py:\w+$", ".py", text.split("::")[0])
        # A folder named as a destination ("commit it under .../tpu_suite/") may be new.
        exists = (REPO_ROOT / path).exists() or (
            path.endswith("/") and (REPO_ROOT / path).parent.is_dir())
        if (REPO_PATH.match(path) and not re.search(r"[A-Z]{3,}|\.\.\.", path)
                and not exists):
            missing.append(f"{where}: {text}")
    return missing


def test_paths_the_docs_name_exist():
    """Every repository path written in backticks in README and docs/ exists: a file
    moved or renamed is caught here, not by a reader."""
    files = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    found = [(f"{f.name}", span) for f in files
             for span in re.findall(r"`([^`\s]+)`", f.read_text())]
    assert len(found) > 100
    assert _missing(found) == []


def test_paths_named_in_messages_exist():
    """The same for paths that the project's messages and comments name (an error that
    points at maelm_jax/objectives after it moved sends the user nowhere)."""
    import ast

    found = []
    for file in sorted((REPO_ROOT / "maelm_jax").rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found += [(file.name, word.strip("`'\"(),;:.")) for word in node.value.split()]
    assert _missing(found) == []


def test_the_modes_are_listed_once_as_main_py_runs_them():
    """docs/layout.md's table of modes is main.py's MODES (read from its source, so no
    flags are defined here): the same modes, each with the configs its entry states."""
    import ast

    tree = ast.parse((REPO_ROOT / "main.py").read_text())
    modes = next(node.value for node in tree.body if isinstance(node, ast.AnnAssign)
                 and getattr(node.target, "id", "") == "MODES")
    configs = {key.value: value.args[0].value for key, value in
               zip(modes.keys, modes.values, strict=True)}
    assert {"pretrain", "finetune", "rank", "export"} <= set(configs)
    text = (REPO_ROOT / "docs" / "layout.md").read_text()
    section = text.split("## Modes")[1].split("\n## ")[0]
    rows = re.findall(r"^\| `(\w+)` \| (.+?) \| .+ \|$", section, re.M)
    assert [name for name, _ in rows] == list(configs)
    for name, cell in rows:
        assert configs[name].split(" ")[0] in cell, name
