"""Hang detection: a per-rank watchdog thread that ends a rank which completes no training step
for ``train.hang_timeout_s`` seconds, and says which rank the others were waiting for.

A hung collective (a dead or frozen peer, a stuck file system, a deadlock) otherwise holds every
rank's allocation until the scheduler's time limit, with nothing in the logs. The watchdog must
speak before the collective gives up: the process group's timeout is ``hang_timeout_s`` plus
:func:`margin_s` (:func:`process_group_timeout_s`, set where the group starts), longer than the
watchdog takes to notice, ask its peers and write its report.

Which rank did not arrive? A healthy rank waiting in collective number N cannot learn it from
the collective. Every rank's watchdog therefore publishes, each poll, a heartbeat in the
rendezvous store: a counter that only a running process advances, the number of collectives it
entered (moe/training/resilience/collectives.py) and its step. When a rank's watchdog fires, it
raises an alarm in the store (so that every live rank writes its stacks too), reads every
heartbeat twice, three polls apart, and names the peers that have not reached collective N:
those whose heartbeat stood still (stopped, frozen or gone: a SIGSTOP, a node lost) and those
alive but behind (stuck in computation or I/O). A store that does not answer names rank 0, the
process that holds it.

A rank that sees the alarm reports at once (its stacks; the verdict is the first rank's). On a
timeout each live rank appends its report (the stack of every thread, the last collective
it entered, the ranks that did not arrive) to ``RUN_DIR/logs/hang_rank{R}.txt`` and one JSON
line to ``hangs_rank{R}.jsonl`` (read by the launcher to name the hung rank), logs one line,
waits a little for its live peers' reports, and ends the process with :data:`HANG_EXIT_CODE`
through ``os._exit`` (a hung main thread would never run an exception handler or exit hooks).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

from moe.training.hooks import LoopPart, StepState
from moe.training.resilience.collectives import LAST

log = logging.getLogger("moe.train")

HANG_EXIT_CODE = 70  # EX_SOFTWARE: not a preemption (75), not a crash's signal
STORE_TIMEOUT_S = 5.0
"""One request to the rendezvous store; a store that does not answer in time is not asked again."""
KEY_PREFIX = "moe_watchdog/"
ALIVE = "alive but behind"


def hang_file(logs_dir: Path, rank: int) -> Path:
    return Path(logs_dir) / f"hang_rank{rank}.txt"


def hang_records_file(logs_dir: Path, rank: int) -> Path:
    """One JSON line per report: rank, step, collective, call, missing ranks and why, time."""
    return Path(logs_dir) / f"hangs_rank{rank}.jsonl"


def poll_s(timeout_s: float) -> float:
    """How often the watchdog checks, and publishes its heartbeat."""
    return min(max(timeout_s / 10, 0.1), 10.0)


def margin_s(timeout_s: float) -> float:
    """The longest a report can take after the timeout: one poll to notice, three between the
    two readings of the heartbeats, three waiting for the peers' reports, and one store request
    that times out (after which the store is not asked again); plus slack."""
    return 7 * poll_s(timeout_s) + STORE_TIMEOUT_S + 10.0


def process_group_timeout_s(hang_timeout_s: float) -> float:
    """The process group's collective timeout for a watchdog of ``hang_timeout_s`` (> 0): a
    collective may give up only once the watchdog has reported."""
    return hang_timeout_s + margin_s(hang_timeout_s)


class Heartbeats:
    """This rank's heartbeat in the rendezvous store, and everyone's, through a client
    connection of its own (MASTER_ADDR, MASTER_PORT) with a short timeout."""

    def __init__(self, store, rank: int, world_size: int):
        self.store, self.rank, self.world = store, rank, world_size
        self.beat = 0
        self.error: str | None = None

    @classmethod
    def connect(cls, rank: int) -> Heartbeats | None:
        """None with a single rank or a process group started without a TCP store address."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not addr or not port:
            return None
        try:
            store = dist.TCPStore(
                addr,
                int(port),
                is_master=False,
                wait_for_workers=False,
                timeout=timedelta(seconds=STORE_TIMEOUT_S),
            )
        except Exception as e:  # the watchdog works without heartbeats
            log.warning(f"rank {rank}: hang watchdog: no heartbeats ({e})")
            return None
        return cls(store, rank, dist.get_world_size())

    def _ask(self, fn, *args):
        """The store's answer; None (and the store given up) when it fails."""
        if self.error is not None:
            return None
        try:
            return fn(*args)
        except Exception as e:  # DistStoreError, RuntimeError, OSError
            self.error = str(e).splitlines()[0] if str(e) else type(e).__name__
            return None

    def publish(self, step: int) -> None:
        self.beat += 1
        record = {
            "beat": self.beat,
            "calls": LAST.calls,
            "name": LAST.name,
            "inside": not LAST.returned,
            "step": step,
            "time": time.time(),
        }
        self._ask(self.store.set, f"{KEY_PREFIX}beat/{self.rank}", json.dumps(record))

    def read(self) -> dict[int, dict | None]:
        """Every rank's last heartbeat (None: none published or the store did not answer)."""
        out: dict[int, dict | None] = {}
        for r in range(self.world):
            key = f"{KEY_PREFIX}beat/{r}"
            # get() waits for a missing key: ask whether it exists first.
            value = self._ask(self.store.get, key) if self._ask(self.store.check, [key]) else None
            out[r] = json.loads(value) if value else None
        return out

    def raise_alarm(self) -> None:
        self._ask(self.store.set, f"{KEY_PREFIX}alarm", str(self.rank))

    def alarm(self) -> int | None:
        """The rank whose watchdog fired, if one did."""
        key = f"{KEY_PREFIX}alarm"
        if not self._ask(self.store.check, [key]):
            return None
        value = self._ask(self.store.get, key)
        return int(value) if value else None

    def mark_reported(self) -> None:
        self._ask(self.store.set, f"{KEY_PREFIX}reported/{self.rank}", "1")

    def reported(self, ranks) -> bool:
        keys = [f"{KEY_PREFIX}reported/{r}" for r in ranks]
        return not keys or bool(self._ask(self.store.check, keys))


def not_arrived(
    rank: int,
    calls: int,
    inside: bool,
    first: dict[int, dict | None],
    second: dict[int, dict | None],
    store_error: str | None,
    waited_s: float,
) -> dict[int, str]:
    """The ranks that have not reached this rank's collective (number ``calls``; ``inside``:
    this rank is waiting in it), each with the reason, from two readings of the heartbeats
    ``waited_s`` seconds apart. A rank not inside a collective names itself when its peers have
    gone further: they are waiting for it."""
    if store_error and rank != 0:
        return {
            0: f"the rendezvous store, which runs in rank 0, did not answer ({store_error}): "
            f"rank 0 is stopped, frozen or gone"
        }
    out: dict[int, str] = {}
    for r in sorted(second):
        if r == rank:
            continue
        now, before = second[r], first.get(r)
        if now is None:
            out[r] = "no heartbeat: it never reached the training loop, or is gone"
        elif before is not None and before["beat"] == now["beat"]:
            out[r] = (
                f"stopped responding: its heartbeat did not change in {waited_s:.1f}s "
                f"(the last one, {time.time() - now['time']:.1f}s ago, said "
                f"{_where(now)}): the process is stopped, frozen or gone"
            )
        elif inside and now["calls"] < calls:
            out[r] = f"{ALIVE}: it is {_where(now)}"
    if not inside:
        ahead = [r for r, hb in second.items() if r != rank and hb and hb["calls"] > calls]
        if ahead:
            out[rank] = (
                f"{ALIVE}: this rank is not inside a collective while rank(s) "
                f"{', '.join(map(str, ahead))} went further and wait for it"
            )
    return out


def _where(hb: dict) -> str:
    state = "inside" if hb["inside"] else "past"
    return (
        f"{state} collective call {hb['calls']} ({hb['name'] or 'none'}) in step {hb['step'] + 1}"
    )


