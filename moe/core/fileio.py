"""Writing files that are either complete or absent: the one helper the checkpoint writer and
the data pipeline share (a foundation: it imports nothing of the project)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

STORAGE_CAUSES = {
    errno.ENOSPC: "the disk holding it is full",
    errno.EDQUOT: "this user's disk quota on the disk holding it is used up",
    errno.EROFS: "the disk holding it is read-only",
    errno.EACCES: "this user may not write there (permission denied)",
    errno.EPERM: "this user may not write there (operation not permitted)",
}
"""Write errors that say the disk, not the data, is the problem: nothing a program does fixes
them (the data pipeline's and the command lines' messages)."""


def write_atomic(path: Path, data) -> None:
    """Write bytes (any buffer) or text (UTF-8) to ``path`` so that it is either complete or
    absent, creating its folder if needed; a failed write leaves no temporary file."""
    if isinstance(data, str):
        data = data.encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is None:  # a buffered write names no file
            e.filename = str(path)
        raise


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's names (a rename into it), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
