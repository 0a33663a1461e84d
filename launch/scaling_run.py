"""``moe-scaling run``: train every unfinished run of a sweep, through ``moe-launch`` here
(``--jobs`` at a time) or as SLURM jobs, with one progress line over the sweep."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from launch import run_lock, scaling_sweep
from launch.slurm import sweep as slurm_sweep
from launch.slurm.jobs import newest_job
from moe.core.errors import ScalingError
from moe.tools import scaling

STOP_GRACE_S = 120
"""After a TERM or INT, launches still running this long (saving takes seconds) are killed."""

LOCK_FILE = "run.lock"
"""In the sweep directory: locked while a ``moe-scaling run`` of the sweep, or a launch it
started, is alive (each launch inherits the lock), and naming their process ids."""


class SweepLock:
    """The sweep's :data:`LOCK_FILE`, held by this process and every launch it starts: a
    ``moe-scaling run`` killed with SIGKILL leaves its launches training, and a second ``run``
    of the sweep would train the same runs into the same directories beside them."""

    def __init__(self, sweep_dir: Path):
        self.path = sweep_dir / LOCK_FILE
        self.fd = run_lock.take(self.path)
        if self.fd is None:
            raise ScalingError(
                f"{sweep_dir} is being run: {self._read() or 'a process'} still hold(s) "
                f"{self.path} (another moe-scaling run of the sweep, or the launches of one "
                "that was killed: they train on until their runs end). Wait for them, or stop "
                "them, then run again"
            )
        self.launches: dict[str, int] = {}
        self._write()

    def _read(self) -> str:
        try:
            held = json.loads(self.path.read_text())
            pids = {"moe-scaling run": held["pid"], **held["launches"]}
        except (OSError, ValueError, KeyError, TypeError):
            return ""
        return ", ".join(f"{name} (pid {pid})" for name, pid in pids.items())

    def _write(self) -> None:
        run_lock.record(self.fd, {"pid": os.getpid(), "launches": self.launches})

    def started(self, name: str, pid: int) -> None:
        self.launches[name] = pid
        self._write()

    def ended(self, name: str) -> None:
        self.launches.pop(name, None)
        self._write()

    def close(self) -> None:
        os.close(self.fd)  # the launches still running keep the lock


class Progress:
    """One line over the sweep: runs done, compute done (FLOPs) and the ETA at the rate so far.
    On a terminal a bar redrawn in place; elsewhere (a log, a pipe) the same line, printed each
    time its note or the runs done change."""

    def __init__(self, total: float, done_flops: float, done: int, count: int):
        from tqdm import tqdm

        self.tty = sys.stdout.isatty()
        self.sink = None if self.tty else open(os.devnull, "w")
        # smoothing=0: the rate (and the ETA) is the compute done since the start over the time
        # since then. tqdm's default averages the rates between updates, and a finished run
        # adds all its FLOPs in one update half a second after the last: a rate hundreds of
        # times too high and an ETA of seconds with minutes to go.
        self.bar = tqdm(
            total=total,
            initial=done_flops,
            unit="FLOP",
            unit_scale=True,
            desc="sweep",
            smoothing=0,
            file=sys.stdout if self.tty else self.sink,
        )
        self.count, self.shown = count, None

    def update(self, flops: float, done: int, note: str = "") -> None:
        self.bar.update(max(0.0, flops - self.bar.n))
        text = f"runs {done}/{self.count}" + (f", {note}" if note else "")
        self.bar.set_postfix_str(text, refresh=self.tty)
        if not self.tty and text != self.shown:
            print(str(self.bar), flush=True)
        self.shown = text

    def close(self) -> None:
        self.bar.close()
        if self.sink is not None:
            self.sink.close()


def _failed(sweep_dir: Path, scheduler: str, failed: list[str]) -> ScalingError:
    return ScalingError(
        f"{len(failed)} run(s) failed: " + ", ".join(failed) + "; the rest finished. Run "
        f"`moe-scaling run {shlex.quote(str(sweep_dir))} --scheduler {scheduler}` again to retry "
        "them (they resume from their checkpoints)"
    )


def configured_scheduler(sweep_dir: Path, runs: list[scaling.PlannedRun]) -> str:
    """slurm when the sweep's run configs say ``launch.scheduler: slurm``, else local."""
    path = sweep_dir / "configs" / f"{runs[0].name}.yaml"
    try:
        d = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ScalingError(f"{path}: unreadable ({e})") from None
    return "slurm" if (d.get("launch") or {}).get("scheduler") == "slurm" else "local"


