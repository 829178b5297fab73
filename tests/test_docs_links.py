"""The README stays short, and every relative link in it and in docs/ resolves.

A relative link is a Markdown link or image target that is not a URL
(``http:``, ``mailto:`` ...) and not a bare ``#anchor``; it must name a file or
folder of the repository, and where it carries ``#anchor`` into a Markdown file,
a heading of that file must produce the anchor (GitHub's rule: lower case,
punctuation dropped, spaces to hyphens).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250

# Pages linked before they are written (none now): a link into this set is not
# reported, so a page and its README link can land in either order.
PENDING_PAGES: frozenset[str] = frozenset()

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")
URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]


def links(path: Path) -> list[str]:
    """Link targets outside fenced code blocks."""
    found: list[str] = []
    in_fence = False
    for line in path.read_text().splitlines():
        if FENCE.match(line.strip()):
            in_fence = not in_fence
            continue
        if not in_fence:
            found += LINK.findall(line)
    return found


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file."""
    out: set[str] = set()
    in_fence = False
    for line in path.read_text().splitlines():
        if FENCE.match(line.strip()):
            in_fence = not in_fence
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m and not in_fence:
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))  # a link: its text
            text = re.sub(r"[^\w\- ]", "", text.lower().replace("`", ""))
            out.add(text.replace(" ", "-"))
    return out


def broken_links(
    path: Path, root: Path = ROOT, pending: frozenset[str] = PENDING_PAGES
) -> list[str]:
    """Every relative link of ``path`` that does not resolve inside ``root``, with why."""
    broken = []
    for target in links(path):
        if URL.match(target):
            continue
        if target.startswith("#"):
            if target[1:] not in anchors(path):
                broken.append(f"{target}: no such heading")
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve()
        if not resolved.is_relative_to(root):
            broken.append(f"{target}: outside the repository")
            continue
        relative = resolved.relative_to(root).as_posix()
        if not resolved.exists():
            if relative not in pending:
                broken.append(f"{target}: no such file")
            continue
        if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {relative}")
    return broken


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(path: Path) -> None:
    assert broken_links(path) == []


def test_the_readme_is_under_the_line_limit() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; keep it under 250"


def test_a_broken_link_is_caught(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other page\n")
    page = tmp_path / "README.md"
    page.write_text(
        "# Title\n[ok](#title) [gone](#nowhere) [web](https://example.org)\n"
        "[page](docs/other.md#other-page) [heading](docs/other.md#elsewhere)\n"
        "[missing](docs/none.md) [pending](docs/later.md) [up](../outside.md)\n"
        "```\n[in code](ignored.md)\n```\n"
    )
    assert broken_links(page, tmp_path, frozenset({"docs/later.md"})) == [
        "#nowhere: no such heading",
        "docs/other.md#elsewhere: no heading #elsewhere in docs/other.md",
        "docs/none.md: no such file",
        "../outside.md: outside the repository",
    ]
