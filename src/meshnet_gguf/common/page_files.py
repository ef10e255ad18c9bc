"""What the node's page and the tracker's page share: the headers their files are served with,
the content types, and the stylesheet both start from (`pages/base.css`)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

BASE_STYLESHEET = Path(__file__).parent / "pages" / "base.css"
BASE_STYLESHEET_PATH = "/base.css"
_HTML = "text/html; charset=utf-8"
_JAVASCRIPT = "text/javascript; charset=utf-8"
_CSS = "text/css; charset=utf-8"
# A page loads only its own files and talks only to the server that sent it.
PAGE_SECURITY_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


def static_files(pages_dir: Path, page: str, *, own_stylesheet: bool = False) -> dict[str, tuple[Path, str]]:
    """A page's files, URL path -> (file, content type): `<page>.html` at `/`, its script `<page>.js`,
    the base stylesheet, and `<page>.css` where the page adds rules of its own."""
    files = {
        "/": (pages_dir / f"{page}.html", _HTML),
        f"/{page}.js": (pages_dir / f"{page}.js", _JAVASCRIPT),
        BASE_STYLESHEET_PATH: (BASE_STYLESHEET, _CSS),
    }
    if own_stylesheet:
        files[f"/{page}.css"] = (pages_dir / f"{page}.css", _CSS)
    return files


@cache
def read_page_file(path: Path) -> bytes:
    """A page file's bytes, read once: they ship with the package and do not change while it runs."""
    return path.read_bytes()
