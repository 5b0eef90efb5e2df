"""Which client reads remote experts fastest: obstore vs fsspec (s3fs / HTTPFileSystem).

    python benchmarks/remote_clients.py --object-mb 1024 --repeats 3 --json benchmarks/results/remote-clients.json

Starts, on loopback, nginx (HTTP Range, sendfile) and the ``moto`` S3 server (child process),
writes one object of random bytes (``--object-mb``) to both, and measures MB/s of range reads
of 4, 8, 16 and 22 MB (the size of one expert record of a frontier MoE) with 4, 8 and 16 reads
in flight, each read landing in a preallocated buffer (as reads land in cache slots):

- ``ceiling``: the server's own ceiling, plain ``http.client`` connections in threads reading
  straight into the buffers (``readinto``); unsigned requests (moto runs without auth here);
- ``obstore``: ``obstore.get_range_async`` on one event loop (S3Store / HTTPStore), the
  returned ``Bytes`` (Rust-owned, buffer protocol) copied once into the buffer;
- ``fsspec``: ``s3fs.S3FileSystem`` / ``fsspec`` ``HTTPFileSystem`` ``_cat_file(start, end)``
  (aiohttp) on the same loop, the returned ``bytes`` copied into the buffer.

The machine may be shared: within each repeat, every cell runs the three readers back to back
in a rotating order (same offsets), and the report gives medians over repeats and each
client's ratio to the ceiling measured beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from remote_servers import ACCESS_KEY, CLIENT_ENV, REGION, SECRET_KEY, NginxServer, S3Server  # noqa: E402

MB = 1 << 20
KEY = "blob.bin"
BUCKET = "bench"


class Slots:
    """``inflight`` preallocated buffers of ``size`` bytes, handed out round-robin."""

    def __init__(self, inflight: int, size: int):
        self.bufs = [bytearray(size) for _ in range(inflight)]

    def __getitem__(self, i: int) -> memoryview:
        return memoryview(self.bufs[i % len(self.bufs)])


# ------------------------------------------------------------------------------- readers


def ceiling(host: str, port: int, path: str, offsets, size: int, inflight: int, slots: Slots) -> None:
    """Plain HTTP/1.1 keep-alive connections, one per thread, ``readinto`` the slot."""
    it = iter(enumerate(offsets))
    lock = threading.Lock()

    def worker():
        conn = http.client.HTTPConnection(host, port)
        while True:
            with lock:
                nxt = next(it, None)
            if nxt is None:
                break
            i, off = nxt
            conn.request("GET", path, headers={"Range": f"bytes={off}-{off + size - 1}"})
            resp = conn.getresponse()
            if resp.status != 206:
                raise RuntimeError(f"ceiling reader: HTTP {resp.status} {resp.read()[:300]!r}")
            view, got = slots[i], 0
            while got < size:
                n = resp.readinto(view[got:])
                if not n:
                    raise RuntimeError("ceiling reader: short body")
                got += n
            resp.read()
        conn.close()

    with ThreadPoolExecutor(inflight) as ex:
        for f in [ex.submit(worker) for _ in range(inflight)]:
            f.result()


async def bounded(offsets, inflight: int, one) -> None:
    sem = asyncio.Semaphore(inflight)

    async def run(i, off):
        async with sem:
            await one(i, off)

    await asyncio.gather(*(run(i, off) for i, off in enumerate(offsets)))


def obstore_reader(store, path: str):
    import obstore

    async def read(offsets, size, inflight, slots):
        async def one(i, off):
            data = await obstore.get_range_async(store, path, start=off, length=size)
            slots[i][:] = memoryview(data)

        await bounded(offsets, inflight, one)

    return read


def fsspec_reader(fs, path: str):
    async def read(offsets, size, inflight, slots):
        async def one(i, off):
            data = await fs._cat_file(path, start=off, end=off + size)
            slots[i][:] = data

        await bounded(offsets, inflight, one)

    return read


# -------------------------------------------------------------------------------- setup


def make_object(path: Path, nbytes: int) -> None:
    with open(path, "wb") as f:
        for _ in range(nbytes // (64 * MB)):
            f.write(os.urandom(64 * MB))
        f.write(os.urandom(nbytes % (64 * MB)))


def clients(loop, nginx: NginxServer, s3: S3Server):
    import fsspec.implementations.http
    import obstore.store
    import s3fs

    async def make():
        s3fs_fs = s3fs.S3FileSystem(key=ACCESS_KEY, secret=SECRET_KEY, endpoint_url=s3.endpoint,
                                    client_kwargs={"region_name": REGION}, asynchronous=True,
                                    skip_instance_cache=True)
        await s3fs_fs.set_session()
        http_fs = fsspec.implementations.http.HTTPFileSystem(asynchronous=True, skip_instance_cache=True)
        session = await http_fs.set_session()
        return s3fs_fs, http_fs, session

    s3fs_fs, http_fs, session = loop.run_until_complete(make())
    opts = {"allow_http": True}
    s3_store = obstore.store.S3Store(BUCKET, endpoint=s3.endpoint, access_key_id=ACCESS_KEY,
                                     secret_access_key=SECRET_KEY, region=REGION, client_options=opts)
    http_store = obstore.store.HTTPStore(nginx.url, client_options=opts)
    closers = [s3fs_fs._s3.close, session.close]
    return closers, {
        "http": {"obstore": obstore_reader(http_store, KEY), "fsspec": fsspec_reader(http_fs, f"{nginx.url}/{KEY}")},
        "s3": {"obstore": obstore_reader(s3_store, KEY), "fsspec": fsspec_reader(s3fs_fs, f"{BUCKET}/{KEY}")},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--object-mb", type=int, default=1024, help="object size on the HTTP server")
    ap.add_argument("--s3-object-mb", type=int, default=64,
                    help="object size on moto, which copies the whole object for every range request")
    ap.add_argument("--sizes", default="4,8,16,22", help="read sizes in MB")
    ap.add_argument("--inflight", default="4,8,16")
    ap.add_argument("--reads", type=int, default=2, help="reads per measurement, as a multiple of the in-flight count")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--servers", default="http,s3")
    ap.add_argument("--nginx-workers", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.update(CLIENT_ENV)
    sizes = [int(s) for s in args.sizes.split(",")]
    inflights = [int(s) for s in args.inflight.split(",")]
    servers = args.servers.split(",")
    rng = random.Random(0)

    with tempfile.TemporaryDirectory(prefix="sluice-remote-bench-") as tmp:
        tmp = Path(tmp)
        (tmp / "doc").mkdir()
        nbytes = args.object_mb * MB
        s3_bytes = 0
        t0 = time.perf_counter()
        make_object(tmp / "doc" / KEY, nbytes)
        nginx = NginxServer(tmp / "doc", tmp / "nginx", workers=args.nginx_workers)
        s3 = S3Server()
        loop = asyncio.new_event_loop()
        try:
            if "s3" in servers:
                s3.boto3().create_bucket(Bucket=BUCKET)
                s3_bytes = min(args.s3_object_mb * MB, nbytes)
                with open(tmp / "doc" / KEY, "rb") as f:
                    s3.boto3().put_object(Bucket=BUCKET, Key=KEY, Body=f.read(s3_bytes))
            print(f"object {args.object_mb} MB written and uploaded in {time.perf_counter() - t0:.1f} s", flush=True)
            closers, readers = clients(loop, nginx, s3)
            objsize = {"http": nbytes, "s3": s3_bytes if "s3" in servers else 0}
            # moto refuses unsigned GETs: the ceiling reader uses a presigned URL (Range is not signed)
            signed = urllib.parse.urlsplit(s3.boto3().generate_presigned_url(
                "get_object", Params={"Bucket": BUCKET, "Key": KEY}, ExpiresIn=24 * 3600))
            ports = {"http": (nginx.port, f"/{KEY}"), "s3": (s3.port, f"{signed.path}?{signed.query}")}

            def run(server, client, offsets, size, inflight, slots) -> float:
                t = time.perf_counter()
                if client == "ceiling":
                    port, path = ports[server]
                    ceiling("127.0.0.1", port, path, offsets, size, inflight, slots)
                else:
                    loop.run_until_complete(readers[server][client](offsets, size, inflight, slots))
                return time.perf_counter() - t

            names = ["ceiling", "obstore", "fsspec"]
            for server in servers:  # warm connection pools and the page cache
                for c in names:
                    run(server, c, [0, objsize[server] // 2], 4 * MB, 2, Slots(2, 4 * MB))
            times: dict = {}
            for rep in range(args.repeats):
                for server in servers:
                    for size_mb in sizes:
                        for inflight in inflights:
                            size = size_mb * MB
                            n = args.reads * inflight
                            offsets = [rng.randrange(0, (objsize[server] - size) // 4096) * 4096 for _ in range(n)]
                            slots = Slots(inflight, size)
                            k = rep + sizes.index(size_mb) + inflights.index(inflight)
                            for c in names[k % 3:] + names[:k % 3]:
                                secs = run(server, c, offsets, size, inflight, slots)
                                times.setdefault((server, size_mb, inflight, c), []).append(n * size / MB / secs)
                print(f"repeat {rep + 1}/{args.repeats} done", flush=True)
            for close in closers:
                loop.run_until_complete(close())
        finally:
            loop.close()
            nginx.close()
            s3.close()

    rows = []
    print("\n| server | read | in flight | ceiling MB/s | obstore MB/s | fsspec MB/s "
          "| obstore/ceiling | fsspec/ceiling | obstore/fsspec |")
    print("|---|---|---|---|---|---|---|---|---|")
    for server in servers:
        for size_mb in sizes:
            for inflight in inflights:
                med = {c: statistics.median(times[(server, size_mb, inflight, c)]) for c in names}
                # ratios per repeat (side by side), then the median
                ratio = {c: statistics.median(a / b for a, b in zip(times[(server, size_mb, inflight, c)],
                                                                    times[(server, size_mb, inflight, "ceiling")]))
                         for c in ("obstore", "fsspec")}
                of = statistics.median(a / b for a, b in zip(times[(server, size_mb, inflight, "obstore")],
                                                             times[(server, size_mb, inflight, "fsspec")]))
                rows.append(dict(server=server, size_mb=size_mb, inflight=inflight, mbps=med, ratio=ratio,
                                 obstore_over_fsspec=of))
                print(f"| {server} | {size_mb} MB | {inflight} | {med['ceiling']:.0f} | {med['obstore']:.0f} | "
                      f"{med['fsspec']:.0f} | {ratio['obstore']:.2f} | {ratio['fsspec']:.2f} | {of:.2f} |")
    allof = [r["obstore_over_fsspec"] for r in rows]
    print(f"\nobstore/fsspec over all cells: median {statistics.median(allof):.2f}, "
          f"min {min(allof):.2f}, max {max(allof):.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args=vars(args), cpus=os.cpu_count(), rows=rows,
                                                   raw={"|".join(map(str, k)): v for k, v in times.items()}),
                                              indent=1))


if __name__ == "__main__":
    main()
