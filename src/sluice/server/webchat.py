"""The chat page served at ``/``: one static HTML file (inline CSS and JS, no external resources).

The page talks to the server's own OpenAI endpoints (``/v1/models``, streamed
``/v1/chat/completions``), so it needs nothing the API does not already offer. It is served
with a Content-Security-Policy that allows exactly its own inline script and style (by
hash) and connections to this origin: even if model output slipped into the DOM as markup,
the browser would run no script from it and load nothing from elsewhere.
"""

from __future__ import annotations

import base64
import hashlib
import re
from functools import lru_cache
from pathlib import Path

PAGE = Path(__file__).with_name("static") / "chat.html"


def _hashes(html: str, tag: str) -> str:
    bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.S)
    return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in bodies)


@lru_cache(maxsize=1)
def page() -> tuple[bytes, dict[str, str]]:
    """The page's bytes and the headers to send with it."""
    html = PAGE.read_text(encoding="utf-8")
    csp = (f"default-src 'none'; script-src {_hashes(html, 'script')}; style-src {_hashes(html, 'style')}; "
           "connect-src 'self'; img-src data:; form-action 'none'; base-uri 'none'; frame-ancestors 'none'")
    headers = {
        "Content-Security-Policy": csp,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-cache",
    }
    return html.encode("utf-8"), headers