def run(args) -> None:
    sweep_dir = Path(args.sweep)
    _, runs = scaling_sweep.load_sweep(sweep_dir)
    scheduler = args.scheduler or configured_scheduler(sweep_dir, runs)
    if scheduler == "slurm":
        return run_slurm(args, sweep_dir, runs)
    if args.no_wait or args.dry_run:
        raise ScalingError("--no-wait and --dry-run go with --scheduler slurm")
    lock = SweepLock(sweep_dir)
    try:
        _run_local(args, sweep_dir, runs, lock)
    finally:
        lock.close()


def _run_local(args, sweep_dir: Path, runs: list[scaling.PlannedRun], lock: SweepLock) -> None:
    todo = [r for r in runs if scaling_sweep.finished(sweep_dir, r) is None]
    busy = [
        f"{r.name} (job {job.job_id}, {job.state})"
        for r in todo
        if (job := newest_job(sweep_dir / "runs" / r.name)) is not None and job.active
    ]
    if busy:
        raise ScalingError(
            f"{len(busy)} run(s) of {sweep_dir} have a SLURM job queued or running: "
            + ", ".join(busy)
            + "; running them here too would train into the "
            "same directories (wait for them: moe-scaling run "
            f"{shlex.quote(str(sweep_dir))} --scheduler slurm)"
        )
    done_flops = sum(r.flops for r in runs if r not in todo)
    total = sum(r.flops for r in runs)
    print(
        f"{len(runs) - len(todo)} of {len(runs)} runs finished; {len(todo)} to run, "
        f"{args.jobs} at a time (logs in {sweep_dir / 'logs'})"
    )
    flags = ["--scheduler", "local"] if args.scheduler == "local" else []
    failed = _run_all(
        sweep_dir,
        todo,
        args.jobs,
        done_flops,
        total,
        len(runs) - len(todo),
        len(runs),
        flags,
        lock,
    )
    if failed:
        raise _failed(
            sweep_dir,
            "local",
            [
                f"{name} (exit {rc}, log {sweep_dir / 'logs' / (name + '.log')})"
                for name, rc in failed
            ],
        )
    print(f"every run finished; next: moe-scaling fit {sweep_dir}")


def run_slurm(args, sweep_dir: Path, runs: list[scaling.PlannedRun]) -> None:
    """Submit every run that is neither finished nor queued as a SLURM job, at most
    ``--jobs`` running at once (launch/slurm/sweep.py), then wait for them with one progress
    line."""
    by_name = {r.name: r for r in runs}
    members = [
        slurm_sweep.Member(
            r.name,
            sweep_dir / "configs" / f"{r.name}.yaml",
            (sweep_dir / "runs" / r.name).absolute(),
            r.flops,
            r.steps,
        )
        for r in runs
    ]

    def is_finished(m: slurm_sweep.Member) -> bool:
        return scaling_sweep.finished(sweep_dir, by_name[m.name]) is not None

    sweep = slurm_sweep.survey(members, is_finished)
    slurm_sweep.plan_jobs(members, sweep, args.jobs)
    if args.dry_run:
        print(sweep.render())
        return
    lock = SweepLock(sweep_dir)  # refused while a local launch of the sweep is training
    try:
        ids = slurm_sweep.submit(sweep) if sweep.jobs else []
    finally:
        lock.close()
    q = shlex.quote
    print("\n".join(submitted_lines(args, sweep_dir, runs, sweep, ids)), flush=True)
    if args.no_wait:
        print(
            f"not waiting (--no-wait); moe-scaling run {q(str(sweep_dir))} --scheduler slurm "
            "waits for them (and submits nothing twice)"
        )
        return
    progress = Progress(
        sum(r.flops for r in runs),
        sum(m.flops for m in sweep.finished),
        len(sweep.finished),
        len(runs),
    )
    try:
        outcome = slurm_sweep.wait(members, is_finished, progress.update)
    finally:
        progress.close()
    if outcome.stopped is not None:
        raise ScalingError(
            f"stopped waiting on signal {outcome.stopped}; the sweep's jobs go on "
            f"in SLURM: moe-scaling run {q(str(sweep_dir))} --scheduler slurm "
            f"waits for them again (nothing is submitted twice), scancel stops "
            f"them"
        )
    if outcome.failed:
        raise _failed(
            sweep_dir,
            "slurm",
            [
                f"{m.name} (job {job.job_id} {job.summary()}, log {slurm_sweep.log_of(m, job)})"
                for m, job in outcome.failed
            ],
        )
    print(f"every run finished; next: moe-scaling fit {q(str(sweep_dir))}")


