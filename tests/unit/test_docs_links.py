"""Every relative link of README.md and docs/*.md resolves: the file exists, and a ``#anchor`` is a heading of its page.

Anchors are GitHub's heading slugs: lower case, punctuation other than ``-`` and ``_`` dropped, spaces turned into
``-``, and a repeated slug numbered ``-1``, ``-2``, ...
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from docs_text import PAGES, README, name, prose

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#* *$", re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a linked heading keeps its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(prose(page.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[str]:
    """The link targets in ``page``'s prose (not in code, where ``[x](y)`` is code)."""
    return LINK.findall(INLINE_CODE.sub("", prose(page.read_text())))


def broken(page: Path) -> list[str]:
    problems = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not checked here (no network in tests)
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            problems.append(f"{target}: no file {name(file)}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            problems.append(f"{target}: {name(file)} has no heading with the anchor #{anchor}")
    return problems


def test_slugs_follow_github():
    assert slug("Reader speed (`python benchmarks/readers.py`)") == "reader-speed-python-benchmarksreaderspy"
    assert slug("`DLRMRanker` and `DCNRanker`") == "dlrmranker-and-dcnranker"
    assert slug("Quantized communication (QComms)") == "quantized-communication-qcomms"


def test_the_checker_finds_a_broken_link_and_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## Two words\n\n[ok](#two-words) [ok](b.md#b) [x](#nope) [y](c.md)\n"
                                   "```\n# not a heading\n[z](in-code.md)\n```\n")
    (tmp_path / "b.md").write_text("# B\n")
    problems = broken(tmp_path / "a.md")
    assert [p.split(":")[0] for p in problems] == ["#nope", "c.md"], problems


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_every_relative_link_resolves(page):
    assert not broken(page), f"{name(page)}: broken links: {broken(page)}"


def test_the_readme_links_every_docs_page():
    linked = {(README.parent / target.partition("#")[0]).resolve() for target in links(README)}
    unlinked = [name(page) for page in PAGES[1:] if page.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link to: {unlinked}"
