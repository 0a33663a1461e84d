"""The SLURM jobs of a run directory: what moe-launch submitted, what SLURM says about them now,
and what the run itself logged. Used by ``moe-launch status|cancel|logs`` and by a resubmission,
which is refused while the run's job is still queued or running.

The run directory keeps every job it ran in ``slurm_jobs.json`` (id, submit time, job log, final
state once seen) and the job script appends one line per run of the job to ``slurm_job_ends.txt``
(job id, exit status, whether it requeued itself), so the final state is known even after SLURM
has forgotten the job and ``sacct`` has no accounting database to ask.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from moe.checkpoint.files import LATEST
from moe.core.errors import LaunchError
from moe.core.fileio import write_atomic
from moe.core.run_dir import RunDir

JOBS_FILE = "slurm_jobs.json"
OLD_JOB_FILE = "slurm_job.json"
"""The one-job record that earlier versions wrote; still read, as a one-entry list."""
ENDS_FILE = "slurm_job_ends.txt"
# States in which a job still holds (or waits for) an allocation: the run directory is in use.
ACTIVE = {
    "PENDING",
    "RUNNING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "CONFIGURING",
    "COMPLETING",
    "SUSPENDED",
    "RESIZING",
    "SIGNALING",
    "STAGE_OUT",
    "STOPPED",
    "RESV_DEL_HOLD",
}


@dataclass
class JobState:
    job_id: str
    state: str | None
    """SLURM's state (PENDING, RUNNING, COMPLETED, ...); None when nobody knows it."""
    source: str
    """Where the state came from: squeue, sacct, or the run directory's records."""
    reason: str = ""
    elapsed: str = ""
    limit: str = ""

    forgotten: bool = False
    """Neither squeue nor sacct knows the job, though moe-launch submitted it: it is over (SLURM
    keeps a job it still runs or queues), its final state unknown unless the records hold one."""

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    def summary(self) -> str:
        """The state in a few words, the same in every line that names this job."""
        if self.state is not None:
            return self.state
        return "finished, final state unknown" if self.forgotten else "unknown"


def slurm_command(argv: list[str]) -> subprocess.CompletedProcess | None:
    """Run a SLURM client command; None when it is not installed."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        return None


def read_jobs(run_dir: Path) -> list[dict]:
    for name, wrap in ((JOBS_FILE, False), (OLD_JOB_FILE, True)):
        try:
            jobs = json.loads((run_dir / name).read_text())
        except FileNotFoundError:
            continue
        except ValueError as e:
            raise LaunchError(f"{run_dir / name} is not valid JSON ({e})") from None
        # The old record named no log: it was the default one unless launch.slurm.output said
        # otherwise.
        return (
            [{"state": None, "log": str(RunDir(run_dir).logs / "slurm-%j.out"), **jobs}]
            if wrap
            else jobs
        )
    return []


def record_submission(
    run_dir: Path, job_id: str, script: str, log: str, after: str | None = None
) -> None:
    """``after``: the job this one waits for (``--dependency=afterany``), if any."""
    jobs = read_jobs(run_dir) + [
        {
            "job_id": job_id,
            "submitted": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "script": script,
            "log": log,
            "state": None,
            **({"after": after} if after else {}),
        }
    ]
    write_atomic(run_dir / JOBS_FILE, json.dumps(jobs, indent=2))


def with_dependency(command: list[str], after: str | None) -> list[str]:
    """``sbatch ... SCRIPT`` waiting for job ``after``, whatever way that one ends."""
    if after is None:
        return command
    return [*command[:-1], f"--dependency=afterany:{after}", command[-1]]


def submit_job(
    command: list[str], env: dict[str, str], run_dir: Path, log: str, after: str | None = None
) -> str:
    """Run ``sbatch --parsable ... SCRIPT`` (``after``: a job id it waits for, whatever way that
    one ends) and record the job in the run directory; its id."""
    command = with_dependency(command, after)
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise LaunchError(
            f"sbatch refused the job (exit code {proc.returncode}): "
            f"{proc.stderr.strip() or proc.stdout.strip()}"
        )
    job_id = proc.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise LaunchError(f"sbatch printed {proc.stdout.strip()!r}, not a job id")
    record_submission(run_dir, job_id, command[-1], log, after)
    return job_id


def record_state(run_dir: Path, job: JobState) -> None:
    """Keep a job's final state in the records once one is seen."""
    if job.state is None or job.active or job.source == "records":
        return
    jobs = read_jobs(run_dir)
    for record in jobs:
        if record["job_id"] == job.job_id and record.get("state") != job.state:
            record["state"] = job.state
            write_atomic(run_dir / JOBS_FILE, json.dumps(jobs, indent=2))


def last_end(run_dir: Path, job_id: str) -> list[str] | None:
    """How the job's newest run ended, as the job script wrote it: ``[JOB, STATUS, "ended"]``
    or ``[JOB, STATUS, "requeued", STEP]`` (older scripts wrote no STEP); None: never."""
    try:
        lines = (run_dir / ENDS_FILE).read_text().splitlines()
    except FileNotFoundError:
        return None
    ends = [fields for fields in map(str.split, lines) if len(fields) >= 3 and fields[0] == job_id]
    return ends[-1] if ends else None


def state_from_ends(run_dir: Path, job_id: str) -> str | None:
    """The state the job script itself wrote when it last ended (None: it never did)."""
    end = last_end(run_dir, job_id)
    if end is None:
        return None
    return (
        "REQUEUED"
        if end[2] == "requeued"
        else "COMPLETED"
        if end[1] == "0"
        else f"FAILED (exit code {end[1]})"
    )


def requeued_at(run_dir: Path, job_id: str) -> int | None:
    """The step a preempted job will resume from, while its newest run ended in a requeue;
    None once a later run ended."""
    end = last_end(run_dir, job_id)
    if end is None or end[2] != "requeued" or len(end) < 4 or not end[3].isdigit():
        return None
    return int(end[3])


def query(job_id: str, run_dir: Path | None = None) -> JobState:
    """The job's state from the controller (squeue), else accounting (sacct), else the records
    of ``run_dir``."""
    proc = slurm_command(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T|%r|%M|%l"])
    if proc is not None and proc.returncode == 0 and proc.stdout.strip():
        state, reason, elapsed, limit = proc.stdout.strip().splitlines()[0].split("|")
        return JobState(job_id, state, "squeue", reason, elapsed, limit)
    # squeue answered and does not know the job (an unreachable controller proves nothing).
    unknown_to_squeue = proc is not None and (
        proc.returncode == 0 or "Invalid job id" in proc.stderr
    )
    proc = slurm_command(
        ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,Reason,Elapsed,Timelimit"]
    )
    if proc is not None and proc.returncode == 0 and proc.stdout.strip():
        state, reason, elapsed, limit = proc.stdout.strip().splitlines()[0].split("|")
        return JobState(job_id, state.split()[0], "sacct", reason, elapsed, limit)
    if run_dir is None or not any(r["job_id"] == job_id for r in read_jobs(run_dir)):
        return JobState(job_id, None, "records")
    recorded = next(r.get("state") for r in read_jobs(run_dir) if r["job_id"] == job_id)
    state = recorded or state_from_ends(run_dir, job_id)
    if state in ACTIVE and unknown_to_squeue:
        # The job's last run requeued it, then it was killed hard (or purged) before it could
        # write how it ended: SLURM, which keeps every job it still queues, forgot it.
        state = None
    return JobState(job_id, state, "records", forgotten=unknown_to_squeue)


def newest_job(run_dir: Path) -> JobState | None:
    """The state of the newest job submitted for ``run_dir`` (kept in its records once final);
    None when none was."""
    jobs = read_jobs(run_dir)
    if not jobs:
        return None
    job = query(str(jobs[-1]["job_id"]), run_dir)
    record_state(run_dir, job)
    return job


def refuse_if_active(run_dir: Path) -> None:
    """A run directory belongs to one job at a time: resubmitting would overwrite the config
    and plan under a queued or running job."""
    job = newest_job(run_dir)
    if job is not None and job.active:
        raise LaunchError(
            f"run directory {run_dir} belongs to SLURM job {job.job_id}, which is "
            f"{job.state}; cancel it first (moe-launch cancel {run_dir}) or "
            f"submit under another name (name=...)"
        )


def _step_records(path: Path) -> tuple[dict[int, dict], dict | None]:
    """A rank's records by step (the last line of a step) and its last record."""
    steps, last = {}, None
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                last = json.loads(line)
            except ValueError:
                continue  # a line a rank was writing when it was killed
            steps[last["step"]] = last
    return steps, last


def last_steps(run_dir: Path) -> dict | None:
    """The newest step the ranks logged: step, loss averaged over ranks, tokens per second.

    ``logs/steps_rank*.jsonl`` gain the steps after a checkpoint again when a job resumes
    from it; the last line of a step is the valid one. The ranks are those of rank 0's last
    record: a job resumed on fewer ranks leaves the others' files, cut back to its checkpoint."""
    files = RunDir(run_dir)
    _, last = _step_records(files.step_records(0))
    paths = (
        [files.step_records(r) for r in range(last["world_size"])]
        if last is not None and "world_size" in last
        else files.all_step_records()  # records written before they named the world size
    )
    per_rank = [steps for steps, _ in map(_step_records, paths) if steps]
    if not per_rank:
        return None
    step = min(max(steps) for steps in per_rank)  # every rank has logged it
    losses = [steps[step]["loss"] for steps in per_rank if step in steps]
    out = {"step": step, "loss": sum(losses) / len(losses), "tokens_per_s": None}
    # Throughput is in rank 0's console log, not in the step records.
    rank0 = files.rank_log(0)
    if rank0.exists():
        for line in reversed(rank0.read_text(errors="replace").splitlines()):
            m = re.search(r"step +(\d+)/\d+ \|.*\| ([\d,]+) tok/s", line)
            if m and int(m.group(1)) == step:
                out["tokens_per_s"] = int(m.group(2).replace(",", ""))
                break
    return out


def newest_checkpoint(run_dir: Path) -> str | None:
    ckpt_dir = RunDir(run_dir).checkpoints
    try:
        tag = (ckpt_dir / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    return str(ckpt_dir / tag)
