"""Disk tier entry files: their format, and reading one back (``disk_tier.py`` keeps the tier).

An entry is one byte range of one version of one object (``Key``), in one file: a
``HEADER_BYTES`` header (a magic line and a JSON object: URL, version, offset, length, the
payload's CRC-32, the model) and the payload, zero-padded to a multiple of 4096 so that it is
read back with O_DIRECT in one read (``read_entry``), header included.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .buffers import ALIGN, AlignedBuffer, align_down, align_up
from .crc import crc32, pread_crc32
from .file import PIECE_BYTES, LocalFile
from .regular import open_regular
from .source import ReadStats

MAGIC = b"SLUICE-DISK-TIER-ENTRY 1\n"
HEADER_BYTES = ALIGN
ENTRY_RE = re.compile(r"^[0-9a-f]{40}\.entry$")
STAGING_BYTES = 4 << 20  # per reading thread: an entry read into a destination that is not page-aligned


@dataclass(frozen=True)
class Key:
    """One byte range of one version of one object."""

    url: str
    version: str
    offset: int
    length: int

    @property
    def name(self) -> str:
        return hashlib.sha1(f"{self.url}\0{self.version}\0{self.offset}\0{self.length}".encode()).hexdigest()


def read_entry(f: LocalFile, key: Key, dest: memoryview, stage: AlignedBuffer, room: memoryview | None = None) -> bool:
    """Fill ``dest`` with the payload of entry file ``f`` (an ``EntryFile``) if the entry is ``key``'s
    and its CRC-32 matches; False otherwise. ``stage``: a staging buffer of ``STAGING_BYTES``.
    ``room``: where given, a view that starts where ``dest`` starts and that the read may fill up
    to the payload's page padding (an aligned read clipped at the end of its object: the caller's
    buffer goes on past ``dest``); the bytes past ``dest`` are then the entry's zero padding.

    An entry file read before (``f.crc`` set: its header was the key's and its CRC matched the
    payload then) and a page-aligned ``dest`` of whole pages (or with ``room`` for its last page):
    one read of the payload alone (and its padding), checked against that CRC (entries are
    immutable; a payload changed on disk fails the check; a payload read with its padding is
    checked against the CRC of the payload followed by as many zero bytes, which matches only
    when both the payload and the padding are intact).
    Otherwise one read for the header, the page-aligned part of the payload (straight into ``dest`` when
    its address is page-aligned) and the start of the rest (through ``stage``); a payload of
    8 MiB or more (aligned) is read in parallel pieces (``LocalFile.read_aligned``) after its
    header."""
    n = key.length
    if f.size != entry_size(n):
        return False
    fd = f.dfd if f.dfd is not None else f.fd
    body = align_down(n, ALIGN) if np.frombuffer(dest, dtype=np.uint8).ctypes.data % ALIGN == 0 else 0
    span = align_up(n, ALIGN)
    if f.crc is not None and body and body != n and room is not None and len(room) >= span:
        # the last page of the payload with its padding, into the caller's buffer: a whole-page read
        want = crc32(bytes(span - n), f.crc)  # the CRC of the payload followed by its zero padding
        if span < 2 * PIECE_BYTES:
            got = pread_crc32(fd, room[:span], HEADER_BYTES)
            if got is not None:
                if f.dfd is None:
                    os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)
                return got == (span, want)
        if f.read_aligned(room[:span], HEADER_BYTES) != span:
            return False
        if f.dfd is None:
            os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return crc32(room[:span]) == want
    if f.crc is not None and body == n:  # header checked by an earlier read of this open file: the payload alone
        if body < 2 * PIECE_BYTES:
            got = pread_crc32(fd, dest, HEADER_BYTES)  # one C call without the GIL: read and CRC
            if got is not None:
                if f.dfd is None:
                    os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)
                return got == (n, f.crc)
        if body >= 2 * PIECE_BYTES:
            if f.read_aligned(dest, HEADER_BYTES) != n:
                return False
        elif os.preadv(fd, [dest], HEADER_BYTES) != n:
            return False
        if f.dfd is None:
            os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return crc32(dest) == f.crc
    if body >= 2 * PIECE_BYTES:
        first = 0
        if f.read_aligned(stage.view(0, HEADER_BYTES), 0) != HEADER_BYTES or \
                f.read_aligned(dest[:body], HEADER_BYTES) != body:
            return False
    else:
        first = min(n - body, STAGING_BYTES - HEADER_BYTES)
        iov = [stage.view(0, HEADER_BYTES)] + ([dest[:body]] if body else [])
        if first:
            iov.append(stage.view(HEADER_BYTES, align_up(first, ALIGN)))
        want = sum(len(v) for v in iov)
        if os.preadv(fd, iov, 0) != want:
            return False
    try:
        h = parse_header(bytes(stage.view(0, HEADER_BYTES)))
        if (h["url"], h["version"], h["offset"], h["length"]) != (key.url, key.version, key.offset, n):
            return False
        crc = int(h["crc"])
    except (ValueError, KeyError, TypeError):
        return False
    if first:
        dest[body:body + first] = stage.view(HEADER_BYTES, first)
    pos = body + first
    while pos < n:  # the rest of a payload read into a destination that is not page-aligned
        take = min(n - pos, STAGING_BYTES)
        span = align_up(take, ALIGN)
        if f.read_aligned(stage.view(0, span), HEADER_BYTES + pos) != span:
            return False
        dest[pos:pos + take] = stage.view(0, take)
        pos += take
    if f.dfd is None:
        os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)  # buffered: leave no pages behind
    if crc32(dest) != crc:
        return False
    f.crc = crc  # the header is the key's and its CRC matched a payload: kept for this open file's next reads
    return True



class EntryFile(LocalFile):
    """An entry file read as ``LocalFile`` reads (O_DIRECT, the buffered fallback without page cache),
    with one descriptor: the first entry a tier opens is probed (``known`` None); after that the
    tier's answer is used (True: opened with O_DIRECT alone, no probe read; False: buffered)."""

    crc: int | None = None  # the payload CRC-32 from this file's header, once a read checked both

    def __init__(self, path: str, known: bool | None):
        if known is None:
            super().__init__(path)
            return
        self.path, self.stats, self.direct_error = path, ReadStats(), None
        self.fd, self.dfd = -1, None
        if known:
            try:
                self.dfd = open_regular(path, os.O_RDONLY | os.O_DIRECT)
            except FileNotFoundError:
                raise
            except OSError as e:  # not expected on the filesystem that passed the probe: read buffered
                self.direct_error = f"open with O_DIRECT failed: {e.strerror}"
        if self.dfd is None:
            self.fd = open_regular(path)  # a FIFO or directory entry: NotRegularFileError (a tier miss)
        self.size = os.fstat(self.dfd if self.dfd is not None else self.fd).st_size


