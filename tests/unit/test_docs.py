"""The docs stay true to the code and to each other: docs/settings.md is the generator's output, and every
relative link and #anchor in README.md and docs/*.md points at a file and a heading that exist."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest
from serving import REPO

DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+).+?\1", re.S)
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto: are not checked


def settings_doc() -> ModuleType:
    spec = importlib.util.spec_from_file_location("settings_doc", REPO / "scripts" / "settings_doc.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def outside_fences(text: str) -> str:
    """The lines outside fenced code blocks (a `# comment` in a bash block is no heading, its links no links)."""
    kept, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            kept.append(line)
    return "\n".join(kept)


def links(text: str) -> list[str]:
    """Targets of the inline links and images of a Markdown text, leaving out code blocks and code spans."""
    return LINK.findall(INLINE_CODE.sub("", outside_fences(text)))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, punctuation other than - and _ dropped, spaces to -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor, repeated headings numbered -1, -2, ... as GitHub does."""
    found: set[str] = set()
    repeats: dict[str, int] = {}
    for line in outside_fences(text).splitlines():
        if heading := HEADING.match(line):
            base = slug(heading.group(1))
            count = repeats.get(base, 0)
            repeats[base] = count + 1
            found.add(f"{base}-{count}" if count else base)
    return found


def broken_links(page: Path) -> list[str]:
    """The page's relative links whose file, or #anchor in a Markdown file, does not exist."""
    broken = []
    for target in links(page.read_text()):
        if SCHEME.match(target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"({target}) in {page.name}: no such file {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
            broken.append(f"({target}) in {page.name}: no heading in {resolved.name} has the anchor #{anchor}")
    return broken


def test_settings_page_is_the_generators_output() -> None:
    committed = (DOCS / "settings.md").read_text()
    assert committed == settings_doc().render(), (
        "docs/settings.md is out of date with imgserve.config.Settings: run `make docs`"
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    assert broken_links(page) == []


def ragged_table_rows(text: str) -> list[str]:
    """Rows of a Markdown table whose cell count differs from their header's (what a bad merge leaves)."""
    ragged, width = [], None
    for line in outside_fences(text).splitlines():
        if not line.startswith("|"):
            width = None
            continue
        cells = len(re.split(r"(?<!\\)\|", INLINE_CODE.sub("code", line).strip().strip("|")))
        if width is None:
            width = cells
        elif cells != width:
            ragged.append(line)
    return ragged


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_table_row_has_its_headers_cells(page: Path) -> None:
    assert ragged_table_rows(page.read_text()) == []


def test_the_table_check_finds_a_ragged_row() -> None:
    table = "| a | b |\n|---|---|\n| `x | y` | 2 |\n| 1 | 2 | 3 |\n| 4 |\n\n| c |\n|---|\n| 5 |\n"
    assert ragged_table_rows(table) == ["| 1 | 2 | 3 |", "| 4 |"]


def test_the_front_page_links_every_docs_page() -> None:
    linked = {(REPO / target.partition("#")[0]).resolve() for target in links(PAGES[0].read_text())}
    assert [page.name for page in PAGES[1:] if page.resolve() not in linked] == []


def test_the_link_check_finds_broken_links(tmp_path: Path) -> None:
    (tmp_path / "target.md").write_text("# A title\n\n## Same\n\n## Same\n\n```bash\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](target.md#a-title) [second](target.md#same-1) [web](https://example.com/x) `[code](nowhere.md)`\n"
        "[gone](missing.md) [bad anchor](target.md#not-a-heading) [fenced](target.md#not-a-heading-1) [here](#x)\n"
    )
    broken = [message.partition(")")[0].removeprefix("(") for message in broken_links(page)]
    assert broken == ["missing.md", "target.md#not-a-heading", "target.md#not-a-heading-1", "#x"]


def test_github_slugs() -> None:
    assert slug("Overhead benchmark: imgserve's own cost") == "overhead-benchmark-imgserves-own-cost"
    assert slug("Graceful shutdown (Kubernetes)") == "graceful-shutdown-kubernetes"
    assert slug("The `max_batch_size` [setting](x.md)") == "the-max_batch_size-setting"
    assert anchors("# Same\n## Same\n### Same\n") == {"same", "same-1", "same-2"}
