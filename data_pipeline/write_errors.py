"""Failures to write prepared data: a full, over-quota or read-only disk, or a folder this user
may not write. Each becomes a DataError that names the file and the cause (an OSError of a
buffered write names no file), raised where the path is known: in the main process, and in
a worker, whose DataError crosses the pool's pipe whole. And the undoing of a step that replaces
a few small files, which cannot change together."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

from data_pipeline.errors import DataError
from moe.core.fileio import STORAGE_CAUSES, write_atomic

CAUSES = STORAGE_CAUSES


def write_error(e: OSError, where: Path) -> DataError | None:
    """The DataError for ``e``, a failure to write ``where`` or a file below it; None when ``e``
    is another error, or a permission error on a file elsewhere (an input that cannot be read)."""
    if e.errno not in CAUSES:
        return None
    # filename2: the destination of a copy or rename (copyfile names its source first)
    named = next((n for n in (e.filename2, e.filename) if isinstance(n, (str, os.PathLike))), None)
    target = Path(os.path.abspath(named if named is not None else where))
    base = Path(os.path.abspath(where))
    if e.errno in (errno.EACCES, errno.EPERM) and not (
        target == base or base in target.parents or target in base.parents
    ):
        return None
    cause = CAUSES[e.errno]
    if e.errno == errno.ENOSPC:
        free = _free_bytes(target)
        cause += f" ({free:,} bytes free)" if free is not None else ""
    return DataError(f"cannot write {target}: {cause}")


@contextlib.contextmanager
def writing(where: Path) -> Iterator[None]:
    """A failure to write ``where`` (or below it) in the block raised as :func:`write_error`'s
    DataError; any other error passes as it is."""
    try:
        yield
    except OSError as e:
        failure = write_error(e, where)
        if failure is None:
            raise
        raise failure from e


def _free_bytes(path: Path) -> int | None:
    """Free bytes of the disk holding ``path`` (or its nearest existing folder)."""
    for p in (path, *path.parents):
        try:
            st = os.statvfs(p)
        except FileNotFoundError:
            continue
        except OSError:
            return None
        return st.f_bavail * st.f_frsize
    return None


class FileSnapshot:
    """The bytes of a few small files (or their absence), to put back when the step that
    replaces them fails before it is complete."""

    def __init__(self, paths: list[Path]):
        self.before = {p: p.read_bytes() if p.exists() else None for p in paths}

    def restore(self) -> None:
        """Each file as it was, and no temporary file of a failed write_atomic beside it; as
        far as the disk lets (this runs after another error)."""
        for path, data in self.before.items():
            with contextlib.suppress(OSError):
                for tmp in path.parent.glob(f".{path.name}.tmp*"):
                    tmp.unlink()
                if data is None:
                    path.unlink(missing_ok=True)
                elif not path.exists() or path.read_bytes() != data:
                    write_atomic(path, data)
