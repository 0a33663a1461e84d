"""Many runs as SLURM jobs, at most K running at once, and waiting for them: what
``moe-scaling run SWEEP --scheduler slurm`` does with the runs of a sweep.

One job per run, not a job array. Each run directory is then exactly what ``moe-launch
--scheduler slurm`` makes of it (job script, ``slurm_jobs.json``, ``slurm_job_ends.txt``), so
``moe-launch status|cancel|logs RUN_DIR``, the job's own requeue after a preemption
(``scontrol requeue $SLURM_JOB_ID``, resuming from its checkpoint) and the refusal to submit a run
whose job is still queued or running all work unchanged. The tasks of an array share one script
and one log pattern, and a pending task has no job id of its own until it starts: the records,
the status commands and the requeue would each need a second way to name a job.

The bound: the new jobs are laid out in K chains, each waiting for the job before it in its chain
(``--dependency=afterany:ID``: however that one ended, so a failed run does not hold up the
rest). SLURM keeps the bound, as an array's ``%K`` would: the sweep goes on when moe-scaling stops
waiting (Ctrl-C, ``--no-wait``, a closed terminal). A run joins the chain with the least planned
compute, so the chains end at about the same time. Jobs a previous submission left queued or
running are not submitted again; the new chains start after the ends of theirs.
"""

from __future__ import annotations

import json
import shlex
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from launch.run_plan import Plan
from launch.schedulers import build_plan, plan_problems
from launch.slurm.checks import check_submission
from launch.slurm.jobs import (
    JobState,
    last_steps,
    newest_job,
    query,
    read_jobs,
    record_state,
    slurm_command,
    submit_job,
    with_dependency,
)
from launch.slurm.script import job_log
from moe.config.run import RunConfig, dump_config, load_config
from moe.core.config_schema import to_dict
from moe.core.errors import ConfigError, LaunchError
from moe.core.run_dir import RunDir

POLL_S = 2.0


@dataclass
class Member:
    """One run of the sweep."""

    name: str
    config: Path
    """Its run config (the sweep's configs/NAME.yaml)."""
    run_dir: Path
    flops: float
    """Its planned training compute: the chains are balanced on it, progress counts it."""
    steps: int


@dataclass
class Job:
    """A run to submit, and what its job waits for."""

    member: Member
    cfg: RunConfig
    plan: Plan
    after: str | int | None = None
    """A queued job's id, the index of an earlier job of this submission, or None."""

    def waits_for(self, ids: list[str]) -> str | None:
        """The job id it waits for, given the ids of the jobs submitted before it."""
        return ids[self.after] if isinstance(self.after, int) else self.after


@dataclass
class Sweep:
    """What a submission finds and does: runs finished, runs whose jobs are queued or running,
    and the jobs to submit."""

    finished: list[Member]
    active: dict[str, JobState]
    """Run name -> its job, queued or running."""
    jobs: list[Job] = field(default_factory=list)

    def render(self) -> str:
        """The job scripts and sbatch commands (what --dry-run prints)."""
        parts = []
        ids = [f"<job of {j.member.name}>" for j in self.jobs]
        for job in self.jobs:
            parts.append(job.plan.render().rsplit("\n# command:", 1)[0])
            command = with_dependency(job.plan.command, job.waits_for(ids))
            parts.append(f"# command:\n{shlex.join(command)}")
        return "\n".join(parts)


def survey(members: list[Member], is_finished: Callable[[Member], bool]) -> Sweep:
    """Which runs are finished, which have a job queued or running (not to be submitted again),
    and which are left."""
    sweep = Sweep([], {})
    for m in members:
        if is_finished(m):
            sweep.finished.append(m)
            continue
        job = newest_job(m.run_dir)
        if job is not None and job.active:
            sweep.active[m.name] = job
    return sweep


def chain_tails(members: list[Member], active: dict[str, JobState]) -> list[tuple[str, float]]:
    """The active jobs no other active job waits for (the ends of the chains a submission
    left), with the planned compute of their run."""
    waited_for = set()
    for m in members:
        if m.name in active:
            record = next(
                r for r in read_jobs(m.run_dir) if str(r["job_id"]) == active[m.name].job_id
            )
            waited_for.add(str(record.get("after")))
    return [
        (active[m.name].job_id, m.flops)
        for m in members
        if m.name in active and active[m.name].job_id not in waited_for
    ]


def chains(todo: list[Member], tails: list[tuple[str, float]], k: int) -> list[str | int | None]:
    """For each run of ``todo`` in order, what its job waits for: the chain with the least
    planned compute so far gets it. The chains start after ``tails`` (job id, compute); when
    there are more than ``k`` (an earlier submission with a larger bound), after the ``k`` with
    the most compute, which end last; with fewer, the other chains start free."""
    tails = sorted(tails, key=lambda t: t[1])[-k:] if tails else []
    slots: list[tuple[float, str | int | None]] = [(flops, job_id) for job_id, flops in tails]
    slots += [(0.0, None)] * (k - len(slots))
    out = []
    for i, m in enumerate(todo):
        s = min(range(len(slots)), key=lambda j: slots[j][0])
        out.append(slots[s][1])
        slots[s] = (slots[s][0] + m.flops, i)
    return out


