"""Every relative link of the README and docs/ resolves: the file exists and, where the link
names an anchor in a Markdown page, a heading or an `<a id>` of that page makes it."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("bench/**/*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`[^`\n]*`")


def anchors(page: Path) -> set[str]:
    """The anchors GitHub makes for `page`: each heading lower-cased, without punctuation but
    hyphens and underscores, spaces as hyphens (repeats numbered), and explicit `<a id>` tags."""
    found: set[str] = set()
    in_fence = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        if in_fence:
            continue
        found.update(re.findall(r'<a (?:id|name)="([^"]+)"', line))
        if line.startswith("#"):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            name, n = slug, 1
            while name in found:
                name, n = f"{slug}-{n}", n + 1
            found.add(name)
    return found


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return LINK.findall(CODE_SPAN.sub("", text))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_of_the_page_resolves(page: Path):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: checked by nobody offline
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading or <a id> makes #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)
