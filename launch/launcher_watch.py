"""Ranks end with the moe-launch that started them, even when it is killed (SIGKILL).

moe-launch starts the ranks in a session of their own (launch/interrupts.py), so nothing the
kernel does to moe-launch reaches them, and a ``kill -9`` of moe-launch (or of its process
group) would leave the scheduler's launcher and every rank training on, with nobody to report or
stop them. Two guards, both Linux, standard library only (a rank installs them before torch):

- the launcher moe-launch starts gets a parent-death signal (``prctl(PR_SET_PDEATHSIG)``):
  SIGTERM when moe-launch's thread that started it ends, however it ends;
- moe-launch names itself to every rank in :data:`ENV` (boot id, pid namespace, pid and start
  time: a pid alone may be reused, or mean another process on another host); the rank wrapper
  (launch/rank.py) and the training process (launch/train.py) watch that process through a
  pidfd and stop the rank the moment it is gone. Nothing can be saved then: moe-launch cannot
  report a save, and the ranks' agreement on a signal needs every rank.

A rank whose :data:`ENV` names a process of another host or pid namespace (a hostfile launch's
remote ranks, should the variable reach them) does not watch: DeepSpeed's multi-node runner
stops those through pdsh when it gets the parent-death signal.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable

ENV = "MOE_LAUNCHER"
POLL_S = 0.5
"""Without pidfd (Linux before 5.3): how often the launcher's pid is checked."""
PR_SET_PDEATHSIG = 1


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat from field 3 (the state) on: the command name before it may hold blanks."""
    stat = _read(f"/proc/{pid}/stat")
    return None if stat is None else stat.rsplit(")", 1)[1].split()


def _start_ticks(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22)."""
    fields = _stat(pid)
    return None if fields is None else fields[19]


def _machine() -> str | None:
    """This kernel's boot and this pid namespace: a pid means the same process only here.
    None without Linux's /proc."""
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    boot = _read("/proc/sys/kernel/random/boot_id")
    return f"{boot}/{pidns}" if boot else None


def identity(pid: int | None = None) -> str | None:
    """What :data:`ENV` holds for process ``pid`` (this one by default); None where nothing
    can watch it (no /proc)."""
    pid = os.getpid() if pid is None else pid
    machine, ticks = _machine(), _start_ticks(pid)
    return f"{machine}:{pid}:{ticks}" if machine and ticks else None


def watched_pid(value: str | None) -> int | None:
    """The launcher's pid when ``value`` names a process of this machine and pid namespace."""
    if not value or value.count(":") < 2:
        return None
    machine, pid, _ = value.rsplit(":", 2)
    here = _machine()
    return int(pid) if here is not None and machine == here and pid.isdigit() else None


def alive(value: str) -> bool:
    """Whether the process ``value`` names is still the one that wrote it (not a reused pid)."""
    _, pid, ticks = value.rsplit(":", 2)
    fields = _stat(int(pid))
    # A zombie (Z) or a dying process (X) has ended: its parent has not reaped it yet.
    return fields is not None and fields[19] == ticks and fields[0] not in ("Z", "X")


def _wait_gone(value: str, pid: int) -> None:
    """Return once the launcher ``value`` names has ended."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd: poll the pid
        while alive(value):
            time.sleep(POLL_S)
        return
    try:
        if not alive(value):  # the pid was reused before the pidfd was opened
            return
        poller = select.poll()
        poller.register(fd, select.POLLIN)  # readable once the process has exited
        while not poller.poll():
            pass
    finally:
        os.close(fd)


def end_with_launcher(on_gone: Callable[[int], None], env=None) -> threading.Thread | None:
    """Call ``on_gone(pid)`` from a daemon thread once the launcher named in :data:`ENV` ends
    (at once if it has already ended). None: nothing to watch here."""
    value = (os.environ if env is None else env).get(ENV)
    pid = watched_pid(value)
    if pid is None:
        return None

    def watch() -> None:
        _wait_gone(value, pid)
        on_gone(pid)

    thread = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    thread.start()
    return thread


def say(line: str) -> None:
    """One line on stderr, which may be a pipe whose reader died with the launcher."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def gone_line(pid: int, what: str) -> str:
    return (
        f"moe-launch (pid {pid}) is gone: stopping {what} without saving; the run resumes "
        f"from its newest complete checkpoint"
    )


def die_with_parent(signum: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``signum`` when the thread
    that starts it ends (Linux ``PR_SET_PDEATHSIG``), and ends at once if this process died
    before the child could ask. None where prctl is not available."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not after the fork
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
        if os.getppid() != parent:  # the parent ended before prctl took effect
            os._exit(128 + int(signum))

    return preexec
