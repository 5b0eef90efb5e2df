"""Real servers on loopback for the remote-storage tests and benchmarks (nothing leaves 127.0.0.1).

- ``S3Server``: the ``moto`` S3 server in a child process, with explicit credentials; with
  ``auth=True`` it checks SigV4 signatures against an IAM user it creates, so wrong
  credentials fail as they do on AWS.
- ``NginxServer``: nginx (Debian's package) serving a directory over HTTP and HTTPS (a local CA
  and certificate from ``trustme``); it honours Range, sends ETag and Last-Modified.
- ``FaultProxy``: an HTTP/1.1 proxy owned by the tests (asyncio, in a thread) in front of
  either server: added latency, a bandwidth limit shared by all connections (a link), and
  per-request faults (status codes, connection resets, truncated bodies, stalls) taken in
  order from a queue the test fills.

Import-light: moto, boto3 and trustme are imported by the functions that need them.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

HOST = "127.0.0.1"
REGION = "us-east-1"
# Explicit credentials for the tests: never the user's, never the instance metadata service.
ACCESS_KEY = "AKIASLUICETESTKEY000"
SECRET_KEY = "sluice-test-secret-key-not-a-real-one-0000"
CLIENT_ENV = {
    "AWS_ACCESS_KEY_ID": ACCESS_KEY,
    "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
    "AWS_DEFAULT_REGION": REGION,
    "AWS_REGION": REGION,
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen | None = None, timeout: float = 30.0, what: str = "server") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} before listening on port {port}")
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {HOST}:{port} within {timeout:.0f} s")


def _die_with_parent() -> None:
    """In the child before exec: end with SIGTERM when the test process dies (Linux), so a killed
    test run leaves no server behind."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------------------- S3


class S3Server:
    """``moto`` S3 on loopback in a child process. ``auth=True``: signatures are checked."""

    def __init__(self, auth: bool = False, log_path: Path | None = None):
        self.auth = auth
        self.port = free_port()
        self.endpoint = f"http://{HOST}:{self.port}"
        env = {**os.environ, **CLIENT_ENV}
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from moto.server import main; main()", "-H", HOST, "-p", str(self.port)],
            env=env, stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        try:
            wait_for_port(self.port, self.proc, what="moto S3 server")
            self.access_key, self.secret_key = ACCESS_KEY, SECRET_KEY
            if auth:
                self._enable_auth()
        except BaseException:
            self.close()
            raise

    def boto3(self, service: str = "s3", access_key: str | None = None, secret_key: str | None = None):
        import boto3
        from botocore.config import Config

        return boto3.client(service, endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=access_key or self.access_key,
                            aws_secret_access_key=secret_key or self.secret_key,
                            config=Config(retries={"max_attempts": 1}, s3={"addressing_style": "path"}))

    def _enable_auth(self) -> None:
        """Create an IAM user with S3 rights, then switch moto's authentication on (it checks
        signatures against that user's key from then on)."""
        import json
        import urllib.request

        iam = self.boto3("iam")
        iam.create_user(UserName="sluice-test")
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        iam.put_user_policy(UserName="sluice-test", PolicyName="s3", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="sluice-test")["AccessKey"]
        self.access_key, self.secret_key = key["AccessKeyId"], key["SecretAccessKey"]
        req = urllib.request.Request(f"{self.endpoint}/moto-api/reset-auth", data=b"0", method="POST",
                                     headers={"Content-Type": "text/plain"})
        urllib.request.urlopen(req, timeout=10).read()

    def put_dir(self, bucket: str, directory: Path, prefix: str = "") -> None:
        """Upload every file under ``directory`` to ``bucket/prefix/...`` (the bucket is made)."""
        s3 = self.boto3()
        try:
            s3.create_bucket(Bucket=bucket)
        except s3.exceptions.BucketAlreadyOwnedByYou:
            pass
        for path in sorted(Path(directory).rglob("*")):
            if path.is_file():
                key = "/".join(p for p in (prefix.strip("/"), path.relative_to(directory).as_posix()) if p)
                s3.upload_file(str(path), bucket, key)

    def put_bytes(self, bucket: str, key: str, data: bytes) -> None:
        s3 = self.boto3()
        try:
            s3.create_bucket(Bucket=bucket)
        except s3.exceptions.BucketAlreadyOwnedByYou:
            pass
        s3.put_object(Bucket=bucket, Key=key, Body=data)

    def close(self) -> None:
        _stop(self.proc)
        if self._log is not subprocess.DEVNULL:
            self._log.close()


# -------------------------------------------------------------------------------------- HTTP

