"""README.md and docs/: every relative link points at a file that exists and, with a
#fragment, at one of its headings (GitHub's anchors)."""

import re

from conftest import REPO_ROOT

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
