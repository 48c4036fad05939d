"""The README stays a guide (a size bound) and every relative link in the docs leads somewhere."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_BYTES = 20_000

# [text](target) and [text](target "title"); images too. Code spans are removed first, so `a[i](x)` is no link.
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)

def markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def relative_links(path: Path) -> list[str]:
    text = CODE.sub("", path.read_text(encoding="utf-8"))
    links = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
            continue  # http(s):, mailto: ...; an anchor in the same page
        links.append(target)
    return links


def test_readme_size():
    size = README.stat().st_size
    assert size <= README_MAX_BYTES, (
        f"README.md is {size:,} bytes, over {README_MAX_BYTES:,}: move detail to a page under docs/ and link it"
    )


def test_relative_links_exist():
    broken = []
    for path in markdown_files():
        for target in relative_links(path):
            file_part = unquote(target.split("#", 1)[0].split("?", 1)[0])
            linked = (path.parent / file_part).resolve()
            if not linked.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def test_link_pattern():
    text = "[a](docs/x.md) [b](https://e.org) [c](#anchor) [d](y.md#part) `[e](skip.md)` [f](<z.md>)"
    found = [t for t in LINK.findall(CODE.sub("", text))]
    assert found == ["docs/x.md", "https://e.org", "#anchor", "y.md#part", "z.md"]
