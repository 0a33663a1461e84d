"""A bounded local cache of objects (shards, the tokenizer) fetched from S3, shared by the ranks
of a node.

Files are named by their SHA-256 (``<sha256>``), so a name says what the content is and data
sets sharing a cache never collide. The protocol, all through ``fcntl.flock`` (locks die with
their process, so a crash leaves no lock held):

- fetching ``X``: exclusive lock on ``X.lock`` (two ranks never download ``X`` at once; the
  second finds it there), room made under the cache-wide lock ``cache.lock`` and reserved by
  sizing the temporary file ``X.<pid>.<n>.tmp`` to the object's size, then the object is
  streamed into it while hashed, fsynced, checked against the manifest's SHA-256 and renamed to
  ``X``. A bad object leaves no file behind.
- reading ``X``: a shared lock on ``X`` itself while it is open; its modification time is set
  on each open, which makes it the most recently used.
- evicting (under ``cache.lock``): the least recently used files whose exclusive lock can be
  taken at once, i.e. that no process has open, until the new object fits. Temporary files
  count with their reserved size, so the bound holds while downloads are in flight.
- start-up: temporary files whose shard lock is free (their downloader is gone), lock files
  nobody holds, and files of the data whose size differs from the manifest's are removed.

A lock file is removed only under its own exclusive lock, and whoever takes a lock checks that
the file it locked is still the one at that path (else it locks the new one).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import itertools
import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from data_pipeline import storage
from data_pipeline.config import S3Config
from data_pipeline.errors import DataError, corrupt
from moe.core.fileio import fsync_path

ROOM_WAIT_S = 600.0
"""How long a fetch waits for other ranks to release shards when the cache is full of shards in
use, before it reports the cache as too small."""
_SHA = re.compile(r"[0-9a-f]{64}")
_TMP = re.compile(r"([0-9a-f]{64})\.\d+\.\d+\.tmp")
_counter = itertools.count()


class NoRoom(Exception):
    """The cache is full of files in use (raised to callers that asked not to wait)."""


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moe-pretrain" / "shards"


@contextmanager
def _locked(path: Path, mode: int) -> Iterator[int]:
    """``flock(mode)`` on the file at ``path`` (created if needed), re-taken if the file was
    replaced while we waited. Yields the descriptor; raises BlockingIOError under LOCK_NB."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, mode)
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            break
        os.close(fd)
    try:
        yield fd
    finally:
        os.close(fd)


