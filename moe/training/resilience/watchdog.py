"""Hang detection: a per-rank watchdog thread that ends a rank which completes no training step
for ``train.hang_timeout_s`` seconds.

A hung collective (a dead peer, a stuck file system, a deadlock) otherwise holds every rank's
allocation until the scheduler's time limit, with nothing in the logs. On a timeout the watchdog
writes the Python stack of every thread and the last collective the rank entered
(moe/training/resilience/collectives.py) to ``RUN_DIR/logs/hang_rank{R}.txt``, logs one line naming the
rank, and ends the process with :data:`HANG_EXIT_CODE` through ``os._exit`` (a hung main thread
would never run an exception handler or exit hooks).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import threading
import time
from pathlib import Path

from moe.training.hooks import StepState
from moe.training.resilience.collectives import LAST

log = logging.getLogger("moe.train")

HANG_EXIT_CODE = 70  # EX_SOFTWARE: not a preemption (75), not a crash's signal


def hang_file(logs_dir: Path, rank: int) -> Path:
    return Path(logs_dir) / f"hang_rank{rank}.txt"


class HangWatchdog:
    """Started with the loop; every completed step resets its clock; :meth:`close` stops it."""

    def __init__(self, timeout_s: float, logs_dir: Path, rank: int):
        self.timeout, self.rank = timeout_s, rank
        self.path = hang_file(logs_dir, rank)
        self.last_step = 0
        self.last_time = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)

    def start(self, step: int) -> None:
        self.last_step, self.last_time = step, time.monotonic()
        self._thread.start()

    def on_step_end(self, s: StepState) -> None:
        self.last_step, self.last_time = s.step, time.monotonic()

    def _watch(self) -> None:
        poll = min(max(self.timeout / 10, 0.1), 10.0)
        while not self._stop.wait(poll):
            idle = time.monotonic() - self.last_time
            if idle > self.timeout:
                self._report(idle)
                os._exit(HANG_EXIT_CODE)

    def _report(self, idle: float) -> None:
        msg = (f"rank {self.rank}: hang: no training step completed for {idle:.0f}s "
               f"(train.hang_timeout_s {self.timeout:g}; the last completed step is "
               f"{self.last_step}); the stack of every thread is in {self.path}; exiting with "
               f"code {HANG_EXIT_CODE}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:  # an earlier attempt's stacks stay
            f.write(f"{msg}\nin step {self.last_step + 1}, {LAST.describe()}\n\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        log.error(msg)

    def close(self) -> None:
        self._stop.set()
