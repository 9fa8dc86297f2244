"""The docs site's front page is the repository's README.md: an MkDocs hook (``hooks:`` in mkdocs.yml) that gives
``docs/index.md`` the README's markdown at build time, its links into ``docs/`` made relative to the site, so the
two cannot drift. Edit README.md; docs/index.md only says where its text comes from.

A README link to a file outside ``docs/`` would be a broken link on the site, which ``mkdocs build --strict``
(tests/test_docs.py) refuses.
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
FRONT_PAGE = "index.md"
"""The page of the docs folder that the README replaces."""

_DOCS_LINK = re.compile(r"\]\(docs/([^)]*)\)")


def site_front_page(readme: str) -> str:
    """The README's markdown as the site's front page: ``](docs/training.md#x)`` -> ``](training.md#x)``, images
    alike (``docs/img/...`` -> ``img/...``)."""
    return _DOCS_LINK.sub(lambda link: f"]({link.group(1) or FRONT_PAGE})", readme)


def on_page_markdown(markdown: str, page, config, files) -> str:
    """MkDocs' hook: the front page's markdown is the README's; every other page is left as it is."""
    if page.file.src_uri == FRONT_PAGE:
        return site_front_page(README.read_text(encoding="utf-8"))
    return markdown