def _try_exclusive(path: Path) -> int | None:
    """A descriptor of the existing file ``path`` with its exclusive lock, or None when someone
    holds a lock on it (or it is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


class ObjectCache:
    """Objects of one store in ``root``, at most ``max_bytes`` of them (see the module doc)."""

    def __init__(
        self, root: str | Path, max_bytes: int, s3: S3Config, room_wait_s: float = ROOM_WAIT_S
    ):
        self.root, self.max_bytes, self.s3 = Path(root), int(max_bytes), s3
        self.room_wait_s = room_wait_s
        self.fetches = 0
        """Objects this instance downloaded (tests and logs)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DataError(
                f"{self.root}: cannot create the shard cache ({e}); set "
                "data.cache_dir to a writable local directory"
            ) from None

    # --- start-up ---

    def clean(self, sizes: dict[str, int | None]) -> list[str]:
        """Remove what a crashed run left: temporary files nobody is writing, lock files nobody
        holds, and files whose size is not ``sizes[sha256]`` (when known). Returns the names
        removed."""
        removed = []
        for entry in sorted(os.listdir(self.root)):
            path = self.root / entry
            tmp = _TMP.fullmatch(entry)
            if tmp:
                try:
                    with _locked(self.root / f"{tmp.group(1)}.lock", fcntl.LOCK_EX | fcntl.LOCK_NB):
                        path.unlink(missing_ok=True)
                        removed.append(entry)
                except BlockingIOError:
                    pass  # its download is in flight
            elif _SHA.fullmatch(entry) and sizes.get(entry) is not None:
                fd = _try_exclusive(path)
                if fd is None:
                    continue
                try:
                    if os.fstat(fd).st_size != sizes[entry]:
                        path.unlink(missing_ok=True)
                        removed.append(entry)
                finally:
                    os.close(fd)
        for entry in sorted(os.listdir(self.root)):
            if entry.endswith(".lock") and entry != "cache.lock":
                fd = _try_exclusive(self.root / entry)
                if fd is not None:
                    try:
                        (self.root / entry).unlink(missing_ok=True)
                        removed.append(entry)
                    finally:
                        os.close(fd)
        return removed

    # --- reading ---

    @contextmanager
    def open(self, url: str, sha256: str, nbytes: int | None = None) -> Iterator[Path]:
        """The local copy of ``url`` (fetched and verified if needed), which no other rank evicts
        while the block runs."""
        while True:
            path = self.fetch(url, sha256, nbytes)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue  # evicted between the fetch and the open: fetch again
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                current = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
            if current:
                break
            os.close(fd)
        try:
            _touch(path)
            yield path
        finally:
            os.close(fd)

    def fetch(self, url: str, sha256: str, nbytes: int | None = None, wait: bool = True) -> Path:
        """Make sure the verified object is in the cache; its path. ``wait=False``: raise
        NoRoom instead of waiting for room (read-ahead)."""
        path = self.root / sha256
        if path.exists():
            _touch(path)
            return path
        with _locked(self.root / f"{sha256}.lock", fcntl.LOCK_EX):
            if path.exists():  # another rank fetched it while we waited
                return path
            size = storage.size(url, self.s3) if nbytes is None else int(nbytes)
            if size > self.max_bytes:
                raise DataError(
                    f"{url}: {size:,} bytes do not fit in the shard cache "
                    f"(data.cache_bytes = {self.max_bytes:,}); raise data.cache_bytes"
                )
            tmp = self.root / f"{sha256}.{os.getpid()}.{next(_counter)}.tmp"
            self._reserve(tmp, size, url, wait)
            try:
                self._download(url, sha256, size, tmp)
                os.rename(tmp, path)
                fsync_path(self.root)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            self.fetches += 1
            return path

    def _reserve(self, tmp: Path, size: int, url: str, wait: bool) -> None:
        """Create ``tmp`` sized ``size`` once that many bytes fit under the bound."""
        deadline = time.monotonic() + self.room_wait_s
        while True:
            with _locked(self.root / "cache.lock", fcntl.LOCK_EX):
                if self._make_room(size):
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                    try:
                        os.ftruncate(fd, size)  # sparse: counts at its full size from now on
                    finally:
                        os.close(fd)
                    return
            if not wait:
                raise NoRoom(url)
            if time.monotonic() > deadline:
                raise DataError(
                    f"{url}: no room in the shard cache {self.root} ({self.max_bytes:,} bytes, "
                    f"data.cache_bytes) after {self.room_wait_s:.0f}s: the shards open on this "
                    "node fill it; raise data.cache_bytes (it must hold a few shards per rank)"
                )
            time.sleep(0.05)

    def used_bytes(self) -> int:
        """Bytes of the cached and reserved files."""
        total = 0
        for entry in os.listdir(self.root):
            if _SHA.fullmatch(entry) or _TMP.fullmatch(entry):
                try:
                    total += os.stat(self.root / entry).st_size
                except FileNotFoundError:
                    pass
        return total

    def _make_room(self, size: int) -> bool:
        """Evict least recently used files nobody has open until ``size`` more bytes fit."""
        free = self.max_bytes - self.used_bytes()
        if free >= size:
            return True
        files = []
        for entry in os.listdir(self.root):
            if _SHA.fullmatch(entry):
                try:
                    files.append((os.stat(self.root / entry).st_mtime_ns, entry))
                except FileNotFoundError:
                    pass
        for _, entry in sorted(files):
            fd = _try_exclusive(self.root / entry)
            if fd is None:
                continue  # open by some rank
            try:
                free += os.fstat(fd).st_size
                (self.root / entry).unlink(missing_ok=True)
            finally:
                os.close(fd)
            if free >= size:
                return True
        return False

    def _download(self, url: str, sha256: str, size: int, tmp: Path) -> None:
        h, got = hashlib.sha256(), 0
        with storage.open_object(url, self.s3) as src, open(tmp, "r+b") as out:
            while True:
                try:
                    block = src.read(storage.READ_BUFFER)
                except OSError as e:
                    raise storage.s3_error(url, e) from None
                if not block:
                    break
                got += len(block)
                if got > size:
                    break
                h.update(block)
                out.write(block)
            out.flush()
            os.fsync(out.fileno())
        if got != size:
            raise DataError(
                f"{url}: corrupt object: its size differs from the manifest's "
                f"({got:,} bytes read, {size:,} expected); prepare and upload the "
                "data again"
            )
        if h.hexdigest() != sha256:
            raise corrupt(url, "object", h.hexdigest(), sha256)


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError as e:  # another user's file in a shared cache: its age stays as it was
        if e.errno not in (errno.EPERM, errno.EACCES, errno.ENOENT):
            raise


class ReadAhead:
    """Fetches objects into a cache in one background thread, without waiting for room: a
    fetch that would have to wait, or that fails, is left to the reader, which reports it."""

    def __init__(self, cache: ObjectCache):
        self.cache = cache
        self._wanted: list[tuple[str, str, int | None]] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.fetched = 0
        """Objects this thread downloaded."""

    def want(self, items: list[tuple[str, str, int | None]]) -> None:
        """Replace the list of objects to fetch next (url, sha256, bytes), in order."""
        with self._cond:
            self._wanted = list(items)
            if (self._thread is None or not self._thread.is_alive()) and items:
                self._stopped = False
                self._thread = threading.Thread(
                    target=self._run, name="shard-read-ahead", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def stop(self, timeout: float = 120.0) -> None:
        """Fetch nothing more and wait for the fetch under way, which removes its temporary
        file if it fails: after a read error, nothing of a failed object is left in the cache
        (the thread may have taken the object the reader just failed on off its list before the
        reader's own fetch took the lock, and would fetch it again after). A later ``want``
        starts again."""
        with self._cond:
            self._wanted, self._stopped = [], True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._wanted and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                url, sha, nbytes = self._wanted.pop(0)
            there = (self.cache.root / sha).exists()
            try:
                self.cache.fetch(url, sha, nbytes, wait=False)
                self.fetched += not there
            except (NoRoom, DataError, OSError):
                pass  # read-ahead only: the reader's own fetch of this shard raises it, naming it