_NGINX_CONF = """\
{user}
worker_processes {workers};
pid {root}/nginx.pid;
error_log {root}/error.log warn;
events {{ worker_connections 256; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 100000;
    default_type application/octet-stream;
    client_body_temp_path {root}/tmp/body;
    proxy_temp_path {root}/tmp/proxy;
    fastcgi_temp_path {root}/tmp/fastcgi;
    uwsgi_temp_path {root}/tmp/uwsgi;
    scgi_temp_path {root}/tmp/scgi;
    server {{
        listen {host}:{port};
        listen {host}:{tls_port} ssl;
        ssl_certificate {root}/cert.pem;
        ssl_certificate_key {root}/key.pem;
        root {docroot};
        location / {{ autoindex off; }}
    }}
}}
"""


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)


class NginxServer:
    """nginx serving ``docroot`` on ``http://127.0.0.1:port`` and ``https://localhost:tls_port``
    (a certificate for ``localhost`` and ``127.0.0.1`` signed by a fresh local CA, whose PEM is
    at ``ca_path``)."""

    def __init__(self, docroot: Path, workdir: Path, workers: int = 1):
        import trustme

        binary = nginx_binary()
        if binary is None:
            raise RuntimeError("nginx is not installed (Debian: apt-get install nginx)")
        self.docroot = Path(docroot).resolve()
        self.root = Path(workdir).resolve()
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)
        ca = trustme.CA()
        cert = ca.issue_cert("localhost", HOST)
        cert.private_key_pem.write_to_path(str(self.root / "key.pem"))
        cert.cert_chain_pems[0].write_to_path(str(self.root / "cert.pem"))
        self.ca_path = self.root / "ca.pem"
        ca.cert_pem.write_to_path(str(self.ca_path))
        self.port, self.tls_port = free_port(), free_port()
        # As root, nginx's workers would drop to `nobody`, who cannot read a private temp dir.
        user = "user root;" if os.geteuid() == 0 else ""
        conf = self.root / "nginx.conf"
        conf.write_text(_NGINX_CONF.format(user=user, workers=workers, root=self.root, host=HOST, port=self.port,
                                           tls_port=self.tls_port, docroot=self.docroot))
        self.proc = subprocess.Popen([binary, "-p", str(self.root), "-c", str(conf), "-g", "daemon off;"],
                                     stdout=subprocess.DEVNULL, stderr=open(self.root / "stderr.log", "wb"),
                                     preexec_fn=_die_with_parent)
        try:
            wait_for_port(self.port, self.proc, what="nginx")
            wait_for_port(self.tls_port, self.proc, what="nginx (TLS)")
        except BaseException:
            self.close()
            raise
        self.url = f"http://{HOST}:{self.port}"
        self.tls_url = f"https://localhost:{self.tls_port}"

    def ssl_context(self):
        """A server-side TLS context with nginx's certificate, for a ``FaultProxy`` that speaks HTTPS."""
        import ssl

        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(str(self.root / "cert.pem"), str(self.root / "key.pem"))
        return ctx

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful: the master waits for its workers
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ------------------------------------------------------------------------------------- proxy


@dataclass
class Fault:
    """One injected fault, applied to the next request whose method is in ``methods``.

    kind: ``"status"`` (answer ``status`` without asking the server), ``"reset"`` (TCP RST
    after ``after`` body bytes; ``after=None``: before any response), ``"truncate"`` (close
    cleanly after ``after`` body bytes, short of Content-Length), ``"stall"`` (stop for
    ``seconds`` after ``after`` body bytes, then go on).
    """

    kind: str
    status: int = 503
    after: int | None = None
    seconds: float = 0.0
    methods: tuple = ("GET",)


@dataclass
class ProxyRecord:
    method: str
    target: str
    range: str | None
    fault: str | None
    status: int | None = None
    body_bytes: int = 0


@dataclass
class _Link:
    rate: float | None = None  # bytes/s of response bodies, shared by all connections
    latency: float = 0.0  # seconds before each response's first byte
    next_free: float = 0.0


