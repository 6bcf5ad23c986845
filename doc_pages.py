"""What the docs pages say, for the tests that hold a page to the numbers it restates from the code (`says`)."""
from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent / "docs"


def page(name: str) -> str:
    """The text of docs/<name> ("05-retool.md"), with runs of whitespace made single spaces."""
    return re.sub(r"\s+", " ", (DOCS / name).read_text(encoding="utf-8"))


def says(name: str, *fragments: str) -> None:
    """Assert that docs/<name> holds every fragment (compared with whitespace made single)."""
    text = page(name)
    for fragment in fragments:
        fragment = re.sub(r"\s+", " ", fragment)
        assert fragment in text, f"docs/{name} no longer says {fragment!r}: update the page or the code"
