"""The signals moe-launch receives while the ranks of a local, hostfile or mpi launch run, and
the rank processes it acts on.

The ranks run in a session of their own (launch/restarts.py starts the scheduler's launcher
with ``start_new_session``), so a terminal's Ctrl-C or hang-up reaches moe-launch alone, and
moe-launch decides what the ranks get:

- the first SIGTERM, SIGINT (Ctrl-C), SIGHUP or SIGUSR1: every training process on this machine
  gets the first signal of ``checkpoint.save_on_signals`` (USR1 unless configured otherwise),
  once it has a handler for it (its ``SigCgt`` mask: a process still importing would die of
  it); the ranks save at the end of their step and exit 75 (moe/training/resilience/
  preemption.py), and moe-launch exits 75 once they have;
- a second SIGTERM, SIGINT or SIGHUP: stop now, without waiting for the save: every process of
  the ranks' session gets SIGTERM, and SIGKILL after :data:`KILL_AFTER_S`;
- with ``checkpoint.save_on_signals: []`` the first signal already stops the ranks at once.

Each signal is acted on the moment it arrives: the handler only records it and wakes the
supervisor's poll loop (:meth:`LauncherSignals.wait`), which announces it and acts. A SIGKILL
cannot be acted on: the ranks end with moe-launch all the same (launch/launcher_watch.py).

Standard library and psutil (a DeepSpeed dependency) only.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time

import psutil

KILL_AFTER_S = 5.0
"""How long a process has to end after SIGTERM before it is killed."""
HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""A second one of these stops the ranks without waiting for their save."""


class LauncherSignals:
    """Installed in moe-launch (the main thread) for as long as ranks run (a context manager).
    The handler only records; :meth:`deliver`, called from the supervisor's poll loop, acts."""

    def __init__(self, save_signal: int | None):
        self.save_signal = save_signal
        """What the ranks get; None: they are stopped instead (nothing saves on a signal)."""
        self.received: int | None = None
        self.forced: int | None = None
        """A second stopping signal, or the first one when nothing saves on a signal."""
        self.announced = False
        self.stopping_announced = False
        self.delivered: set[int] = set()
        self._previous: dict[int, object] = {}
        self._wake_r = self._wake_w = -1
        self._previous_wakeup = -1

    def __enter__(self) -> LauncherSignals:
        # The interpreter writes to this pipe the moment a signal arrives, whichever thread
        # the kernel gives it to: wait() returns then, not when its timeout ends.
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        self._previous_wakeup = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for signum in HANDLED:
            # An ignored signal stays ignored (nohup's SIGHUP, a background job's SIGINT).
            if signal.getsignal(signum) is not signal.SIG_IGN:
                self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}
        signal.set_wakeup_fd(self._previous_wakeup)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    def _on_signal(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
            if self.save_signal is None:
                self.forced = signum
        elif signum in STOPPING:
            self.forced = signum

    def wait(self, timeout: float) -> None:
        """Sleep ``timeout`` seconds, or less: until a signal arrives (one that arrived since
        the last call returns at once). The handler has run when the caller's next call
        starts (the interpreter runs handlers between bytecodes of the main thread)."""
        ready, _, _ = select.select([self._wake_r], [], [], timeout)
        if ready:
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass

    @property
    def name(self) -> str:
        return signal.Signals(self.forced or self.received).name

    def deliver(self, proc: subprocess.Popen) -> None:
        """Announce each signal that changes what happens (one line each: the first, and a
        second one that stops the ranks at once, even when both came between two calls) and
        pass the save signal to every training process of ``proc`` ready to act on it that has
        not had it yet."""
        if self.received is None:
            return
        if not self.announced and self.save_signal is not None:
            print(
                f"launch: {signal.Signals(self.received).name}: every rank saves at the end of "
                f"its step and stops (exit code 75); a second SIGTERM or Ctrl-C stops them at "
                f"once without saving",
                flush=True,
            )
        self.announced = True
        if self.forced is not None:
            if self.save_signal is not None and not self.stopping_announced:
                print(
                    f"launch: {signal.Signals(self.forced).name}, a second signal: stopping "
                    f"every rank now, without waiting for the save",
                    flush=True,
                )
            self.stopping_announced = True
            return
        for p in training_processes(proc):
            if p.pid not in self.delivered and catches(p.pid, self.save_signal):
                try:
                    p.send_signal(self.save_signal)
                except psutil.NoSuchProcess:
                    continue
                self.delivered.add(p.pid)


def training_processes(proc: subprocess.Popen) -> list[psutil.Process]:
    """The training ranks (``launch.train``) among the descendants of ``proc``."""
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for p in descendants:
        try:
            if "launch.train" in p.cmdline():
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (Linux: /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except OSError:
        return False
    return False


def rank_of(p: psutil.Process) -> int | None:
    try:
        return int(p.environ().get("RANK", ""))
    except (ValueError, psutil.Error):
        return None


def kill_unresponsive(proc: subprocess.Popen, since_s: float) -> list[str]:
    """After a rank's abnormal end, the scheduler's launcher terminates the others: kill the
    training processes of ``proc`` that are stopped (SIGSTOP: they cannot act on SIGTERM) or,
    ``since_s`` seconds after that end, still alive past :data:`KILL_AFTER_S`. Returns one line
    per process killed."""
    lines = []
    for p in training_processes(proc):
        try:
            stopped = p.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
            if not stopped and since_s < KILL_AFTER_S:
                continue
            rank = rank_of(p)
            p.kill()  # SIGKILL ends a stopped process too
        except psutil.NoSuchProcess:
            continue
        why = (
            "stopped (it cannot act on SIGTERM)"
            if stopped
            else f"still running {KILL_AFTER_S:g}s after the other ranks were told to stop"
        )
        lines.append(
            f"launch: killed rank {rank if rank is not None else '?'} (pid {p.pid}): {why}"
        )
    return lines


def stop_session(proc: subprocess.Popen) -> None:
    """SIGTERM to the launcher ``proc`` first (DeepSpeed's multi-node runner then kills its
    remote ranks), then to every descendant, SIGKILL to those left after :data:`KILL_AFTER_S`
    and to the rest of its process group when it leads one (``start_new_session``); waits for
    ``proc`` and until the descendants it killed are dead. ``proc`` itself is waited for
    through ``proc`` only: reaping it elsewhere (psutil) would turn its exit status into 0."""
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    proc.terminate()
    for p in descendants:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(descendants, timeout=KILL_AFTER_S)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    try:  # a process started while the tree was read is in the group all the same
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=KILL_AFTER_S)
    except subprocess.TimeoutExpired:  # not a group leader, and it ignores SIGTERM
        proc.kill()
        proc.wait()
    _wait_dead(alive, KILL_AFTER_S)


def _wait_dead(procs: list[psutil.Process], timeout: float) -> None:
    """Until every one of ``procs`` (sent SIGKILL) is gone or a zombie: a kill is delivered
    asynchronously, and a rank still running holds its ports and memory. Zombies count as
    dead: their new parent, not this process, reaps them."""
    deadline = time.monotonic() + timeout
    for p in procs:
        while time.monotonic() < deadline:
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.02)
