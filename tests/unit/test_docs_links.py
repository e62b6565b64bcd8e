"""Every relative link in README.md, CHANGELOG.md and docs/*.md resolves: the file (or
directory) exists and, for a ``#anchor`` into a Markdown file, a heading there has that
anchor as GitHub spells it; and every docs/*.md page is reachable from README.md by
links, so nothing moved off the front page is lost."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def _prose(path: Path) -> str:
    """The page without fenced code blocks (a ``[x](y)`` there is not a link)."""
    return FENCE.sub("", path.read_text(encoding="utf-8"))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link markup reduced to its text, lowercased,
    everything but letters, digits, spaces, hyphens and underscores dropped, spaces
    turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown page; repeats get -1, -2, ... as on GitHub."""
    seen: Counter[str] = Counter()
    out = set()
    for line in _prose(path).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        out.add(base if not seen[base] else f"{base}-{seen[base]}")
        seen[base] += 1
    return out


def links(path: Path) -> list[str]:
    return [a or b for a, b in LINK.findall(_prose(path))]


def _local(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I)  # http:, mailto:, ...


def test_slug_follows_github() -> None:
    assert slug("`fsdpkit doctor`: is this machine, model and cluster ready?") == (
        "fsdpkit-doctor-is-this-machine-model-and-cluster-ready"
    )
    assert slug("Two commands on a fresh machine") == "two-commands-on-a-fresh-machine"
    assert slug("Processes ([docs/runtime.md](runtime.md))") == "processes-docsruntimemd"


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in PAGES:
        for target in filter(_local, links(page)):
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == [], "\n".join(broken)


def test_every_doc_page_is_reachable_from_the_readme() -> None:
    reached, todo = set(), [ROOT / "README.md"]
    while todo:
        page = todo.pop()
        if page in reached or page.suffix != ".md" or not page.is_file():
            continue
        reached.add(page)
        for target in filter(_local, links(page)):
            file = target.partition("#")[0]
            if file:
                todo.append((page.parent / file).resolve())
    missing = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in reached)
    assert missing == [], f"docs pages no link from README.md leads to: {missing}"
