"""Where input files live: local paths, or objects behind the S3 protocol (``s3://bucket/key``).

Objects are read through pyarrow's S3 file system, as streams or by ranges, never copied to
disk. Credentials come only from the AWS SDK's usual places (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``~/.aws/credentials``, ``~/.aws/config``,
``AWS_PROFILE``), never from the run config; error messages name the object, never a secret.
"""

from __future__ import annotations

import fnmatch
import glob
import io
import os
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from data_pipeline.config import S3Config
from data_pipeline.errors import DataError

S3_SCHEME = "s3://"
READ_BUFFER = 1 << 20
"""Bytes fetched per ranged GET when an object is read as a stream."""


def is_s3(path: str) -> bool:
    return str(path).startswith(S3_SCHEME)


def _fs(s3: S3Config) -> pafs.S3FileSystem:
    # Not cached: the SDK reads the credentials when the file system is made, and they may be
    # rotated (session tokens) while a long preparation runs.
    kwargs = {}
    if s3.endpoint_url:
        kwargs["endpoint_override"] = s3.endpoint_url
    if s3.region:
        kwargs["region"] = s3.region
    return pafs.S3FileSystem(**kwargs)


def join(base: str | os.PathLike, name: str) -> str | os.PathLike:
    """``name`` inside a local directory (a Path) or under an ``s3://`` prefix (a URL)."""
    if is_s3(str(base)):
        return f"{str(base).rstrip('/')}/{name}"
    return Path(base) / name


def _key(url: str) -> str:
    """``bucket/key`` as pyarrow names an object."""
    return url[len(S3_SCHEME) :].rstrip("/")


def _redacted(message: str) -> str:
    """The message with any credential the SDK might have read from the environment removed."""
    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        secret = os.environ.get(name)
        if secret:
            message = message.replace(secret, "***")
    return message


DENIED = (
    "ACCESS_DENIED",
    "SIGNATURE_DOES_NOT_MATCH",
    "INVALID_ACCESS_KEY_ID",
    "EXPIRED_TOKEN",
    "INVALID_CLIENT_TOKEN_ID",
    "MISSING_AUTHENTICATION_TOKEN",
)


def s3_error(url: str, e: BaseException) -> DataError:
    """A DataError naming the object, with what the store said and what to check."""
    text = _redacted(str(e))
    if isinstance(e, FileNotFoundError) or "NO_SUCH_KEY" in text:
        return DataError(f"{url}: no such object")
    if "NO_SUCH_BUCKET" in text:
        return DataError(f"{url}: the bucket {_key(url).split('/')[0]!r} does not exist ({text})")
    if any(code in text for code in DENIED):
        return DataError(
            f"{url}: access denied; check the credentials (AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws/credentials) and the "
            f"bucket's permissions ({text})"
        )
    return DataError(f"{url}: unreadable ({text})")


def _info(url: str, s3: S3Config) -> pafs.FileInfo:
    try:
        return _fs(s3).get_file_info(_key(url))
    except OSError as e:
        raise s3_error(url, e) from None


def _missing(url: str, s3: S3Config) -> DataError:
    """Why ``url`` is not there: its bucket is missing, or the object is."""
    bucket = S3_SCHEME + _key(url).split("/")[0]
    if _info(bucket, s3).type == pafs.FileType.NotFound:
        return DataError(
            f"{url}: the bucket {bucket} does not exist (or is not visible with these credentials)"
        )
    return DataError(f"{url}: no such object or prefix")


def open_input(path: str, s3: S3Config) -> io.BufferedIOBase:
    """A buffered binary reader of a local file or an object (seekable: ranged reads)."""
    if not is_s3(path):
        return open(path, "rb")
    try:
        raw = _fs(s3).open_input_file(_key(path))
    except OSError as e:
        raise (
            _missing(path, s3) if isinstance(e, FileNotFoundError) else s3_error(path, e)
        ) from None
    return io.BufferedReader(raw, READ_BUFFER)


def random_access(path: str, s3: S3Config) -> pa.NativeFile:
    """A file Arrow and Parquet readers can seek in: memory-mapped locally, ranged GETs on S3."""
    if not is_s3(path):
        return pa.memory_map(str(path), "r")
    try:
        return _fs(s3).open_input_file(_key(path))
    except OSError as e:
        raise (
            _missing(path, s3) if isinstance(e, FileNotFoundError) else s3_error(path, e)
        ) from None


def read_bytes(path: str | os.PathLike, s3: S3Config) -> bytes:
    """A whole (small) file or object."""
    if not is_s3(str(path)):
        return Path(path).read_bytes()
    with open_input(str(path), s3) as f:
        try:
            return f.read()
        except OSError as e:
            raise s3_error(str(path), e) from None


def open_object(url: str, s3: S3Config) -> pa.NativeFile:
    """An object as a forward-only stream (one GET)."""
    try:
        return _fs(s3).open_input_stream(_key(url))
    except OSError as e:
        raise (
            _missing(url, s3) if isinstance(e, FileNotFoundError) else s3_error(url, e)
        ) from None


