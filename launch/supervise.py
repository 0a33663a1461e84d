"""The supervisor of a SLURM job inside its allocation (``python -m launch.supervise slurm
CONFIG``, started by the job script of launch/slurm/script.py): it holds the job's stop signals
from its first line, runs the ranks with srun under the restart policy of launch/restarts.py,
passes stop signals on to the ranks, requeues the job after a preemption and evaluates the
finished run on one task.
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
from collections.abc import Callable
from pathlib import Path

from launch.restarts import Attempt, Relaunch, newest_complete, run_with_restarts
from moe.core.errors import LaunchError, MoEError
from moe.core.run_dir import RunDir


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
    tick = slurm_end_watch(job, forwarder)
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
            rc = run_with_restarts(
                job.srun(),
                env,
                run_dir,
                cfg.parallel.world_size,
                cfg.launch.max_restarts,
                preempted,
                replan,
                started=forwarder.started,
                tick=tick,
            )
        except LaunchError as e:
            job.record_end(1)
            print(f"error: {e}", flush=True)
            return 1
    # srun can exit 0 when SLURM cancels its step: a job SLURM is ending has not finished.
    ending = job.ended or bool(forwarder.received and job.ended_state())
    if rc == 0 and not marker.exists() and not ending:
        return finish_job(job, env, evaluate)
    return stopped(job, marker, rc, forwarder.first)


def slurm_end_watch(job, forwarder: SignalForwarder) -> Callable[[], None]:
    """The ``tick`` of the build and of srun: once per new stop signal, when it is SLURM ending
    the job (a cancel, the time limit), the end is recorded and said at once; SLURM kills this
    process after KillWait, which ranks still starting up outlast."""
    checked = 0

    def tick() -> None:
        nonlocal checked
        if len(forwarder.received) > checked and not job.ended:
            checked = len(forwarder.received)
            state = job.ended_state()
            if state is not None:
                ended_by_slurm(
                    job,
                    state,
                    128 + forwarder.received[0],
                    note="the ranks save if SLURM's KillWait leaves them time",
                )

    return tick


def finish_job(job, env: dict, evaluate: bool) -> int:
    """Training finished: evaluate the final checkpoint on one task (unless ``--no-eval``) and
    record the job's end; its exit code."""
    what = (
        "evaluating the final checkpoint on one task"
        if evaluate
        else "evaluation skipped (--no-eval)"
    )
    print("training finished; " + what, flush=True)
    status = subprocess.run(job.finish(evaluate), env=env).returncode
    job.record_end(status)
    return status


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
        print(
            f"preemption signal ({marker.read_text().strip()}): the exit code 75 above is the "
            f"planned exit of a preempted run, not a failure",
            flush=True,
        )
    elif saved is None:
        print(
            f"stopped by {signal_name or 'a signal'} before the ranks could save (srun exited "
            f"with status {rc}): not a training failure, not restarted",
            flush=True,
        )
    ended = job.ended_state()
    if ended is not None:  # the signal was SLURM ending the job: a cancel or the time limit
        ended_by_slurm(job, ended, rc if rc is not None else PREEMPTED_EXIT_CODE, step)
        return rc if rc else PREEMPTED_EXIT_CODE
    if job.cfg.launch.slurm.requeue:
        # Said before asking: the requeue ends this batch step, this process included.
        job.record_end(rc if rc is not None else PREEMPTED_EXIT_CODE, step)
        print(
            f"preempted, requeued, will resume from step {step} (requeueing job {job.job_id})",
            flush=True,
        )
        if job.requeue():
            return 0
        job.record_end(PREEMPTED_EXIT_CODE)  # a cancelled or timed-out job cannot requeue
        print(
            f"not requeued after all: submit the same run again to resume from step {step}",
            flush=True,
        )
        return PREEMPTED_EXIT_CODE
    job.record_end(PREEMPTED_EXIT_CODE)
    print(
        f"preempted, not requeued (launch.slurm.requeue: false): submit the same run again to "
        f"resume from step {step}",
        flush=True,
    )
    return PREEMPTED_EXIT_CODE


def ended_by_slurm(job, state: str, status: int, step: int | None = None, note: str = "") -> None:
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
    what = (
        state
        if state != "COMPLETING"
        else "COMPLETING (SLURM is ending it: a cancel, or the time limit)"
    )
    print(
        f"job {job.job_id} is {what}: not requeued, not restarted; submit the same run "
        f"again to resume from step {step}" + (f" ({note})" if note else ""),
        flush=True,
    )


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
