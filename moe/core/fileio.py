"""Writing files that are either complete or absent: the one helper the checkpoint writer and
the data pipeline share (a foundation: it imports nothing of the project)."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, data) -> None:
    """Write bytes (any buffer) or text (UTF-8) to ``path`` so that it is either complete or
    absent, creating its folder if needed."""
    if isinstance(data, str):
        data = data.encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's names (a rename into it), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
