"""A tiny real HTTP server for the remote-storage tests: serves a directory with Range support, and
sends ETag and Last-Modified only when asked to (``validators``: True for both, ``"last-modified"``
for that one alone; conditional request headers are ignored, as some servers do), so a test can play a server that
gives the client no way to tell one version of a file from the next. ``auth``: ``(user, password)``
it demands as HTTP Basic auth (401 otherwise). ``stall``: a ``threading.Event``; while it is clear,
GETs of data (range requests) wait for it (a server that stops answering)."""

from __future__ import annotations

import base64
import email.utils
import hashlib
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class PlainHTTPServer:
    def __init__(self, docroot: Path, *, validators: bool | str = False, auth: tuple[str, str] | None = None):
        self.docroot, self.validators, self.auth = Path(docroot), validators, auth
        self.requests: list[tuple[str, str, dict]] = []  # (method, path, headers by lower-case name) of every request
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def do_HEAD(self):
                self._serve(body=False)

            def do_GET(self):
                self._serve(body=True)

            def _serve(self, body: bool):
                owner.requests.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
                if owner.auth is not None:
                    want = "Basic " + base64.b64encode(":".join(owner.auth).encode()).decode()
                    if self.headers.get("Authorization") != want:
                        self.send_response(401)
                        self.send_header("WWW-Authenticate", 'Basic realm="test"')
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                path = owner.docroot / self.path.lstrip("/").split("?")[0]
                try:
                    data = path.read_bytes()
                except OSError:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                start, end, status = 0, len(data), 200
                rng = self.headers.get("Range")
                if rng and rng.startswith("bytes="):
                    a, _, b = rng[6:].partition("-")
                    start, end, status = int(a), min(len(data), int(b) + 1 if b else len(data)), 206
                self.send_response(status)
                if owner.validators:
                    st = os.stat(path)
                    if owner.validators is True:
                        self.send_header("ETag", '"' + hashlib.md5(data).hexdigest() + '"')
                    self.send_header("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(end - start))
                self.end_headers()
                if body:
                    self.wfile.write(data[start:end])

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
