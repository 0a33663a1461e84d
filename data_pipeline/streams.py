"""Input files as streams of bytes: plain, gzip or zstd (known by their first bytes, whatever
their name), local or ``s3://`` (storage.py). Compressed files are decompressed as streams,
never to disk; a damaged stream is an error that names the file, never a silent end of file.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import zlib
from collections.abc import Iterator
from pathlib import Path

import zstandard

from data_pipeline import storage
from data_pipeline.config import S3Config
from data_pipeline.errors import DataError

LOCAL = S3Config()
"""The default S3 settings, for callers that read only local files."""

MAGIC = {"gzip": b"\x1f\x8b", "zstd": b"\x28\xb5\x2f\xfd"}
SUFFIX = {".gz": "gzip", ".zst": "zstd"}
STREAM_CHUNK = 1 << 20


def compression(path: Path | str, s3: S3Config = LOCAL) -> str | None:
    """``gzip``, ``zstd`` or None (plain), from the file's first bytes: a ``.txt`` that holds
    gzip is read as gzip. A ``.gz`` or ``.zst`` suffix that the bytes contradict is an error
    (a truncated download, a mislabelled file) rather than a guess."""
    try:
        with storage.open_input(str(path), s3) as f:
            head = f.read(4)
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from e
    suffix = os.path.splitext(str(path))[1]
    found = next((kind for kind, magic in MAGIC.items() if head.startswith(magic)), None)
    claimed = SUFFIX.get(suffix.lower())
    if claimed and found != claimed:
        raise DataError(
            f"{path}: named {suffix} but does not start like {claimed} data "
            f"(first bytes {head.hex() or 'none'}); the file is damaged or mislabelled"
        )
    return found


class _ZstdStream(io.RawIOBase):
    """Decompresses a zstd file frame after frame. Unlike zstandard's ``stream_reader``, a
    truncated last frame is an error here, not a silent end of file."""

    def __init__(self, raw):
        self._raw, self._obj, self._pending = raw, zstandard.ZstdDecompressor().decompressobj(), b""

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while not self._pending:
            chunk = self._raw.read(STREAM_CHUNK)
            if not chunk:
                if not self._obj.eof:
                    raise zstandard.ZstdError("truncated: the last frame is incomplete")
                return 0
            while chunk:
                if self._obj.eof:  # next frame
                    self._obj = zstandard.ZstdDecompressor().decompressobj()
                self._pending += self._obj.decompress(chunk)
                chunk = self._obj.unused_data if self._obj.eof else b""
        n = min(len(buf), len(self._pending))
        buf[:n], self._pending = self._pending[:n], self._pending[n:]
        return n


STREAM_ERRORS = (OSError, EOFError, zlib.error, zstandard.ZstdError)
"""What a damaged compressed stream raises while it is read (gzip.BadGzipFile is an OSError)."""


@contextlib.contextmanager
def open_stream(path: Path | str, s3: S3Config = LOCAL) -> Iterator[io.BufferedIOBase]:
    """The file's (decompressed) bytes as a buffered binary stream; nothing is written to disk.
    Any decompression or read error, also one raised while the caller reads, becomes a
    DataError that names the file."""
    kind = compression(path, s3)
    try:
        with storage.open_input(str(path), s3) as raw:
            if kind == "gzip":
                stream = gzip.GzipFile(fileobj=raw)
            elif kind == "zstd":
                stream = io.BufferedReader(_ZstdStream(raw), STREAM_CHUNK)
            else:
                stream = raw
            yield stream
    except STREAM_ERRORS as e:
        what = f"corrupt {kind} data" if kind else "unreadable"
        raise DataError(f"{path}: {what} ({getattr(e, 'strerror', None) or e})") from e


def read_bytes(path: Path | str, s3: S3Config = LOCAL) -> bytes:
    """The file's whole (decompressed) bytes."""
    with open_stream(path, s3) as f:
        return f.read()