def upload(local: Path, url: str, s3: S3Config) -> None:
    """Copy a local file to an object. Callers upload what refers to objects (a manifest) last:
    an interrupted upload leaves nothing a reader would take for complete data."""
    try:
        with _fs(s3).open_output_stream(_key(url)) as out, open(local, "rb") as f:
            for block in iter(lambda: f.read(READ_BUFFER * 8), b""):
                out.write(block)
    except OSError as e:
        raise s3_error(url, e) from None


def delete(path: str | os.PathLike, s3: S3Config, tree: bool = False) -> None:
    """Remove a file or an object (``tree``: a directory, or everything under an ``s3://``
    prefix with the empty ``name/`` object that stands for it); one already gone is no error.

    pyarrow keeps an S3 "directory" when it deletes the last object under it by writing such
    an empty object; removing a prefix writes one for its parent (at most one per parent: it
    is overwritten, never multiplied)."""
    if not is_s3(str(path)):
        if tree:
            shutil.rmtree(path, ignore_errors=True)
        else:
            Path(path).unlink(missing_ok=True)
        return
    fs = _fs(s3)
    try:
        (fs.delete_dir if tree else fs.delete_file)(_key(str(path)))
    except FileNotFoundError:
        pass
    except OSError as e:
        raise s3_error(str(path), e) from None


def subdirs(path: str | os.PathLike, s3: S3Config) -> list[str]:
    """Names of the directories in a directory, or of the prefixes (empty ones included) just
    under an ``s3://`` prefix; none when it does not exist."""
    if not is_s3(str(path)):
        return (
            sorted(p.name for p in Path(path).iterdir() if p.is_dir())
            if Path(path).is_dir()
            else []
        )
    try:
        found = _fs(s3).get_file_info(pafs.FileSelector(_key(str(path)), allow_not_found=True))
    except OSError as e:
        raise s3_error(str(path), e) from None
    return sorted(i.base_name for i in found if i.type == pafs.FileType.Directory)


def size(path: str, s3: S3Config) -> int:
    if not is_s3(path):
        return os.path.getsize(path)
    info = _info(path, s3)
    if info.type != pafs.FileType.File:
        raise _missing(path, s3)
    return info.size


def stat(path: str, s3: S3Config) -> tuple[int, int]:
    """(size in bytes, modification time in nanoseconds) of a file or an object."""
    if not is_s3(path):
        try:
            st = os.stat(path)
        except OSError as e:
            raise DataError(f"{path}: {e.strerror}") from None
        return st.st_size, st.st_mtime_ns
    info = _info(path, s3)
    if info.type != pafs.FileType.File:
        raise _missing(path, s3)
    return info.size, info.mtime_ns


def _segments_match(pattern: list[str], name: list[str]) -> bool:
    """Glob match of '/'-separated segments: ``*``, ``?``, ``[..]`` within a segment, ``**``
    across any number of them (as glob.glob with recursive=True)."""
    if not pattern:
        return not name
    if pattern[0] == "**":
        return any(_segments_match(pattern[1:], name[i:]) for i in range(len(name) + 1))
    return (
        bool(name)
        and re.fullmatch(fnmatch.translate(pattern[0]), name[0]) is not None
        and _segments_match(pattern[1:], name[1:])
    )


def glob_s3(pattern: str, s3: S3Config) -> list[tuple[str, bool]]:
    """(url, is a prefix) of the objects and prefixes a ``s3://`` pattern matches."""
    parts = _key(pattern).split("/")
    fixed = []
    for part in parts:
        if glob.has_magic(part):
            break
        fixed.append(part)
    base = S3_SCHEME + "/".join(fixed)
    if len(fixed) == len(parts):
        info = _info(base, s3)
        if info.type == pafs.FileType.NotFound:
            raise _missing(base, s3)
        return [(base, info.type == pafs.FileType.Directory)]
    rest = parts[len(fixed) :]
    return [
        (S3_SCHEME + info.path, info.type == pafs.FileType.Directory)
        for info in list_s3(base, s3, files_only=False)
        if _segments_match(rest, info.path[len(_key(base)) + 1 :].split("/"))
    ]


def list_s3(
    prefix: str, s3: S3Config, files_only: bool = True, missing_ok: bool = False
) -> list[pafs.FileInfo]:
    """Everything under a prefix (a "directory"), recursively, in name order (``missing_ok``:
    nothing when there is no such prefix)."""
    try:
        found = _fs(s3).get_file_info(
            pafs.FileSelector(_key(prefix), recursive=True, allow_not_found=missing_ok)
        )
    except FileNotFoundError:
        raise _missing(prefix, s3) from None
    except OSError as e:
        raise s3_error(prefix, e) from None
    return sorted(
        (i for i in found if i.type == pafs.FileType.File or not files_only), key=lambda i: i.path
    )