def plan_jobs(members: list[Member], sweep: Sweep, k: int) -> None:
    """The job of every run that is neither finished nor queued, chained; every config is
    checked (all problems in one error) before anything is submitted."""
    todo = [m for m in members if m not in sweep.finished and m.name not in sweep.active]
    problems, built = [], []
    for m in todo:
        try:
            cfg = load_config(m.config, ["launch.scheduler=slurm"], checks=plan_problems)
        except ConfigError as e:
            problems.append(str(e))
            continue
        output = cfg.launch.slurm.output
        if output is not None and "%j" not in output:
            # Every run of the sweep would append to the same job log.
            problems.append(
                f"{m.config}: launch.slurm.output: {output!r} is shared by every "
                "run of the sweep; include %j (the job id) or leave it null "
                "(RUN_DIR/logs/slurm-%j.out)"
            )
            continue
        built.append((m, cfg, build_plan(cfg)))
    if problems:
        raise LaunchError(
            "the sweep's run configs are refused; nothing was submitted:\n" + "\n".join(problems)
        )
    afters = chains(todo, chain_tails(members, sweep.active), k)
    sweep.jobs = [Job(m, cfg, plan, after) for (m, cfg, plan), after in zip(built, afters)]


def submit(sweep: Sweep) -> list[str]:
    """Check every job with SLURM (``sbatch --test-only``, the partition), prepare the data once
    per data config, then submit the jobs in order; their ids. A refusal after some were
    submitted names them (they stay queued: a second submission will not repeat them)."""
    from data_pipeline.prepare import prepare

    checked = set()
    for job in sweep.jobs:  # the runs differ in their model, not in what they ask SLURM for
        job.plan.check_runnable()
        key = json.dumps([to_dict(job.cfg.launch), job.cfg.parallel.world_size], sort_keys=True)
        if key not in checked:
            check_submission(job.cfg, job.plan)
            checked.add(key)
    prepared = set()
    for job in sweep.jobs:
        key = json.dumps(to_dict(job.cfg.data), sort_keys=True)
        if key not in prepared:
            prepare(job.cfg.data)
            prepared.add(key)
    ids: list[str] = []
    for job in sweep.jobs:
        run_dir = Path(job.plan.run_dir)
        job.plan.write_run_dir(dump_config(job.cfg))
        try:
            ids.append(
                submit_job(
                    job.plan.command,
                    job.plan.run_env(),
                    run_dir,
                    job_log(job.cfg, run_dir),
                    job.waits_for(ids),
                )
            )
        except LaunchError as e:
            done = ", ".join(f"{j.member.name} {i}" for j, i in zip(sweep.jobs, ids)) or "none"
            raise LaunchError(f"{job.member.name}: {e}; jobs already submitted: {done}") from None
    return ids


@dataclass
class Outcome:
    failed: list[tuple[Member, JobState]]
    """Runs whose job ended without finishing the run."""
    stopped: int | None = None
    """The signal that ended the wait (the jobs go on)."""


def job_states(jobs: dict[str, Member]) -> dict[str, JobState]:
    """The state of each job (id -> member): one squeue for all, the records for what squeue
    no longer knows."""
    states = {}
    proc = slurm_command(["squeue", "-h", "-t", "all", "-j", ",".join(jobs), "-o", "%i|%T"])
    if proc is not None and proc.returncode == 0:
        for line in proc.stdout.splitlines():
            job_id, _, state = line.partition("|")
            if job_id in jobs:
                states[job_id] = JobState(job_id, state, "squeue")
    for job_id, m in jobs.items():
        if job_id not in states:
            states[job_id] = query(job_id, m.run_dir)
    return states


def wait(
    members: list[Member],
    is_finished: Callable[[Member], bool],
    progress: Callable[[float, int, str], None],
) -> Outcome:
    """Wait until no job of an unfinished run is queued or running, calling ``progress(compute
    done, runs done, note)`` as it goes: the compute of finished runs plus the steps the running
    ones logged. TERM or INT ends the wait, not the jobs."""
    received: list[int] = []
    old = {
        s: signal.signal(s, lambda signum, _f: received.append(signum))
        for s in (signal.SIGTERM, signal.SIGINT)
    }
    failed: dict[str, tuple[Member, JobState]] = {}
    try:
        while True:
            waiting = {}
            for m in members:
                if m.name not in failed and not is_finished(m):
                    records = read_jobs(m.run_dir)
                    if records:
                        waiting[str(records[-1]["job_id"])] = m
            states = job_states(waiting) if waiting else {}
            # Read after the states: a job ends after its run's final files are written.
            done = [m for m in members if is_finished(m)]
            compute = sum(m.flops for m in done)
            running = queued = 0
            for job_id, m in waiting.items():
                job = states[job_id]
                if m in done:
                    continue
                if job.active:
                    running += job.state == "RUNNING"
                    queued += job.state != "RUNNING"
                    steps = last_steps(m.run_dir)
                    compute += m.flops * min(1.0, steps["step"] / m.steps) if steps else 0.0
                else:
                    record_state(m.run_dir, job)
                    failed[m.name] = (m, job)
            note = f"{running} running, {queued} queued" + (
                f", {len(failed)} failed" if failed else ""
            )
            progress(compute, len(done), note)
            if received or not (running or queued):
                return Outcome(list(failed.values()), received[0] if received else None)
            time.sleep(POLL_S)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def log_of(m: Member, job: JobState) -> str:
    """The job log of a run's job (SLURM's %j filled in)."""
    records = [r for r in read_jobs(m.run_dir) if str(r["job_id"]) == job.job_id]
    return records[-1]["log"].replace("%j", job.job_id) if records else str(RunDir(m.run_dir).logs)
