"""moe-launch: one config, any scheduler.

    moe-launch CONFIG [key=value ...] [--scheduler local|hostfile|slurm|mpi] [--dry-run]
    moe-launch status RUN_DIR|JOB_ID     (SLURM)
    moe-launch cancel RUN_DIR|JOB_ID     (SLURM)

Builds a plan (commands, environment, job script) from the run config, validates it, then
prints it (--dry-run) or prepares the data, writes the run directory (resolved config, plan,
job files) and runs it: local, hostfile and mpi runs train to the end and evaluate the final
checkpoint; slurm submits the job and prints its id.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from data_pipeline.prepare import prepare
from launch.cli import exits_cleanly
from launch.evaluate import evaluate_checkpoint
from launch.plan import RESOLVED_CONFIG, Plan, write_atomic
from launch.schedulers import build_plan
from launch.schedulers.slurm import JOB_RECORD
from moe.errors import LaunchError
from moe.training.config import dump_config, load_config
from moe.training.preemption import PREEMPTED_EXIT_CODE, PREEMPTED_MARKER

JOB_COMMANDS = ("status", "cancel")


def run_to_end(plan: Plan, run_dir: Path, evaluate: bool) -> None:
    (run_dir / PREEMPTED_MARKER).unlink(missing_ok=True)  # left by an earlier, requeued run
    print(f"launch: {plan.render().splitlines()[-1]}", flush=True)
    rc = subprocess.call(plan.command, env=plan.run_env())
    if rc == PREEMPTED_EXIT_CODE or (run_dir / PREEMPTED_MARKER).exists():
        raise LaunchError(f"training stopped after a preemption signal and saved a checkpoint "
                          f"({(run_dir / PREEMPTED_MARKER).read_text().strip()}); run the same "
                          f"command again to resume")
    if rc != 0:
        raise LaunchError(f"training failed with exit code {rc}; per-rank logs in {run_dir / 'logs'}")
    summary = json.loads((run_dir / "train_summary.json").read_text())
    tb_dir = run_dir / "tensorboard"
    # Only point at event files that exist (logging.tensorboard: false writes none).
    tensorboard = (f"tensorboard --logdir {tb_dir}" if tb_dir.is_dir()
                   else "none written (logging.tensorboard: false)")
    lines = [f"run directory   {run_dir}",
             f"tensorboard     {tensorboard}",
             f"checkpoint      {summary['checkpoint']}"]
    if summary["history"] and summary["history"][0]["step"] == 1:
        lines.append(f"step-1 loss     {summary['history'][0]['loss']:.4f}")
    if evaluate:
        r = evaluate_checkpoint(summary["checkpoint"])
        lines += [f"valid loss      {r['loss']:.4f} nats/token over {r['tokens']:,} tokens "
                  f"(uniform guess {r['uniform_loss']:.4f})",
                  f"perplexity      {r['perplexity']:.2f}",
                  f"evaluation      {r['output']}"]
    print("\n".join(lines))


def submit(plan: Plan, run_dir: Path) -> str:
    proc = subprocess.run(plan.command, env=plan.run_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise LaunchError(f"sbatch refused the job (exit code {proc.returncode}): "
                          f"{proc.stderr.strip() or proc.stdout.strip()}")
    job_id = proc.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise LaunchError(f"sbatch printed {proc.stdout.strip()!r}, not a job id")
    write_atomic(run_dir / JOB_RECORD, json.dumps(
        {"job_id": job_id, "submitted": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
         "script": plan.command[-1]}, indent=2))
    print(f"submitted SLURM job {job_id}\n"
          f"run directory   {run_dir}\n"
          f"status          moe-launch status {run_dir}\n"
          f"cancel          moe-launch cancel {run_dir}")
    return job_id


def launch(argv) -> None:
    p = argparse.ArgumentParser(prog="moe-launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="run config (YAML)")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. train.max_steps=50")
    p.add_argument("--scheduler", choices=["local", "hostfile", "slurm", "mpi"],
                   help="overrides launch.scheduler")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    p.add_argument("--no-eval", action="store_true", help="skip evaluating the final checkpoint")
    # Overrides may come after the flags, as in the synopsis.
    args = p.parse_intermixed_args(argv)

    overrides = list(args.overrides)
    if args.scheduler:
        overrides.append(f"launch.scheduler={args.scheduler}")
    cfg = load_config(args.config, overrides)
    plan = build_plan(cfg)
    if args.dry_run:
        print(plan.render())
        return
    plan.check_runnable()
    run_dir = Path(plan.run_dir)
    write_atomic(run_dir / RESOLVED_CONFIG, dump_config(cfg))
    (run_dir / "logs").mkdir(exist_ok=True)  # SLURM does not create the job log's directory
    plan.write(run_dir)

    report = prepare(cfg.data)
    print(f"data: {report.data_dir} ({'reused' if report.skipped else 'prepared'}, "
          f"{report.manifest.splits['train'].tokens:,} train tokens)", flush=True)
    if plan.submits:
        submit(plan, run_dir)
    else:
        run_to_end(plan, run_dir, evaluate=not args.no_eval)


def job_id_of(target: str) -> str:
    if target.isdigit():
        return target
    record = Path(target) / JOB_RECORD
    try:
        return str(json.loads(record.read_text())["job_id"])
    except (OSError, ValueError, KeyError):
        raise LaunchError(f"{target}: neither a job id nor a run directory with a readable "
                          f"{JOB_RECORD} (written when moe-launch submits a SLURM job)") from None


def slurm_command(argv: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise LaunchError(f"{argv[0]!r} not found on PATH: SLURM's client commands are needed "
                          f"to query or cancel a job") from None


def job_state(job_id: str) -> str | None:
    """SLURM's state of a job (PENDING, RUNNING, COMPLETED, ...), or None once it has left
    the controller's memory."""
    out = slurm_command(["squeue", "-h", "-j", job_id, "-o", "%T"]).stdout.strip()
    if out:
        return out.splitlines()[0]
    out = slurm_command(["scontrol", "show", "job", job_id]).stdout
    for token in out.split():
        if token.startswith("JobState="):
            return token.split("=", 1)[1]
    return None


def job_command(argv) -> None:
    p = argparse.ArgumentParser(prog="moe-launch", description="query or cancel a SLURM job")
    p.add_argument("action", choices=JOB_COMMANDS)
    p.add_argument("target", help="a run directory that moe-launch submitted, or a job id")
    args = p.parse_args(argv)
    job_id = job_id_of(args.target)
    if args.action == "cancel":
        proc = slurm_command(["scancel", job_id])
        if proc.returncode != 0:
            raise LaunchError(f"scancel {job_id} failed: {proc.stderr.strip()}")
        print(f"cancelled SLURM job {job_id}")
        return
    state = job_state(job_id)
    print(f"job {job_id}: {state or 'unknown to SLURM (finished long ago or never existed)'}")


@exits_cleanly
def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in JOB_COMMANDS:
        job_command(argv)
    else:
        launch(argv)


if __name__ == "__main__":
    main()