def entry_size(length: int) -> int:
    """Bytes an entry of ``length`` payload bytes takes on disk (header and padding)."""
    return HEADER_BYTES + align_up(length, ALIGN)


def make_header(key: Key, crc: int, model: str) -> bytes | None:
    body = json.dumps({"url": key.url, "version": key.version, "offset": key.offset, "length": key.length,
                       "crc": crc, "model": model}, separators=(",", ":")).encode()
    raw = MAGIC + body + b"\n"
    if len(raw) > HEADER_BYTES:
        return None
    return raw + bytes(HEADER_BYTES - len(raw))


def parse_header(raw: bytes) -> dict:
    if not raw.startswith(MAGIC):
        raise ValueError("not a disk tier entry (bad magic)")
    end = raw.find(b"\n", len(MAGIC))
    if end < 0:
        raise ValueError("entry header is not terminated")
    try:
        h = json.loads(raw[len(MAGIC):end].decode("utf-8"))
    except RecursionError:  # a header block nested thousands deep: damaged, as any bad header
        raise ValueError("entry header nests too deep") from None
    if not isinstance(h, dict):
        raise ValueError("entry header is not an object")
    return h


def write_all(fd: int, data: memoryview) -> None:
    data = data.cast("B") if data.format != "B" else data
    pos = 0
    while pos < len(data):
        pos += os.write(fd, data[pos:])


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["ENTRY_RE", "HEADER_BYTES", "MAGIC", "STAGING_BYTES", "EntryFile", "Key", "entry_size", "fsync_dir",
           "make_header", "parse_header", "read_entry", "write_all"]
