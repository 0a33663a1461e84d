"""moe-prepare CONFIG --slurm-parts N: the three steps of a preparation on many machines as
SLURM jobs. The tokenizer job runs first; an array job of N tasks (task i runs ``--part i/N``)
starts once it succeeded; the merge job once every task did (``--dependency=afterok``).

The jobs read a snapshot of the resolved config, written with their scripts, job logs and the
job records (``slurm_jobs.json``, what ``moe-launch status`` reads) into ``<data.dir>.slurm``,
beside the data: editing the config file after submitting changes nothing in the queued jobs.
Values in the scripts go through shlex.quote; ``#SBATCH`` values through
:func:`~launch.slurm.script.sbatch_directive`.
"""

from __future__ import annotations

import dataclasses
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from data_pipeline.errors import DataError
from data_pipeline.parts import parts_dir
from data_pipeline.write_errors import FileSnapshot, writing
from launch.run_plan import RESOLVED_CONFIG, Plan
from launch.slurm.checks import check_submission
from launch.slurm.jobs import query, read_jobs, record_submission
from launch.slurm.script import (
    JOB_SCRIPT,
    env_exports,
    extra_directives,
    sbatch_directive,
    site_directives,
)
from moe.config.run import RunConfig, dump_config
from moe.core.errors import ConfigError, LaunchError
from moe.core.fileio import write_atomic

STEPS = ("tokenizer", "parts", "merge")


@dataclass
class PrepareJobs:
    """The three job scripts and where they, the config snapshot and the logs go."""

    job_dir: Path
    scripts: dict[str, str]
    """Step name -> script text, in submission order."""
    logs: dict[str, str]
    """Step name -> job log path as given to sbatch (SLURM fills in %j, %A, %a)."""

    def sbatch(self, step: str, after: str | None) -> list[str]:
        """The sbatch command line of ``step``; ``after``: the job id it waits for."""
        dependency = [f"--dependency=afterok:{after}"] if after else []
        return ["sbatch", "--parsable", *dependency, str(self.job_dir / f"{step}.sbatch")]

    def render(self) -> str:
        parts = []
        for step, text in self.scripts.items():
            parts.append(f"# file {self.job_dir / f'{step}.sbatch'}:\n{text.rstrip()}")
        parts.append("# commands (each waits for the job id the one before printed):")
        previous = None
        for step in STEPS:
            parts.append(shlex.join(self.sbatch(step, previous)))
            previous = f"<{step} job id>"
        return "\n".join(parts)


def is_prepare_dir(path: Path) -> bool:
    """A directory of these jobs (not a training run's)."""
    return (path / "merge.sbatch").exists()


def job_dir_of(cfg: RunConfig) -> Path:
    parts_dir(cfg.data)  # refuses an s3:// data.dir, saying why
    return Path(str(Path(cfg.data.dir).absolute()) + ".slurm")


def build(cfg: RunConfig, count: int, force: bool = False) -> PrepareJobs:
    if count < 1:
        raise ConfigError([f"--slurm-parts: the number of parts must be at least 1, got {count}"])
    job_dir = job_dir_of(cfg)
    problems = []
    if "%" in str(job_dir) or "\\" in str(job_dir):
        problems.append(
            f"data.dir: {str(job_dir)!r} holds '%' or '\\', which SLURM interprets "
            "in job log paths; prepare into another directory"
        )
    if any(c in str(job_dir) for c in "\n\r\0"):
        problems.append("data.dir: a line break cannot appear in a job script line")
    if problems:
        raise ConfigError(problems)
    s = cfg.launch.slurm
    config = shlex.quote(str(job_dir / RESOLVED_CONFIG))
    prepare = f"{shlex.quote(sys.executable)} -u -m launch.prepare {config}"
    name = s.job_name or cfg.name
    logs = {
        "tokenizer": str(job_dir / "logs" / "tokenizer-%j.out"),
        "parts": str(job_dir / "logs" / "part-%A_%a.out"),
        "merge": str(job_dir / "logs" / "merge-%j.out"),
    }
    steps = {
        "tokenizer": ([], f"{prepare} --tokenizer-only"),
        "parts": (
            [("--array", f"0-{count - 1}")],
            f'{prepare} --part "$SLURM_ARRAY_TASK_ID/{count}"',
        ),
        "merge": ([], f"{prepare} --merge" + (" --force" if force else "")),
    }
    scripts = {}
    for step, (directives, command) in steps.items():
        lines = [
            "#!/bin/bash",
            f"# Written by moe-prepare --slurm-parts {count}: data preparation, {step}",
        ]
        lines += [
            sbatch_directive(*d)
            for d in [
                ("--job-name", f"{name}-prepare-{step}"),
                ("--nodes", 1),
                ("--ntasks", 1),
                ("--cpus-per-task", cfg.data.prepare_workers),
                *site_directives(s),
                *directives,
                ("--output", logs[step]),
                ("--open-mode", "append"),
            ]
        ]
        lines += extra_directives(s)
        lines += [
            "set -euo pipefail",
            f"cd {shlex.quote(str(Path.cwd()))}",
            *env_exports(cfg),
            command,
        ]
        scripts[step] = "\n".join(lines) + "\n"
    return PrepareJobs(job_dir, scripts, logs)