def submitted_lines(args, sweep_dir: Path, runs: list, sweep, ids: list[str]) -> list[str]:
    """What was submitted, what was queued before, and how to watch the jobs."""
    q = shlex.quote
    lines = [
        f"{len(sweep.finished)} of {len(runs)} runs finished; {len(sweep.active)} with a "
        f"SLURM job queued or running (not submitted again); {len(ids)} submitted, at most "
        f"{args.jobs} running at once (each waits for the job before it in its chain)"
    ]
    lines += [
        f"  {job.member.name}: job {i}"
        + (f" after {job.waits_for(ids)}" if job.waits_for(ids) else "")
        for job, i in zip(sweep.jobs, ids)
    ]
    lines += [
        f"  {name}: job {job.job_id} ({job.state}, submitted before)"
        for name, job in sweep.active.items()
    ]
    jobs = ",".join([*ids, *(j.job_id for j in sweep.active.values())])
    if jobs:
        lines += [
            f"watch   squeue -j {jobs}",
            f"a run   moe-launch status {q(str(sweep_dir / 'runs' / runs[0].name))}  "
            "(and logs, cancel)",
        ]
    return lines


def _run_all(
    sweep_dir, todo, jobs, done_flops, total, done, count, flags=(), lock: SweepLock | None = None
) -> list[tuple[str, int]]:
    """Run ``todo`` through moe-launch, ``jobs`` at a time, with one progress line over the
    sweep; returns the failed runs. A TERM or INT is passed on to the running launches (they
    save and stop) before this returns. Each launch inherits ``lock`` (the sweep's
    :class:`SweepLock`) and holds it while it lives."""
    (sweep_dir / "logs").mkdir(parents=True, exist_ok=True)
    pending, running, failed = list(todo), {}, []
    bar = Progress(total, done_flops, done, count)
    stop, stop_time = [], []

    def on_signal(signum, _frame):
        # Every launch runs in its own process group; moe-launch passes the signal on to its
        # ranks, which save and stop (launch/interrupts.py).
        stop.append(signum)
        stop_time.append(time.monotonic())
        for proc, _ in running.values():
            _signal_group(proc, signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while pending or running:
            while pending and len(running) < jobs and not stop:
                r = pending.pop(0)
                log = open(sweep_dir / "logs" / f"{r.name}.log", "ab")
                cmd = [
                    sys.executable,
                    "-m",
                    "launch.launch",
                    str(sweep_dir / "configs" / f"{r.name}.yaml"),
                    *flags,
                ]
                proc = subprocess.Popen(
                    cmd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    pass_fds=(lock.fd,) if lock else (),
                )
                running[r.name] = (proc, r)
                log.close()
                if lock:
                    lock.started(r.name, proc.pid)
            for name, (proc, r) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[name]
                if lock:
                    lock.ended(name)
                if proc.returncode == 0 and scaling_sweep.finished(sweep_dir, r) is not None:
                    done += 1
                    done_flops += r.flops
                elif not stop:
                    failed.append((name, proc.returncode))
            bar.update(
                done_flops,
                done,
                f"{len(running)} running" + (f", {len(failed)} failed" if failed else ""),
            )
            if stop and running and time.monotonic() - stop_time[0] > STOP_GRACE_S:
                for proc, _ in running.values():
                    _signal_group(proc, signal.SIGKILL)
            if stop and not running:
                raise ScalingError(
                    f"stopped by signal {stop[0]}; {done} of {count} runs finished "
                    f"(moe-scaling run {sweep_dir} resumes the rest)"
                )
            time.sleep(0.5)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        bar.close()
    return failed


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    if signum == signal.SIGKILL:
        # moe-launch runs its ranks in a session of their own (launch/interrupts.py): killed,
        # it could not stop them.
        import psutil

        try:
            descendants = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            descendants = []
        for p in descendants:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass
