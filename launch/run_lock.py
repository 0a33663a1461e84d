"""One moe-launch at a time trains a run: a second launch of the same run directory (a command
run twice, a resubmission while the first still trains) would write the same checkpoints, step
records and TensorBoard files beside the first. moe-launch holds ``RUN_DIR/.launch.lock`` (an
``flock``, released by the kernel however moe-launch ends; its ranks end with it,
launch/launcher_watch.py) from before it writes the run directory until the run has ended; the
file names the holder. Standard library only."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from moe.core.errors import LaunchError

LOCK_FILE = ".launch.lock"


def take(path: Path) -> int | None:
    """A descriptor of ``path`` (created if needed; not inherited by child processes unless
    passed) holding its exclusive ``flock``, or None when another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def record(fd: int, holder: dict) -> None:
    """Write ``holder`` (JSON) into the locked file, in place: a new file would not be the one
    locked."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder).encode(), 0)


class RunLock:
    """Held from construction until :meth:`release` (or this process ends)."""

    def __init__(self, run_dir: Path):
        path = Path(run_dir) / LOCK_FILE
        self.fd = take(path)  # not inherited by the ranks
        if self.fd is None:
            raise LaunchError(
                f"{run_dir}: another moe-launch is training this run ({_holder(path)}); wait "
                "for it to end or stop it, then run the same command again to resume"
            )
        record(self.fd, {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _holder(path: Path) -> str:
    """Who holds the lock, as its file says."""
    try:
        held = json.loads(path.read_text())
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(held["since"]))
        return f"pid {held['pid']} on {held['host']}, since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its process did not say which"
