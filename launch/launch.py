"""moe-launch: one config, any scheduler.

    moe-launch CONFIG [key=value ...] [--scheduler local|hostfile|slurm|mpi] [--dry-run]
    moe-launch status RUN_DIR|JOB_ID     (SLURM)
    moe-launch cancel RUN_DIR|JOB_ID     (SLURM)
    moe-launch logs RUN_DIR [-f] [--rank N]   (SLURM)

Builds a plan (commands, environment, job script) from the run config, validates it, then
prints it (--dry-run) or prepares the data, writes the run directory (resolved config, plan,
job files) and runs it: local, hostfile and mpi runs train to the end and evaluate the final
checkpoint; slurm submits the job and prints its id (the job evaluates its final
checkpoint itself, see launch/finish.py).

Exit codes (docs/launching.md): 0 the run finished; 75 preempted: the ranks saved a checkpoint on
a signal (to moe-launch or to them) and stopped, run the same command again to resume; 2 a
failure or a refused config, with one message; 128+N stopped by signal N without a save (a
second SIGTERM or Ctrl-C, or ``checkpoint.save_on_signals: []``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import yaml

from data_pipeline.prepare import prepare
from launch.cli import (
    STORAGE_ERRNOS,
    Terminated,
    exits_cleanly,
    storage_problem,
    terminated_cleanly,
)
from launch.elastic import Elastic
from launch.finish import finish
from launch.interrupts import LauncherSignals
from launch.launcher_watch import ENV as WATCH_ENV
from launch.launcher_watch import identity
from launch.restarts import run_with_restarts
from launch.run_lock import RunLock
from launch.run_plan import Plan
from launch.schedulers import build_plan, plan_problems
from launch.slurm.checks import check_submission
from launch.slurm.jobs import (
    JOBS_FILE,
    JobState,
    last_steps,
    newest_checkpoint,
    query,
    read_jobs,
    record_state,
    refuse_if_active,
    requeued_at,
    slurm_command,
    submit_job,
)
from launch.slurm.prepare import is_prepare_dir
from launch.slurm.script import job_log
from moe.checkpoint.files import RUN_CONFIG, find_latest, verify_checkpoint
from moe.config.run import SIGNALS, dump_config, load_config
from moe.core.errors import ConfigError, DamagedCheckpointError, LaunchError
from moe.core.run_dir import RunDir
from moe.training.finetune import adapter_file_problem
from moe.training.resilience.preemption import PREEMPTED_EXIT_CODE, was_preempted
from moe.training.upcycle import init_from_problem

JOB_COMMANDS = ("status", "cancel", "logs")
WAITING = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING"}
"""States of a requeued job that has not started again."""


def stopped(message: str, code: int):
    """End moe-launch with ``code`` and one message (not an error: no "error:" prefix)."""
    print(f"launch: {message}", file=sys.stderr, flush=True)
    return SystemExit(code)


def run_to_end(
    plan: Plan,
    run_dir: Path,
    evaluate: bool,
    max_restarts: int = 0,
    replan=None,
    save_signal: int | None = signal.SIGUSR1,
) -> None:
    """Run the plan to its end, restarting it after a failure up to ``max_restarts`` times
    (launch/restarts.py); ``replan``: the next attempt's command (launch/elastic.py);
    ``save_signal``: what the ranks get when moe-launch receives SIGTERM, SIGINT, SIGHUP or
    SIGUSR1 (launch/interrupts.py; None: nothing saves on a signal, they are stopped)."""
    files = RunDir(run_dir)
    files.preempted.unlink(missing_ok=True)  # left by an earlier, requeued run
    print(f"launch: {plan.render().splitlines()[-1]}", flush=True)

    def preempted(rc: int) -> bool:
        return was_preempted(rc, run_dir)

    # Every rank watches this process and ends with it (launch/launcher_watch.py).
    me = identity()
    env = {**plan.run_env(), **({WATCH_ENV: me} if me else {})}
    with LauncherSignals(save_signal) as signals:
        try:
            rc = run_with_restarts(
                plan.command,
                env,
                run_dir,
                plan.world_size,
                max_restarts,
                preempted,
                replan,
                signals,
            )
        except LaunchError:
            if signals.received is None:
                raise
            rc = 1
    if preempted(rc):
        marker = files.preempted
        step = json.loads(marker.read_text()).get("step") if marker.exists() else None
        resume = newest_checkpoint(run_dir)
        where = (
            f"saved a checkpoint at step {step}; run the same command again to resume "
            f"from step {step}"
            if step is not None
            else f"before the first step, nothing to save; run the same command again to "
            f"{'resume from ' + resume if resume else 'start'}"
        )
        cause = f"on {signals.name} to moe-launch" if signals.received else "on a preemption signal"
        raise stopped(
            f"preempted (exit code {PREEMPTED_EXIT_CODE}, not a failure): training "
            f"stopped {cause} and {where}",
            PREEMPTED_EXIT_CODE,
        )
    if signals.received is not None and rc != 0:
        resume = newest_checkpoint(run_dir)
        raise stopped(
            f"stopped by {signals.name} without saving (exit code "
            f"{128 + (signals.forced or signals.received)}); "
            f"{'the newest checkpoint is ' + resume if resume else 'no checkpoint yet'}; "
            f"per-rank logs in {files.logs}",
            128 + (signals.forced or signals.received),
        )
    print("\n".join(finish(run_dir, evaluate)))


def submit(plan: Plan, run_dir: Path, log: str) -> str:
    job_id = submit_job(plan.command, plan.run_env(), run_dir, log)
    print(
        f"submitted SLURM job {job_id}\n"
        f"run directory   {run_dir}\n"
        f"status          moe-launch status {run_dir}\n"
        f"cancel          moe-launch cancel {run_dir}"
    )
    return job_id


MIN_FREE_BYTES = 16 << 20
"""Below this much free space the run directory's disk counts as full (the run's logs and first
checkpoint need more; the checkpoint storage's own check, launch/train.py, uses the same floor)."""


