"""The chat page served at ``/``: static files shipped in ``static/`` (no external resources).

``chat.html`` (markup and inline CSS) loads two scripts served next to it: ``markdown.js``, the
renderer for model text (DOM nodes and ``textContent`` only, linear time), and ``chat.js``, the
page's logic. The page talks to the server's own OpenAI endpoints (``/v1/models``, streamed
``/v1/chat/completions``), so it needs nothing the API does not already offer. It is served with
a Content-Security-Policy that allows scripts only from this origin (no inline script at all),
its own inline style (by hash) and connections to this origin: even if model output slipped into
the DOM as markup, the browser would run no script from it and load nothing from elsewhere.
"""

from __future__ import annotations

import base64
import hashlib
import re
from functools import lru_cache
from pathlib import Path

STATIC = Path(__file__).with_name("static")
PAGE = STATIC / "chat.html"
SCRIPTS = ("markdown.js", "chat.js")  # served at /<name>, loaded by the page in this order

_COMMON = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


def _hashes(html: str, tag: str) -> str:
    bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.S)
    return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in bodies)


@lru_cache(maxsize=1)
def page() -> tuple[bytes, dict[str, str]]:
    """The page's bytes and the headers to send with it."""
    html = PAGE.read_text(encoding="utf-8")
    csp = (f"default-src 'none'; script-src 'self'; style-src {_hashes(html, 'style')}; "
           "connect-src 'self'; img-src data:; form-action 'none'; base-uri 'none'; frame-ancestors 'none'")
    return html.encode("utf-8"), {"Content-Security-Policy": csp, **_COMMON}


@lru_cache(maxsize=len(SCRIPTS))
def script(name: str) -> tuple[bytes, dict[str, str]]:
    """One of the page's scripts (a name in ``SCRIPTS``) and the headers to send with it."""
    if name not in SCRIPTS:
        raise KeyError(name)
    return (STATIC / name).read_bytes(), dict(_COMMON)