class FaultProxy:
    """HTTP/1.1 proxy on loopback in front of ``upstream`` (host, port); keep-alive on both
    sides. ``latency``/``rate`` apply to every request; ``inject(Fault(...))`` queues faults
    for the next matching requests; ``records`` lists what passed through."""

    CHUNK = 64 << 10
    LINK_SLACK = 0.002  # seconds of sending ahead of the link's schedule before the proxy sleeps

    def __init__(self, upstream_port: int, upstream_host: str = HOST, latency: float = 0.0,
                 rate: float | None = None, ssl_context=None):
        self.upstream = (upstream_host, upstream_port)
        self.link = _Link(rate=rate, latency=latency)
        self.faults: deque[Fault] = deque()
        self.records: list[ProxyRecord] = []
        self._ssl = ssl_context
        self._lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fault proxy did not start")
        scheme = "https" if ssl_context else "http"
        self.url = f"{scheme}://{'localhost' if ssl_context else HOST}:{self.port}"

    # -- configuration (any thread)
    def set(self, latency: float | None = None, rate: float | None = -1) -> None:
        if latency is not None:
            self.link.latency = latency
        if rate != -1:
            self.link.rate = rate

    def inject(self, *faults: Fault) -> None:
        with self._lock:
            self.faults.extend(faults)

    def reset(self) -> None:
        """No faults, no latency, no limit, no records (between tests)."""
        with self._lock:
            self.faults.clear()
            self.records.clear()
        self.link.latency, self.link.rate = 0.0, None

    def _take(self, method: str) -> Fault | None:
        with self._lock:
            if self.faults and method in self.faults[0].methods:
                return self.faults.popleft()
        return None

    # -- the loop
    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def start():
            self._server = await asyncio.start_server(self._client, HOST, 0, ssl=self._ssl)
            self.port = self._server.sockets[0].getsockname()[1]
            self._ready.set()

        self.loop.run_until_complete(start())
        self.loop.run_forever()

    def close(self) -> None:
        async def stop():
            self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        if self.loop.is_running():
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    async def _client(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        ureader = uwriter = None
        try:
            while True:
                try:
                    head = await creader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                method, target, headers = _parse_request_head(head)
                body = await creader.readexactly(int(headers.get("content-length", 0) or 0))
                if headers.get("transfer-encoding", "").lower() == "chunked":
                    body = await _read_chunked(creader)
                    head = _dechunk_head(head, len(body))
                fault = self._take(method)
                record = ProxyRecord(method, target, headers.get("range"), fault.kind if fault else None)
                self.records.append(record)
                if self.link.latency:
                    await asyncio.sleep(self.link.latency)
                if fault and fault.kind == "status":
                    msg = f"injected {fault.status}\n".encode()
                    record.status = fault.status
                    cwriter.write(f"HTTP/1.1 {fault.status} Injected\r\nContent-Type: text/plain\r\n"
                                  f"Content-Length: {len(msg)}\r\n\r\n".encode() + msg)
                    await cwriter.drain()
                    continue
                if fault and fault.kind == "reset" and fault.after is None:
                    _abort(cwriter)
                    return
                for _attempt in (0, 1):  # a reused upstream connection may have been closed by the server
                    fresh = uwriter is None
                    if fresh:
                        ureader, uwriter = await asyncio.open_connection(*self.upstream)
                    try:
                        uwriter.write(head + body)
                        await uwriter.drain()
                        rhead = await ureader.readuntil(b"\r\n\r\n")
                        break
                    except (ConnectionError, asyncio.IncompleteReadError):
                        uwriter.close()
                        ureader = uwriter = None
                        if fresh:
                            raise
                status, rheaders = _parse_response_head(rhead)
                record.status = status
                cwriter.write(rhead)
                keep = await self._relay_body(method, status, rheaders, ureader, cwriter, fault, record)
                upstream_closes = (rheaders.get("connection", "").lower() == "close"
                                   or (rhead.startswith(b"HTTP/1.0")
                                       and "keep-alive" not in rheaders.get("connection", "").lower()))
                if upstream_closes:  # the client saw the same header and closes too
                    uwriter.close()
                    ureader = uwriter = None
                    return
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            return
        finally:
            for w in (cwriter, uwriter):
                if w is not None and not w.is_closing():
                    w.close()

    async def _relay_body(self, method, status, rheaders, ureader, cwriter, fault, record) -> bool:
        """Forward one response body; False when the client connection was ended on purpose."""
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            await cwriter.drain()
            return True
        chunked = rheaders.get("transfer-encoding", "").lower() == "chunked"
        length = int(rheaders["content-length"]) if "content-length" in rheaders else None
        sent = 0
        while True:
            if chunked:
                piece = await _next_chunk_raw(ureader)
            elif length is None:
                piece = await ureader.read(self.CHUNK)
            else:
                piece = await ureader.readexactly(min(self.CHUNK, length - sent)) if sent < length else b""
            if not piece:
                break
            if fault and fault.after is not None and sent + len(piece) >= fault.after:
                cut = fault.after - sent
                await self._send(cwriter, piece[:cut])
                record.body_bytes = sent + cut
                if fault.kind == "truncate":
                    cwriter.close()
                    return False
                if fault.kind == "reset":
                    _abort(cwriter)
                    return False
                if fault.kind == "stall":
                    await asyncio.sleep(fault.seconds)
                    piece, sent, fault = piece[cut:], sent + cut, None
            await self._send(cwriter, piece)
            sent += len(piece)
            record.body_bytes = sent
            if chunked and piece == b"0\r\n\r\n":
                break
        await cwriter.drain()
        return True

    async def _send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        rate = self.link.rate
        if rate:
            now = time.monotonic()
            self.link.next_free = max(self.link.next_free, now) + len(data) / rate
            delay = self.link.next_free - now
            # sleep only once the link is LINK_SLACK behind: an event-loop sleep lasts a millisecond or
            # more, so a sleep per 64 KiB chunk would cap a connection near 50 MB/s whatever the rate;
            # next_free keeps the debt, so the rate holds over any span longer than the slack
            if delay > self.LINK_SLACK:
                await asyncio.sleep(delay)
        writer.write(data)
        await writer.drain()


class ProxyProcess:
    """A ``FaultProxy`` with fixed ``latency``/``rate`` in a child process (for benchmarks: the
    relay then does not share the measuring process's GIL). ``url``/``port`` as ``FaultProxy``."""

    def __init__(self, upstream_port: int, latency: float = 0.0, rate: float | None = None):
        code = ("import sys, threading; sys.path.insert(0, sys.argv[1]); from remote_servers import FaultProxy; "
                "p = FaultProxy(int(sys.argv[2]), latency=float(sys.argv[3]), "
                "rate=float(sys.argv[4]) if sys.argv[4] != 'None' else None); "
                "print(p.port, flush=True); sys.stdin.read(); p.close()")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, str(Path(__file__).resolve().parent), str(upstream_port), str(latency),
             str(rate)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, preexec_fn=_die_with_parent)
        line = self.proc.stdout.readline()
        if not line.strip():
            _stop(self.proc)
            raise RuntimeError(f"proxy process exited with status {self.proc.poll()} before listening")
        self.port = int(line)
        self.url = f"http://{HOST}:{self.port}"

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()  # the child reads stdin to its end, then stops
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _stop(self.proc)


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a dropped connection looks to the client."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        import struct

        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _parse_request_head(head: bytes):
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    return method, target, _headers(lines[1:])


def _parse_response_head(head: bytes):
    lines = head.decode("latin-1").split("\r\n")
    return int(lines[0].split(" ", 2)[1]), _headers(lines[1:])


def _headers(lines) -> dict:
    out = {}
    for line in lines:
        if ":" in line:
            k, v = line.split(":", 1)
            out[k.strip().lower()] = v.strip()
    return out


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    out = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":
                pass
            return bytes(out)
        out += await reader.readexactly(size)
        await reader.readexactly(2)


def _dechunk_head(head: bytes, length: int) -> bytes:
    lines = [ln for ln in head.split(b"\r\n")[:-2] if not ln.lower().startswith(b"transfer-encoding:")]
    return b"\r\n".join(lines + [b"Content-Length: %d" % length, b"", b""])


async def _next_chunk_raw(reader: asyncio.StreamReader) -> bytes:
    """One chunk of a chunked body, framing included (the last one is ``0\\r\\n\\r\\n``)."""
    line = await reader.readuntil(b"\r\n")
    size = int(line.split(b";")[0], 16)
    if size == 0:
        while (await reader.readuntil(b"\r\n")) != b"\r\n":
            pass
        return b"0\r\n\r\n"
    return line + await reader.readexactly(size + 2)


@dataclass
class RemoteServers:
    """What the session fixture hands to tests (see conftest.py)."""

    s3: S3Server
    http: NginxServer
    docroot: Path

    bucket: str = "models"

    def publish(self, name: str, source: Path) -> dict:
        """Serve ``source`` (a file or a directory) as ``name`` from both servers; returns the
        URLs: ``http``, ``https`` (verify against ``self.http.ca_path``) and ``s3``."""
        source = Path(source)
        dest = self.docroot / name
        if source.is_dir():
            shutil.copytree(source, dest, dirs_exist_ok=True)
            self.s3.put_dir(self.bucket, source, prefix=name)
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, dest)
            self.s3.put_bytes(self.bucket, name, source.read_bytes())
        return {"http": f"{self.http.url}/{name}", "https": f"{self.http.tls_url}/{name}",
                "s3": f"s3://{self.bucket}/{name}"}
