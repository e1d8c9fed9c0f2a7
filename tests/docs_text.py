"""The documentation as the doc tests read it: README.md and every docs/*.md page."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES: list[Path] = [README, *sorted(DOCS.glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def name(page: Path) -> str:
    """``README.md`` or ``docs/<page>.md``, as error messages show it."""
    return page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else str(page)


def fenced_blocks(language: str) -> list[tuple[Path, str]]:
    """Every ```<language> block of every page, with its page."""
    return [(page, m.group(2)) for page in PAGES for m in FENCE.finditer(page.read_text()) if m.group(1) == language]


def prose(text: str) -> str:
    """``text`` without its fenced code blocks (whose ``#`` lines are comments, not headings)."""
    return FENCE.sub("", text)


def page(relative: str) -> str:
    """The text of one page, e.g. ``docs/configuration.md``."""
    return (ROOT / relative).read_text()
