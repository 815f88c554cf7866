"""The README's links into docs/ resolve: each file exists and each anchor names a heading.

`make docs` checks the pages among themselves (mkdocs' strict build); the README is outside
the site, so its links are checked here, with the same heading ids the site gives.
"""

import pathlib
import re

from markdown.extensions.toc import slugify

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")


def heading_ids(page: pathlib.Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slugify(m, "-") for m in re.findall(r"^#+\s+(.+?)\s*$", text, flags=re.M)}


def test_readme_links_resolve():
    links = [t for t in LINK.findall((ROOT / "README.md").read_text()) if "://" not in t]
    assert any(t.startswith("docs/") for t in links)
    for target in links:
        path, _, anchor = target.partition("#")
        page = ROOT / (path or "README.md")
        assert page.is_file(), f"README links to a missing file: {target}"
        if anchor:
            assert anchor in heading_ids(page), f"README links to a missing heading: {target}"


def test_readme_stays_a_front_door():
    assert len((ROOT / "README.md").read_text().splitlines()) < 400
