"""Every relative link in README.md, BENCHMARKS.md and docs/**/*.md points at a file that exists, and
every ``#anchor`` at a heading of its target (GitHub's slugs: lower case, punctuation dropped, spaces
to hyphens, ``-1``, ``-2`` ... for repeats) or an explicit ``<a id=...>``/``name=`` anchor."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").rglob("*.md")])

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+[^>]*(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.I)


def _outside_fences(text: str) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, fence = [], None
    for line in text.splitlines():
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * 3
            continue
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
            continue
        lines.append(line)
    return lines


def _prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks, inline code removed."""
    return [INLINE_CODE.sub("", line) for line in _outside_fences(text)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text)                          # inline HTML
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)                         # \w is Unicode: letters, digits, _
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor a link may name on ``page``."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in _outside_fences(page.read_text()):
        found.update(HTML_ANCHOR.findall(line))
        h = HEADING.match(line)
        if h:
            base = slug(h.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(page: Path) -> list[str]:
    out = []
    for line in _prose_lines(page.read_text()):
        out += LINK.findall(line)
        m = REFERENCE.match(line)
        if m:
            out.append(m.group(1))
    return out


def _relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I)   # http:, https:, mailto: ...


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with ``page``'s relative links, one line each (paths shown from ``root``)."""
    problems = []
    for target in links(page):
        if not _relative(target):
            continue
        path_part, _, anchor = target.partition("#")
        dest = page if not path_part else (page.parent / unquote(path_part)).resolve()
        if not dest.exists():
            problems.append(f"{target}: no file {dest.relative_to(root) if dest.is_relative_to(root) else dest}")
            continue
        if anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
            problems.append(f"{target}: no heading with that anchor in {dest.relative_to(root) if dest.is_relative_to(root) else dest}")
    return problems


def test_the_pages_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "BENCHMARKS.md", "docs/architecture.md"} <= names


def test_slugs_follow_github() -> None:
    assert slug("Issue 14 (2026-11-26, night): INT32 ids, half the bytes") == "issue-14-2026-11-26-night-int32-ids-half-the-bytes"
    assert slug("perf_analyzer (Triton's C++ load generator)") == "perf_analyzer-tritons-c-load-generator"
    assert slug("Finding the highest QPS under a latency target (`--find-max-qps`)") == \
        "finding-the-highest-qps-under-a-latency-target---find-max-qps"
    assert slug("Latency-bounded throughput (p99 <= 60 ms, MLPerf DLRM query sizes)") == \
        "latency-bounded-throughput-p99--60-ms-mlperf-dlrm-query-sizes"


def test_the_checker_finds_a_broken_link(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Top\n\n## Two words\n\n[ok](#two-words) [ok](b.md#b) [bad](#nope) "
                                   "[bad](c.md) `[code](nope.md)`\n\n```\n[fenced](nope.md)\n```\n")
    (tmp_path / "b.md").write_text("# B\n")
    assert broken_links(tmp_path / "a.md", root=tmp_path) == ["#nope: no heading with that anchor in a.md",
                                                              "c.md: no file c.md"]


def test_repeated_headings_and_html_anchors(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# Notes\n\n## Run\n\n## Run\n\n<a id=\"kept\"></a>\n\n```\n## not a heading\n```\n")
    assert anchors(page) == {"notes", "run", "run-1", "kept"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []
