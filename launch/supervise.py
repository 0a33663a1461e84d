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

from launch.signal_latch import CATCHABLE, HELD_SIGNALS_ENV, LATCH

if __name__ == "__main__":  # a SLURM job's supervisor: hold stop signals before any import
    LATCH.install()

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from launch.interrupts import LauncherSignals, kill_unresponsive, stop_session
from launch.launcher_watch import die_with_parent
from launch.rank import exits_file
from moe.checkpoint.files import find_latest
from moe.core.errors import LaunchError, MoEError
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

    @property
    def cause(self) -> str:
        return f"signal {self.signal}" if self.signal else f"code {self.returncode}"

    def same_as(self, other: Failure | None) -> bool:
        """Same cause at the same step, whichever rank."""
        return (other is not None and (self.returncode, self.signal, self.step)
                == (other.returncode, other.signal, other.step))

    def describe(self) -> str:
        who = f"rank {self.rank}" if self.rank is not None else "a rank (the launcher did not say which)"
        if self.hang:
            return f"{who} hung at step {self.step}: {self.hang}"
        return f"{who} exited with {self.cause} at step {self.step}"


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
    data); the supervisor stops at once and repeats ``cause`` in its last line."""
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

    def __init__(self, run_dir: Path, world_size: int, started: float | None = None,
                 resumed_step: int | None = None):
        self.files = RunDir(run_dir)
        self.logs = self.files.logs
        self.world = world_size
        self.started = time.time() if started is None else started
        # Whether a rank's step records changed in this attempt: by their file's state when the
        # attempt started (a file's mtime comes from a coarse clock that can lag time.time() by
        # milliseconds, so a step written right after the start could look older than it);
        # ``started`` given after the fact (the job script's shell): by mtime.
        self.step_files = (None if started is not None else
                           {r: self._state(self._steps_file(r)) for r in range(world_size)})
        self.offsets = {r: self._size(exits_file(self.logs, r)) for r in range(world_size)}
        self.hang_offsets = {r: self._size(hang_records_file(self.logs, r))
                             for r in range(world_size)}
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
        ends = [e for r in range(self.world)
                for e in _read_jsonl(exits_file(self.logs, r), self.offsets[r])
                if e.get("signal") or e.get("returncode")]
        return sorted(ends, key=lambda e: e["time"])

    def last_step(self, rank: int | None) -> int:
        """The last step ``rank`` (None: every rank) completed in this attempt; the resumed
        checkpoint's step if it completed none."""
        ranks = range(self.world) if rank is None else [rank]
        steps = []
        for r in ranks:
            records = _read_jsonl(self._steps_file(r)) if self._written(r) else []
            steps.append(max((rec["step"] for rec in records if isinstance(rec.get("step"), int)),
                             default=self.resumed_step))
        return min(steps)

    def hang(self) -> Failure | None:
        """The rank the hang watchdogs of this attempt found missing from their collective
        (the lowest, when several), with their verdict."""
        reports = [h for r in range(self.world)
                   for h in _read_jsonl(hang_records_file(self.logs, r), self.hang_offsets[r])]
        named = {int(r): (why, h) for h in reports for r, why in h.get("missing", {}).items()}
        if not named:
            return None
        rank = min(named)
        why, h = named[rank]
        reporters = sorted({h["rank"] for h in reports if str(rank) in h.get("missing", {})})
        return Failure(rank, HANG_EXIT_CODE, None, h["step"],
                       hang=f"{why}; it did not reach {h['collective']} (collective call "
                            f"{h['call']}), reported by the hang watchdog of rank(s) "
                            f"{', '.join(map(str, reporters))}; stacks of the live ranks in "
                            f"{self.logs}/hang_rank*.txt")

    def final_cause(self) -> str | None:
        """The cause a rank recorded for a failure no restart can fix, in this attempt
        (:func:`record_final`); None: every failure may be worth a restart."""
        records = [r for rank in range(self.world)
                   for r in _read_jsonl(final_file(self.logs, rank))
                   if r.get("time", 0) >= self.started]
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
            return Failure(None, launcher_rc, None, self.last_step(None) + 1)
        first = ends[0]
        return Failure(first["rank"], first["returncode"], first["signal"],
                       self.last_step(first["rank"]) + 1)


def run_attempt(command: list[str], env: dict, attempt: Attempt,
                signals: LauncherSignals | None = None,
                started: Callable[[subprocess.Popen], None] | None = None,
                tick: Callable[[], None] | None = None) -> int:
    """Run the launcher once; stop it if it outlives a rank's abnormal end by :data:`GRACE_S`.
    ``signals``: the launcher runs in a session of its own and gets moe-launch's signals
    through them. ``started``: told the launcher's process as soon as it runs (a signal
    forwarder). ``tick``: called at every poll while it runs."""
    # moe-launch's launcher runs in a session of its own: it ends with moe-launch all the same
    # (launch/launcher_watch.py). Only from the main thread: the signal comes when the thread
    # that started the child ends.
    own = signals is not None and threading.current_thread() is threading.main_thread()
    proc = subprocess.Popen(command, env=env, start_new_session=signals is not None,
                            preexec_fn=die_with_parent() if own else None)
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
            print(f"launch: a rank ended abnormally {GRACE_S:g}s ago and the launcher still "
                  f"runs: stopping every rank", flush=True)
            stop_session(proc)
    return proc.wait()


def run_with_restarts(command: list[str], env: dict, run_dir: Path, world_size: int,
                      max_restarts: int, preempted,
                      replan: Callable[[], Relaunch] | None = None,
                      signals: LauncherSignals | None = None,
                      started: Callable[[subprocess.Popen], None] | None = None,
                      tick: Callable[[], None] | None = None) -> int:
    """Run ``command`` until it succeeds, is preempted (``preempted(rc)`` true: returned at
    once) or has failed ``max_restarts + 1`` times (LaunchError). Returns its exit code.
    ``replan``: asked before each restart for the command and world size to restart with
    (LaunchError: no restart). ``signals``: moe-launch's; once one arrived, the exit code is
    returned whatever it is (the caller tells what happened). ``started``, ``tick``: see
    :func:`run_attempt`. A failure a restart cannot fix (a rank's final record: a full or
    read-only disk, a configuration or data error) is not restarted: LaunchError at once,
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
        if final is not None:
            raise LaunchError(f"training failed: {failure.describe()}; not restarted, a restart "
                              f"cannot fix this: {final}")
        if restart == max_restarts:
            raise LaunchError(f"training failed: {failure.describe()}"
                              + (f", after {max_restarts} restart(s) (launch.max_restarts)"
                                 if max_restarts else " (launch.max_restarts: 0)")
                              + f"; per-rank logs in {logs}")
        if failure.same_as(previous):
            raise LaunchError(f"training failed the same way twice in a row: "
                              f"{failure.describe()}, as before restart {restart}/{max_restarts}; "
                              f"not restarting again. Per-rank logs in {logs}")
        relaunch = Relaunch(command, world_size)
        if replan is not None:
            try:
                relaunch = replan()
            except LaunchError as e:
                raise LaunchError(f"training failed: {failure.describe()}; not restarted: {e}. "
                                  f"Per-rank logs in {logs}") from None
        command, world_size = relaunch.command, relaunch.world_size
        restart += 1
        tag = newest_complete(run_dir)
        resume = str(RunDir(run_dir).checkpoints / tag) if tag else None
        print(f"launch: restart {restart}/{max_restarts}: {failure.describe()}; "
              f"resuming from {resume or 'the start (no complete checkpoint yet)'}", flush=True)
        if relaunch.note:
            print(f"launch: {relaunch.note}", flush=True)
        with (logs / RESTARTS_FILE).open("a") as f:
            f.write(json.dumps({"restart": restart, "max_restarts": max_restarts,
                                **asdict(failure), "resume": resume,
                                "failed_after_s": round(time.time() - attempt.started, 3),
                                "time": time.time(), **relaunch.record}) + "\n")
        previous = failure


class SignalForwarder:
    """The supervisor of a SLURM job gets the signals SLURM sends the batch step: the
    time-limit warning (``--signal=B:USR1@N``) and ``scancel --batch`` through the batch shell
    (launch/slurm/script.py), ``--full`` and a cancel directly. Each stop signal is remembered
    and passed on to srun as :data:`~launch.slurm.allocation.SAVE_SIGNAL`, which srun hands to
    every rank (TERM it would turn into SIGKILL). A signal before srun runs is held: the
    supervisor then starts no rank at all."""

    def __init__(self, save_signal: int, held: list[int] = ()):
        self.save_signal = save_signal
        self.received: list[int] = list(held)
        self.proc: subprocess.Popen | None = None

    def install(self, signals) -> None:
        for signum in signals:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received.append(signum)
        self._forward()

    def _forward(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.send_signal(self.save_signal)
            except ProcessLookupError:
                pass

    def started(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        if self.received:  # arrived while srun was being started
            self._forward()

    @property
    def first(self) -> str | None:
        return signal.Signals(self.received[0]).name if self.received else None


def run_slurm_job(config_path: Path, evaluate: bool, held: list[int]) -> int:
    """Everything a SLURM job does inside its allocation: build DeepSpeed's op, run the ranks
    with srun under the restart policy of :func:`run_with_restarts`, requeue after a preemption
    (or after any stop signal), evaluate the finished run on one task. Returns the job's exit
    code; its last line says why it ended. ``held``: the stop signals that reached the job
    before this process could act on them (the job script's and the latch's)."""
    from launch.slurm.allocation import SAVE_SIGNAL, Allocation, build_ops
    from moe.config.run import load_config
    from moe.training.resilience.preemption import was_preempted

    forwarder = SignalForwarder(SAVE_SIGNAL, held)
    forwarder.install(CATCHABLE)
    cfg = load_config(config_path)
    job = Allocation.from_environment(cfg, config_path)
    run_dir, marker = job.run_dir, RunDir(job.run_dir).preempted
    marker.unlink(missing_ok=True)
    RunDir(run_dir).logs.mkdir(exist_ok=True)
    attempt = 0
    env = job.env(attempt)
    print(job.header(attempt), flush=True)
    checked = 0

    def tick() -> None:
        """Once per new stop signal, while srun or the build runs: when it is SLURM ending the
        job (a cancel, the time limit), the end is recorded and said at once; SLURM kills this
        process after KillWait, which ranks still starting up outlast."""
        nonlocal checked
        if len(forwarder.received) > checked and not job.ended:
            checked = len(forwarder.received)
            state = job.ended_state()
            if state is not None:
                ended_by_slurm(job, state, 128 + forwarder.received[0],
                               note="the ranks save if SLURM's KillWait leaves them time")

    if not forwarder.received:
        build_ops(env, tick=tick)

    def preempted(rc: int) -> bool:
        return was_preempted(rc, run_dir) or bool(forwarder.received)

    def replan() -> Relaunch:
        nonlocal attempt
        attempt += 1
        env.update(job.env(attempt))
        return Relaunch(job.srun(), cfg.parallel.world_size, note=job.header(attempt))

    rc = None
    if not forwarder.received:
        try:
            rc = run_with_restarts(job.srun(), env, run_dir, cfg.parallel.world_size,
                                   cfg.launch.max_restarts, preempted, replan,
                                   started=forwarder.started, tick=tick)
        except LaunchError as e:
            job.record_end(1)
            print(f"error: {e}", flush=True)
            return 1
    # srun can exit 0 when SLURM cancels its step: a job SLURM is ending has not finished.
    ending = job.ended or bool(forwarder.received and job.ended_state())
    if rc == 0 and not marker.exists() and not ending:
        print("training finished; " + ("evaluating the final checkpoint on one task"
                                       if evaluate else "evaluation skipped (--no-eval)"),
              flush=True)
        status = subprocess.run(job.finish(evaluate), env=env).returncode
        job.record_end(status)
        return status
    return stopped(job, marker, rc, forwarder.first)


def stopped(job, marker: Path, rc: int | None, signal_name: str | None) -> int:
    """A preemption (the ranks saved and exited 75, or had nothing to save yet), or a stop
    signal the ranks could not act on: requeue the job, or end it cleanly when
    ``launch.slurm.requeue`` is off. Never a restart: nothing failed."""
    from moe.training.resilience.preemption import PREEMPTED_EXIT_CODE

    try:
        saved = json.loads(marker.read_text()) if marker.exists() else None
    except ValueError:  # cut short: the ranks saved, the step it names is lost
        saved = {}
    step = saved.get("step") if saved else None
    if step is None:
        tag = newest_complete(job.run_dir)
        step = int(tag.rsplit("_", 1)[1]) if tag else 0
    if rc is None:
        print(f"{signal_name} before srun started: no rank ran, nothing to save", flush=True)
    elif saved is not None:
        # srun reports the ranks' planned exit as "Exited with exit code 75" (and the others it
        # then stopped with 143); say what it means.
        print(f"preemption signal ({marker.read_text().strip()}): the exit code 75 above is the "
              f"planned exit of a preempted run, not a failure", flush=True)
    elif saved is None:
        print(f"stopped by {signal_name or 'a signal'} before the ranks could save (srun exited "
              f"with status {rc}): not a training failure, not restarted", flush=True)
    ended = job.ended_state()
    if ended is not None:  # the signal was SLURM ending the job: a cancel or the time limit
        ended_by_slurm(job, ended, rc if rc is not None else PREEMPTED_EXIT_CODE, step)
        return rc if rc else PREEMPTED_EXIT_CODE
    if job.cfg.launch.slurm.requeue:
        # Said before asking: the requeue ends this batch step, this process included.
        job.record_end(rc if rc is not None else PREEMPTED_EXIT_CODE, step)
        print(f"preempted, requeued, will resume from step {step} (requeueing job "
              f"{job.job_id})", flush=True)
        if job.requeue():
            return 0
        job.record_end(PREEMPTED_EXIT_CODE)  # a cancelled or timed-out job cannot requeue
        print(f"not requeued after all: submit the same run again to resume from step {step}",
              flush=True)
        return PREEMPTED_EXIT_CODE
    job.record_end(PREEMPTED_EXIT_CODE)
    print(f"preempted, not requeued (launch.slurm.requeue: false): submit the same run again to "
          f"resume from step {step}", flush=True)
    return PREEMPTED_EXIT_CODE


def ended_by_slurm(job, state: str, status: int, step: int | None = None,
                   note: str = "") -> None:
    """The job's last line and its record in ``slurm_job_ends.txt`` when SLURM itself ends the
    job (``state``: CANCELLED, TIMEOUT, ...): recorded once per run of the job, as soon as it
    is known, and said again with the final step if SLURM lets the supervisor see srun end.
    ``step``: where a resubmission resumes (None: the newest complete checkpoint); ``note``:
    what may still happen before SLURM kills the job."""
    if not job.ended:
        job.record_end(status)
    if step is None:
        tag = newest_complete(job.run_dir)
        step = int(tag.rsplit("_", 1)[1]) if tag else 0
    # COMPLETING: SLURM ends the job's steps, and does not say yet whether it cancels the job
    # or its time ran out.
    what = (state if state != "COMPLETING" else
            "COMPLETING (SLURM is ending it: a cancel, or the time limit)")
    print(f"job {job.job_id} is {what}: not requeued, not restarted; submit the same run "
          f"again to resume from step {step}" + (f" ({note})" if note else ""), flush=True)


def held_by_the_job_script() -> list[int]:
    """The stop signals the job script's shell recorded (launch/slurm/script.py) before this
    process could take them, read once this process catches them itself: one that came later
    the shell passes on as a signal."""
    path = os.environ.pop(HELD_SIGNALS_ENV, None)
    if not path:
        return []
    try:
        names = Path(path).read_text().split()
    except OSError:
        return []
    return [getattr(signal, f"SIG{name}") for name in names if hasattr(signal, f"SIG{name}")]


def main(argv: list[str]) -> None:
    """``python -m launch.supervise slurm CONFIG [--no-eval]``: the supervisor a SLURM job
    script starts (launch/slurm/script.py).

    ``python -m launch.supervise RUN_DIR WORLD_SIZE STARTED RESUMED_STEP``: print the step a
    failed attempt (started at epoch second STARTED, resumed from step RESUMED_STEP) was in (what
    job scripts of earlier versions ask after a failed srun step)."""
    if argv[:1] == ["slurm"]:
        config, evaluate = Path(argv[1]), "--no-eval" not in argv[2:]
        held = held_by_the_job_script() + ([LATCH.first] if LATCH.first else [])
        try:
            sys.exit(run_slurm_job(config, evaluate, held))
        except MoEError as e:
            print(f"error: {e}", flush=True)
            sys.exit(2)
    run_dir, world, started, resumed = argv
    # Whole seconds from the shell: a record written in the attempt's first second counts.
    attempt = Attempt(Path(run_dir), int(world), float(started) - 1, int(resumed))
    print(attempt.last_step(None) + 1)


if __name__ == "__main__":
    main(sys.argv[1:])