def check_writable(run_dir: Path) -> None:
    """The run directory, or the directory it will be made in, can be written (a read-only file
    system refuses even root)."""
    where = run_dir
    while not where.exists() and where != where.parent:
        where = where.parent
    if not os.access(where, os.W_OK | os.X_OK):
        raise LaunchError(
            f"{run_dir}: cannot write the run directory: {where} is read-only or not writable"
        )
    st = os.statvfs(where)
    if st.f_bavail * st.f_frsize < MIN_FREE_BYTES:
        raise LaunchError(
            f"{run_dir}: cannot write the run directory: the disk holding {where} is full "
            f"({st.f_bavail * st.f_frsize:,} bytes free)"
        )


def write_run_dir(plan: Plan, run_dir: Path, config_text: str, made: bool | None = None) -> None:
    """The run directory's files; on a write error (a full disk), a run directory this launch
    made (``made``; default: this call) is removed again, and the error names the path."""
    made = not run_dir.exists() if made is None else made
    try:
        plan.write_run_dir(config_text)
    except OSError as e:
        if e.errno not in STORAGE_ERRNOS:
            raise
        if made:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise LaunchError(storage_problem(e, "the run directory", run_dir)) from None


def launch(argv) -> None:
    p = argparse.ArgumentParser(
        prog="moe-launch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("config", help="run config (YAML)")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. train.max_steps=50")
    p.add_argument(
        "--scheduler",
        choices=["local", "hostfile", "slurm", "mpi"],
        help="overrides launch.scheduler",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    p.add_argument("--no-eval", action="store_true", help="skip evaluating the final checkpoint")
    # Overrides may come after the flags, as in the synopsis.
    args = p.parse_intermixed_args(argv)

    overrides = list(args.overrides)
    if args.scheduler:
        overrides.append(f"launch.scheduler={args.scheduler}")
    cfg = load_config(args.config, overrides, checks=plan_problems)
    plan = build_plan(cfg, evaluate=not args.no_eval)
    if args.dry_run:
        print(plan.render())
        return
    plan.check_runnable()
    run_dir = Path(plan.run_dir)
    refuse_bad_source(cfg, run_dir, args.config)
    if plan.submits:
        # Every check before anything in the run directory changes: a refused submission
        # leaves it byte-identical.
        refuse_if_active(run_dir)
        check_submission(cfg, plan)  # SLURM's own verdict, before any data work too
    check_writable(run_dir)  # before the data work, which can take hours
    # The data before the run directory: a preparation that fails leaves no run behind.
    report = prepare(cfg.data)
    print(
        f"data: {report.data_dir} ({'reused' if report.skipped else 'prepared'}, "
        f"{report.manifest.splits['train'].tokens:,} train tokens)",
        flush=True,
    )
    if plan.submits:
        write_run_dir(plan, run_dir, dump_config(cfg))
        submit(plan, run_dir, job_log(cfg, run_dir))
        return
    made = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        lock = RunLock(run_dir)  # before this launch's config replaces a running one's
    except LaunchError:
        if made:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    try:
        write_run_dir(plan, run_dir, dump_config(cfg), made)
        saves_on = cfg.checkpoint.save_on_signals
        run_to_end(
            plan,
            run_dir,
            evaluate=not args.no_eval,
            max_restarts=cfg.launch.max_restarts,
            replan=Elastic(cfg, plan.run_env()) if cfg.launch.elastic else None,
            save_signal=SIGNALS[saves_on[0]] if saves_on else None,
        )
    finally:
        lock.release()


def refuse_bad_source(cfg, run_dir: Path, config: str) -> None:
    """Refused before the run directory or the data are touched: a new run whose
    ``model.init_from`` gives no weights or whose ``finetune.lora.init_from`` is no adapter
    file, and a run resuming a checkpoint its config does not match (say a fine-tuning given the
    name of the run it starts from), whose ranks would refuse it only after this run's config
    and plan had replaced those of the run in that directory."""
    ckpt_dir = RunDir(run_dir).checkpoints
    tag = find_latest(ckpt_dir)
    if tag is not None:  # resumed: its own checkpoint, not the sources, is read
        try:
            verify_checkpoint(ckpt_dir / tag, with_saved_vocab(cfg, ckpt_dir / tag))
        except DamagedCheckpointError:
            pass  # the ranks name it, with the way back to the checkpoint before it
        return
    problems = [init_from_problem(cfg.model.init_from)] if cfg.model.init_from else []
    adapters = cfg.finetune.lora.init_from
    if adapters and cfg.finetune.method in ("lora", "qlora"):
        problems.append(adapter_file_problem(adapters))
    problems = [p for p in problems if p]
    if problems:
        raise ConfigError(problems, config)


def with_saved_vocab(cfg, tag_dir: Path):
    """``cfg`` with the vocabulary size of the checkpoint ``tag_dir`` where it leaves it to the
    tokenizer (``model.vocab_size: null``): the data, which says, is prepared later, and the
    ranks compare the tokenizer itself."""
    if cfg.model.vocab_size is not None:
        return cfg
    try:
        saved = yaml.safe_load((tag_dir / RUN_CONFIG).read_text())["model"]["vocab_size"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return cfg  # an unreadable config: the checkpoint check names it
    return replace(cfg, model=replace(cfg.model, vocab_size=saved))


def resolve_target(target: str) -> tuple[str, Path | None]:
    """A job id, or a run directory and the newest job it submitted."""
    if target.isdigit():
        return target, None
    run_dir = Path(target)
    jobs = read_jobs(run_dir)
    if not jobs:
        raise LaunchError(
            f"{target}: neither a job id nor a run directory with a {JOBS_FILE} "
            f"(written when moe-launch submits a SLURM job)"
        )
    return str(jobs[-1]["job_id"]), run_dir


def describe(job: JobState) -> str:
    if job.state is None and job.forgotten:
        return (
            f"{job.summary()}: neither squeue nor sacct knows the job any more (no "
            f"accounting database), and it did not record how it ended"
        )
    if job.state is None:
        return "unknown to SLURM, to sacct and to the run directory's records"
    text = job.state + (f" ({job.reason})" if job.reason and job.reason != "None" else "")
    if job.elapsed:
        text += f", elapsed {job.elapsed} of {job.limit or 'no limit'}"
    return text + ("" if job.source == "squeue" else f" [from {job.source}]")


def training_lines(run_dir: Path, job: JobState) -> list[str]:
    """What a training run's directory says beyond SLURM: last step, requeue, checkpoint."""
    lines = []
    steps = last_steps(run_dir)
    if steps:
        speed = f", {steps['tokens_per_s']:,} tokens/s" if steps["tokens_per_s"] is not None else ""
        lines.append(f"last step       {steps['step']}, loss {steps['loss']:.4f}{speed}")
    resume = requeued_at(run_dir, job.job_id)
    if resume is not None and job.state in WAITING:  # not once it runs (and resumed) again
        lines.append(
            f"preempted       exit code {PREEMPTED_EXIT_CODE} on purpose (not a "
            f"failure): requeued, will resume from step {resume}"
        )
    return lines + [
        f"checkpoint      {newest_checkpoint(run_dir) or 'none yet'}",
        f"rank logs       {run_dir / 'logs'}/rank*.log",
    ]


def status(target: str) -> None:
    """Print the job's state and what its run directory says; exit 1 when the state is not
    known (a job nobody knows, or one SLURM forgot before it recorded its end)."""
    job_id, run_dir = resolve_target(target)
    job = query(job_id, run_dir)
    lines = [f"job {job_id}: {describe(job)}"]
    if run_dir is not None:
        record_state(run_dir, job)
        if not is_prepare_dir(run_dir):
            lines += training_lines(run_dir, job)
        else:  # moe-prepare --slurm-parts: the jobs before the newest matter as much
            for record in read_jobs(run_dir)[:-1]:
                if not record.get("state"):
                    record_state(run_dir, query(str(record["job_id"]), run_dir))
        record = read_jobs(run_dir)[-1]
        # The newest job as the first line says; older ones as recorded.
        history = [
            job.summary() if r["job_id"] == job_id else r.get("state") or "no final state seen"
            for r in read_jobs(run_dir)
        ]
        lines += [
            f"job log         {record['log'].replace('%j', job_id)}",
            "jobs of the run "
            + ", ".join(f"{r['job_id']} ({h})" for r, h in zip(read_jobs(run_dir), history)),
        ]
    print("\n".join(lines), flush=True)
    if job.state is None:
        sys.exit(1)


def cancel(target: str) -> None:
    job_id, run_dir = resolve_target(target)
    before = query(job_id, run_dir)
    if not before.active:
        raise LaunchError(f"nothing cancelled: job {job_id} is {describe(before)}")
    proc = slurm_command(["scancel", job_id])
    if proc is None or proc.returncode != 0:
        raise LaunchError(
            f"scancel {job_id} failed: "
            f"{'scancel not found on PATH' if proc is None else proc.stderr.strip()}"
        )
    deadline = time.time() + 30
    after = query(job_id, run_dir)
    while after.active and time.time() < deadline:
        time.sleep(0.5)
        after = query(job_id, run_dir)
    if run_dir is not None:
        record_state(run_dir, after)
    if after.state != "CANCELLED":
        raise LaunchError(
            f"asked SLURM to cancel job {job_id} (was {before.state}); it is now {describe(after)}"
        )
    print(f"cancelled SLURM job {job_id} (was {before.state})")


def logs(target: str, follow: bool, rank: int | None) -> None:
    """Print the job log (or rank ``rank``'s log); ``follow``: keep printing what is appended
    until the job is over (or Ctrl-C)."""
    job_id, run_dir = resolve_target(target)
    if run_dir is None:
        raise LaunchError("moe-launch logs takes the run directory, not a job id")
    path = (
        RunDir(run_dir).rank_log(rank)
        if rank is not None
        else Path(read_jobs(run_dir)[-1]["log"].replace("%j", job_id))
    )
    if not path.exists() and not (follow and query(job_id, run_dir).active):
        raise LaunchError(f"{path} does not exist (yet): the job has not started writing it")
    print(f"==> {path} <==", flush=True)
    offset = 0
    while True:
        if path.exists():
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
            offset += len(chunk)
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()
        if not follow:
            return
        if not query(job_id, run_dir).active:  # one last read after the job ended
            follow = False
            continue
        time.sleep(1)


def job_command(argv) -> None:
    p = argparse.ArgumentParser(
        prog="moe-launch", description="state, cancel or logs of a submitted SLURM job"
    )
    p.add_argument("action", choices=JOB_COMMANDS)
    p.add_argument("target", help="a run directory that moe-launch submitted, or a job id")
    p.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="logs: keep printing new lines until the job ends",
    )
    p.add_argument("--rank", type=int, help="logs: this rank's log instead of the job log")
    args = p.parse_args(argv)
    if args.action != "logs" and (args.follow or args.rank is not None):
        p.error("-f and --rank go with logs")
    if args.action == "cancel":
        cancel(args.target)
    elif args.action == "logs":
        try:
            logs(args.target, args.follow, args.rank)
        except KeyboardInterrupt:
            pass  # Ctrl-C ends following, as with tail -f
    else:
        status(args.target)


@exits_cleanly
def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        with terminated_cleanly():
            if argv and argv[0] in JOB_COMMANDS:
                job_command(argv)
            else:
                launch(argv)
    except KeyboardInterrupt:  # Ctrl-C outside training (data preparation, evaluation)
        raise stopped("interrupted (Ctrl-C)", 128 + signal.SIGINT) from None
    except Terminated:  # the same for SIGTERM
        raise stopped("stopped by SIGTERM", 128 + signal.SIGTERM) from None


if __name__ == "__main__":
    main()
