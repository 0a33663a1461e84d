"""Automatic restart of a local, hostfile or mpi launch (``launch.max_restarts``).

moe-launch runs the plan's command (a launcher that starts every rank) and waits. When a rank
exits abnormally, the other ranks are stopped: DeepSpeed's per-node launcher terminates its own
ranks within about a second of seeing one fail, and ranks on other nodes, which it does not know
about, are stopped here: once a rank's end is recorded (launch/rank.py) and the launcher has not
ended within :data:`GRACE_S`, its whole process tree is terminated (DeepSpeed's multi-node runner
then kills the remote ranks through pdsh). Then every rank starts again with the same command,
which resumes from the newest complete checkpoint (``--resume auto``), up to
``launch.max_restarts`` times. A training process that does not end within
:data:`launch.interrupts.KILL_AFTER_S` of a rank's abnormal end (it ignores SIGTERM) is killed,
a stopped one (SIGSTOP) at once. When hang watchdogs reported (exit 70), the failure names the
rank they found missing from the collective, not the healthy rank whose watchdog fired.
Signals to moe-launch (launch/interrupts.py) are acted on here, and end the run without a
restart. Each restart is printed and appended to
``RUN_DIR/logs/restarts.jsonl``. The same failure (exit code or signal, whichever rank) at the
same step twice in a row is not restarted again: it will most likely happen a third time.

Nothing a run wrote is lost on a restart: rank logs, hang stacks and exit records are appended
to, TensorBoard starts a new event file, the step records keep every step before the resumed
checkpoint and the resumed run writes the steps after it again.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from launch.interrupts import LauncherSignals, kill_unresponsive, stop_session
from launch.launcher_watch import die_with_parent
from launch.rank import exits_file
from moe.checkpoint.files import find_latest
from moe.core.errors import LaunchError
from moe.core.run_dir import RunDir
from moe.training.resilience.watchdog import HANG_EXIT_CODE, hang_records_file

RESTARTS_FILE = "restarts.jsonl"
GRACE_S = 10.0
"""After a rank's abnormal end, how long the launcher may take to stop the others itself."""
POLL_S = 0.5


@dataclass
class Failure:
    rank: int | None
    """None: no rank recorded its end (a launcher without launch/rank.py, or the launcher
    itself failed)."""
    returncode: int | None
    signal: str | None
    step: int
    """The step the rank was in: one after the last step it completed in this attempt."""
    hang: str | None = None
    """The hang watchdogs' verdict on ``rank``, which did not reach their collective."""
    starting: bool = False
    """The rank (every rank, when ``rank`` is None) completed no step in this attempt: it
    failed while it started (imports, the engine, the checkpoint, the data) or in its first
    step."""

    @property
    def cause(self) -> str:
        return f"signal {self.signal}" if self.signal else f"code {self.returncode}"

    def same_as(self, other: Failure | None) -> bool:
        """Same cause at the same step, whichever rank."""
        return other is not None and (self.returncode, self.signal, self.step) == (
            other.returncode,
            other.signal,
            other.step,
        )

    def describe(self) -> str:
        who = (
            f"rank {self.rank}"
            if self.rank is not None
            else "a rank (the launcher did not say which)"
        )
        where = (
            f"before completing a step (starting, or in step {self.step})"
            if self.starting
            else f"at step {self.step}"
        )
        if self.hang:
            return f"{who} hung {where}: {self.hang}"
        return f"{who} exited with {self.cause} {where}"


@dataclass
class Relaunch:
    """What the next attempt runs, when it may differ from the first (launch/elastic.py)."""

    command: list[str]
    world_size: int
    note: str | None = None
    """Printed after the restart line: why the layout changed."""
    record: dict = field(default_factory=dict)
    """Added to the restart's line in restarts.jsonl."""


def final_file(logs_dir: Path, rank: int) -> Path:
    return Path(logs_dir) / f"final_rank{rank}.jsonl"


def record_final(logs_dir: Path, rank: int, kind: str, cause: str) -> None:
    """A rank's word that it failed in a way no restart fixes (``kind``: storage, configuration,
    checkpoint, data); the supervisor stops at once and repeats ``cause`` in its last line."""
    line = json.dumps({"rank": rank, "kind": kind, "cause": cause, "time": time.time()})
    try:
        with final_file(logs_dir, rank).open("a") as f:
            f.write(line + "\n")
    except OSError:
        pass  # a full disk may refuse even this line: the failure is then restarted once more


def newest_complete(run_dir: Path) -> str | None:
    """The tag of the checkpoint a restart resumes from (``--resume auto``)."""
    ckpt_dir = RunDir(run_dir).checkpoints
    return find_latest(ckpt_dir) if ckpt_dir.is_dir() else None


def _read_jsonl(path: Path, offset: int = 0) -> list[dict]:
    """The complete JSON lines of ``path`` from byte ``offset`` (a line cut short is skipped)."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return []
    out = []
    for line in data.decode(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


class Attempt:
    """One run of the launcher: the exit records and step records it adds."""

    def __init__(
        self,
        run_dir: Path,
        world_size: int,
        started: float | None = None,
        resumed_step: int | None = None,
    ):
        self.files = RunDir(run_dir)
        self.logs = self.files.logs
        self.world = world_size
        self.started = time.time() if started is None else started
        # Whether a rank's step records changed in this attempt: by their file's state when the
        # attempt started (a file's mtime comes from a coarse clock that can lag time.time() by
        # milliseconds, so a step written right after the start could look older than it);
        # ``started`` given after the fact (the job script's shell): by mtime.
        self.step_files = (
            None
            if started is not None
            else {r: self._state(self._steps_file(r)) for r in range(world_size)}
        )
        self.offsets = {r: self._size(exits_file(self.logs, r)) for r in range(world_size)}
        self.hang_offsets = {
            r: self._size(hang_records_file(self.logs, r)) for r in range(world_size)
        }
        if resumed_step is None:
            tag = newest_complete(run_dir)
            resumed_step = int(tag.rsplit("_", 1)[1]) if tag else 0
        self.resumed_step = resumed_step

    @staticmethod
    def _size(path: Path) -> int:
        return path.stat().st_size if path.exists() else 0

    @staticmethod
    def _state(path: Path) -> tuple | None:
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    def _steps_file(self, rank: int) -> Path:
        return self.files.step_records(rank)

    def _written(self, rank: int) -> bool:
        path = self._steps_file(rank)
        if self.step_files is not None:
            return self._state(path) not in (None, self.step_files[rank])
        return path.exists() and path.stat().st_mtime >= self.started

    def abnormal_ends(self) -> list[dict]:
        """The ranks that ended this attempt with a nonzero code or a signal, earliest first."""
        ends = [
            e
            for r in range(self.world)
            for e in _read_jsonl(exits_file(self.logs, r), self.offsets[r])
            if e.get("signal") or e.get("returncode")
        ]
        return sorted(ends, key=lambda e: e["time"])

    def _completed(self, rank: int) -> list[int]:
        """The steps ``rank`` recorded in this attempt."""
        records = _read_jsonl(self._steps_file(rank)) if self._written(rank) else []
        return [rec["step"] for rec in records if isinstance(rec.get("step"), int)]

    def last_step(self, rank: int | None) -> int:
        """The last step ``rank`` (None: every rank) completed in this attempt; the resumed
        checkpoint's step if it completed none."""
        ranks = range(self.world) if rank is None else [rank]
        return min(max(self._completed(r), default=self.resumed_step) for r in ranks)

    def starting(self, rank: int | None) -> bool:
        """``rank`` (None: every rank) completed no step in this attempt."""
        ranks = range(self.world) if rank is None else [rank]
        return not any(self._completed(r) for r in ranks)

    def hang(self) -> Failure | None:
        """The rank the hang watchdogs of this attempt found missing from their collective
        (the lowest, when several), with their verdict."""
        reports = [
            h
            for r in range(self.world)
            for h in _read_jsonl(hang_records_file(self.logs, r), self.hang_offsets[r])
        ]
        named = {int(r): (why, h) for h in reports for r, why in h.get("missing", {}).items()}
        if not named:
            return None
        rank = min(named)
        why, h = named[rank]
        reporters = sorted({h["rank"] for h in reports if str(rank) in h.get("missing", {})})
        return Failure(
            rank,
            HANG_EXIT_CODE,
            None,
            h["step"],
            hang=f"{why}; it did not reach {h['collective']} (collective call "
            f"{h['call']}), reported by the hang watchdog of rank(s) "
            f"{', '.join(map(str, reporters))}; stacks of the live ranks in "
            f"{self.logs}/hang_rank*.txt",
        )

    def final_cause(self) -> str | None:
        """The cause a rank recorded for a failure no restart can fix, in this attempt
        (:func:`record_final`); None: every failure may be worth a restart."""
        records = [
            r
            for rank in range(self.world)
            for r in _read_jsonl(final_file(self.logs, rank))
            if r.get("time", 0) >= self.started
        ]
        if not records:
            return None
        first = min(records, key=lambda r: r["time"])
        return f"{first['kind']} on rank {first['rank']}: {first['cause']}"

    def failure(self, launcher_rc: int) -> Failure:
        ends = self.abnormal_ends()
        hang = self.hang()
        if hang is not None and ends and ends[0]["returncode"] == HANG_EXIT_CODE:
            return hang
        if not ends:
            return Failure(
                None, launcher_rc, None, self.last_step(None) + 1, starting=self.starting(None)
            )
        first = ends[0]
        return Failure(
            first["rank"],
            first["returncode"],
            first["signal"],
            self.last_step(first["rank"]) + 1,
            starting=self.starting(first["rank"]),
        )


def run_attempt(
    command: list[str],
    env: dict,
    attempt: Attempt,
    signals: LauncherSignals | None = None,
    started: Callable[[subprocess.Popen], None] | None = None,
    tick: Callable[[], None] | None = None,
) -> int:
    """Run the launcher once; stop it if it outlives a rank's abnormal end by :data:`GRACE_S`.
    ``signals``: the launcher runs in a session of its own and gets moe-launch's signals
    through them. ``started``: told the launcher's process as soon as it runs (a signal
    forwarder). ``tick``: called at every poll while it runs."""
    # moe-launch's launcher runs in a session of its own: it ends with moe-launch all the same
    # (launch/launcher_watch.py). Only from the main thread: the signal comes when the thread
    # that started the child ends.
    own = signals is not None and threading.current_thread() is threading.main_thread()
    proc = subprocess.Popen(
        command,
        env=env,
        start_new_session=signals is not None,
        preexec_fn=die_with_parent() if own else None,
    )
    if started is not None:
        started(proc)
    seen = None
    while proc.poll() is None:
        if signals is None:
            time.sleep(POLL_S)
        else:
            signals.wait(POLL_S)  # returns at once on a signal to moe-launch
            signals.deliver(proc)
            if signals.forced is not None:
                stop_session(proc)
                break
        if tick is not None:
            tick()
        if seen is None and attempt.abnormal_ends():
            seen = time.monotonic()
        if seen is not None:
            for line in kill_unresponsive(proc, time.monotonic() - seen):
                print(line, flush=True)
        if seen is not None and time.monotonic() - seen > GRACE_S and proc.poll() is None:
            print(
                f"launch: a rank ended abnormally {GRACE_S:g}s ago and the launcher still "
                f"runs: stopping every rank",
                flush=True,
            )
            stop_session(proc)
    return proc.wait()


def run_with_restarts(
    command: list[str],
    env: dict,
    run_dir: Path,
    world_size: int,
    max_restarts: int,
    preempted,
    replan: Callable[[], Relaunch] | None = None,
    signals: LauncherSignals | None = None,
    started: Callable[[subprocess.Popen], None] | None = None,
    tick: Callable[[], None] | None = None,
) -> int:
    """Run ``command`` until it succeeds, is preempted (``preempted(rc)`` true: returned at
    once) or has failed ``max_restarts + 1`` times (LaunchError). Returns its exit code.
    ``replan``: asked before each restart for the command and world size to restart with
    (LaunchError: no restart). ``signals``: moe-launch's; once one arrived, the exit code is
    returned whatever it is (the caller tells what happened). ``started``, ``tick``: see
    :func:`run_attempt`. A failure a restart cannot fix (a rank's final record: a full or
    read-only disk, a configuration, checkpoint or data error) is not restarted: LaunchError at once,
    naming the cause."""
    previous: Failure | None = None
    restart = 0
    while True:
        attempt = Attempt(run_dir, world_size)
        rc = run_attempt(command, env, attempt, signals, started, tick)
        if rc == 0 or preempted(rc) or (signals is not None and signals.received is not None):
            return rc
        failure = attempt.failure(rc)
        logs = RunDir(run_dir).logs
        final = attempt.final_cause()
        refusal = restart_refusal(failure, previous, final, restart, max_restarts, logs)
        if refusal is not None:
            raise LaunchError(refusal)
        relaunch = Relaunch(command, world_size)
        if replan is not None:
            try:
                relaunch = replan()
            except LaunchError as e:
                raise LaunchError(
                    f"training failed: {failure.describe()}; not restarted: {e}. "
                    f"Per-rank logs in {logs}"
                ) from None
        command, world_size = relaunch.command, relaunch.world_size
        restart += 1
        record_restart(run_dir, restart, max_restarts, failure, attempt, relaunch)
        previous = failure


def restart_refusal(
    failure: Failure,
    previous: Failure | None,
    final: str | None,
    restart: int,
    max_restarts: int,
    logs: Path,
) -> str | None:
    """Why ``failure`` is not restarted (None: it is): a cause no restart can fix (a rank's
    final record), no restart left, or the same failure as the one before. ``logs``: the
    per-rank logs the message points to."""
    if final is not None:
        return (
            f"training failed: {failure.describe()}; not restarted, a restart "
            f"cannot fix this: {final}"
        )
    if restart == max_restarts:
        return (
            f"training failed: {failure.describe()}"
            + (
                f", after {max_restarts} restart(s) (launch.max_restarts)"
                if max_restarts
                else " (launch.max_restarts: 0)"
            )
            + f"; per-rank logs in {logs}"
        )
    if failure.same_as(previous):
        return (
            f"training failed the same way twice in a row: "
            f"{failure.describe()}, as before restart {restart}/{max_restarts}; "
            f"not restarting again. Per-rank logs in {logs}"
        )
    return None


def record_restart(
    run_dir: Path,
    restart: int,
    max_restarts: int,
    failure: Failure,
    attempt: Attempt,
    relaunch: Relaunch,
) -> None:
    """Say the restart (and where it resumes from) and append it to ``logs/restarts.jsonl``."""
    tag = newest_complete(run_dir)
    resume = str(RunDir(run_dir).checkpoints / tag) if tag else None
    print(
        f"launch: restart {restart}/{max_restarts}: {failure.describe()}; "
        f"resuming from {resume or 'the start (no complete checkpoint yet)'}",
        flush=True,
    )
    if relaunch.note:
        print(f"launch: {relaunch.note}", flush=True)
    record = {
        "restart": restart,
        "max_restarts": max_restarts,
        **asdict(failure),
        "resume": resume,
        "failed_after_s": round(time.time() - attempt.started, 3),
        "time": time.time(),
        **relaunch.record,
    }
    with (RunDir(run_dir).logs / RESTARTS_FILE).open("a") as f:
        f.write(json.dumps(record) + "\n")