def submit(cfg: RunConfig, jobs: PrepareJobs) -> dict[str, str]:
    """Check the three jobs with SLURM, write the scripts and the config snapshot, submit the
    jobs chained, record them; the job id of each step. Until a job is submitted, a failure
    leaves the job directory as it was."""
    if shutil.which("sbatch") is None:
        raise LaunchError(
            "'sbatch' not found on PATH: --slurm-parts submits SLURM jobs from "
            "this host (--dry-run prints them without it)"
        )
    for record in read_jobs(jobs.job_dir):
        job = query(str(record["job_id"]), jobs.job_dir)
        if job.active:
            raise LaunchError(
                f"{jobs.job_dir}: job {job.job_id} of an earlier submission is "
                f"{job.state}; cancel it (moe-launch cancel {job.job_id}) or wait"
            )
    shape = _job_shape(cfg)
    for text in jobs.scripts.values():  # SLURM's own verdict, before anything is written
        check_submission(
            shape, Plan("slurm", ["sbatch"], str(jobs.job_dir), 1, files={JOB_SCRIPT: text})
        )
    made = [d for d in (jobs.job_dir, jobs.job_dir / "logs") if not d.exists()]
    kept = FileSnapshot(
        [jobs.job_dir / RESOLVED_CONFIG, *(jobs.job_dir / f"{s}.sbatch" for s in STEPS)]
    )
    ids: dict[str, str] = {}
    try:
        with writing(jobs.job_dir):
            write_atomic(jobs.job_dir / RESOLVED_CONFIG, dump_config(cfg))
            (jobs.job_dir / "logs").mkdir(exist_ok=True)  # SLURM does not create a log's directory
            for step, text in jobs.scripts.items():
                write_atomic(jobs.job_dir / f"{step}.sbatch", text)
            _submit_chain(jobs, ids)
    except BaseException as e:
        if ids:  # the queued jobs read their scripts and the config snapshot: both stay
            if not isinstance(e, Exception):
                raise
            listed = ", ".join(f"{k} {v}" for k, v in ids.items())
            raise LaunchError(
                f"{e}; jobs already submitted: {listed}; they stay queued, their scripts and "
                f"config in {jobs.job_dir}: cancel them (scancel {' '.join(ids.values())}) "
                "before submitting again"
            ) from e
        kept.restore()
        if made:
            shutil.rmtree(made[0], ignore_errors=True)
        if isinstance(e, (LaunchError, DataError)):
            raise type(e)(f"{e}; no job was submitted, {jobs.job_dir} is as it was") from e
        raise
    return ids


def _submit_chain(jobs: PrepareJobs, ids: dict[str, str]) -> None:
    """Submit the steps in order, each after the one before; ``ids`` gains each job's id as
    soon as SLURM took it (before it is recorded)."""
    previous = None
    for step in STEPS:
        command = jobs.sbatch(step, previous)
        proc = subprocess.run(command, capture_output=True, text=True)
        job_id = proc.stdout.strip().split(";")[0]
        if proc.returncode != 0 or not job_id.isdigit():
            raise LaunchError(
                f"sbatch refused the {step} job (exit code {proc.returncode}): "
                f"{proc.stderr.strip() or proc.stdout.strip()}"
            )
        ids[step] = previous = job_id
        record_submission(jobs.job_dir, job_id, command[-1], jobs.logs[step])


def _job_shape(cfg: RunConfig) -> RunConfig:
    """``cfg`` as SLURM sees each preparation job: one task on one node, with
    data.prepare_workers CPUs and no GPU (what check_submission compares with the partition)."""
    s = dataclasses.replace(
        cfg.launch.slurm, nodes=1, cpus_per_task=cfg.data.prepare_workers, gpus_per_node=0
    )
    return dataclasses.replace(
        cfg,
        launch=dataclasses.replace(cfg.launch, slurm=s),
        parallel=dataclasses.replace(cfg.parallel, world_size=1),
    )


def watch_lines(jobs: PrepareJobs, ids: dict[str, str]) -> list[str]:
    q = shlex.quote
    return [
        f"submitted SLURM jobs: tokenizer {ids['tokenizer']}, parts {ids['parts']} "
        f"(array), merge {ids['merge']}",
        f"job files       {jobs.job_dir}",
        f"watch           squeue -j {','.join(ids.values())}",
        f"status          moe-launch status {q(str(jobs.job_dir))}   (the merge job)",
        f"logs            {jobs.job_dir / 'logs'}",
        f"cancel          scancel {' '.join(ids.values())}",
    ]