class HangWatchdog(LoopPart):
    """Started with the loop; every completed step and every complete checkpoint restart its
    clock; :meth:`close` stops it."""

    def __init__(self, timeout_s: float, logs_dir: Path, rank: int):
        self.timeout, self.rank = timeout_s, rank
        self.poll = poll_s(timeout_s)
        self.path = hang_file(logs_dir, rank)
        self.records = hang_records_file(logs_dir, rank)
        self.last_step = 0
        self.last_time = time.monotonic()
        self.heartbeats: Heartbeats | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)

    def start(self, step: int) -> None:
        self.last_step, self.last_time = step, time.monotonic()
        self.heartbeats = Heartbeats.connect(self.rank)
        if self.heartbeats is not None:
            self.heartbeats.publish(step)
        self._thread.start()

    def on_step_end(self, s: StepState) -> None:
        self.last_step, self.last_time = s.step, time.monotonic()

    def on_checkpoint(self, step: int, tag_dir: Path) -> None:
        self.last_time = time.monotonic()  # a save counts as work: the next step starts now

    def _beat(self) -> None:
        if self.heartbeats is not None:
            self.heartbeats.publish(self.last_step)

    def _pause(self, seconds: float) -> None:
        """Sleep, still beating: a rank writing its report is not frozen."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self._beat()
            time.sleep(min(self.poll, max(end - time.monotonic(), 0)))

    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            self._beat()
            idle = time.monotonic() - self.last_time
            alarm = self.heartbeats.alarm() if self.heartbeats is not None else None
            if idle > self.timeout or alarm is not None:
                self._fire(idle, alarm)
                os._exit(HANG_EXIT_CODE)

    def _fire(self, idle: float, alarm: int | None) -> None:
        """Report, have every live peer report, and return (the caller exits)."""
        calls, inside = LAST.calls, not LAST.returned
        hb = self.heartbeats
        missing: dict[int, str] = {}
        if hb is not None and alarm is None:
            hb.raise_alarm()
            first = hb.read()
            wait = 3 * self.poll
            self._pause(wait)
            missing = not_arrived(self.rank, calls, inside, first, hb.read(), hb.error, wait)
        self._report(idle, alarm, calls, missing)
        if hb is not None:
            hb.mark_reported()
            # The first rank waits for every live peer's stacks; the others for its verdict.
            live = (
                [r for r in range(hb.world) if r not in missing or missing[r].startswith(ALIVE)]
                if alarm is None
                else [alarm]
            )
            end = time.monotonic() + 3 * self.poll
            while not hb.reported(live) and time.monotonic() < end:
                self._pause(self.poll / 2)

    def _report(self, idle: float, alarm: int | None, calls: int, missing: dict[int, str]) -> None:
        first = "" if alarm is None or alarm == self.rank else f", rank {alarm}'s watchdog fired"
        msg = (
            f"rank {self.rank}: hang: no training step completed for {idle:.0f}s{first} "
            f"(train.hang_timeout_s {self.timeout:g}; the last "
            f"completed step is {self.last_step}); the stack of every thread is in "
            f"{self.path}; exiting with code {HANG_EXIT_CODE}"
        )
        if missing:
            named = "; ".join(f"rank {r}: {reason}" for r, reason in missing.items())
            arrival = f"did not arrive at collective call {calls}: {named}"
        elif alarm is not None and alarm != self.rank:
            arrival = (
                f"which rank did not arrive: see the report of rank {alarm}, whose "
                f"watchdog fired first ({hang_file(self.path.parent, alarm).name})"
            )
        elif self.heartbeats is None:
            arrival = "which rank did not arrive: unknown (no heartbeats in this run)"
        else:
            arrival = f"did not arrive at collective call {calls}: none found"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:  # an earlier attempt's stacks stay
            f.write(f"{msg}\nin step {self.last_step + 1}, {LAST.describe()}\n{arrival}\n\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
            f.write("\n")
        with self.records.open("a") as f:
            f.write(
                json.dumps(
                    {
                        "rank": self.rank,
                        "step": self.last_step + 1,
                        "collective": LAST.name,
                        "call": calls,
                        "inside": not LAST.returned,
                        "alarm_from": alarm,
                        "missing": {str(r): v for r, v in missing.items()},
                        "stacks": self.path.name,
                        "time": time.time(),
                    }
                )
                + "\n"
            )
        log.error(msg)
        log.error(f"rank {self.rank}: {arrival}")

    def close(self) -> None:
        self._stop.set()
