"""A SLURM batch job: an sbatch script of directives and the supervisor, ``python -m
launch.supervise slurm RUN_DIR/config.yaml``, under a batch shell that holds the job's stop
signals for it from its first command (:func:`supervisor_lines`).

The supervisor (launch/supervise.py, launch/slurm/allocation.py) does inside the allocation what
moe-launch does on one machine, with the same restart policy: it finds rank 0's address, builds
DeepSpeed's op, starts one task per rank with srun, restarts a failed srun step in the same
allocation (``launch.max_restarts``, never the same failure twice, never a failure no restart can
fix), requeues the job after a preemption (which resumes from its checkpoint) and evaluates the
finished run on one task (``launch.finish``). Before the time limit SLURM sends the supervisor
SIGUSR1 (``--signal=B:USR1@N``), which it passes on to the ranks: they save at the next step
boundary and exit 75. docs/launching.md lists what each signal does.

Quoting: the supervisor's command line goes through shlex.quote. ``#SBATCH`` lines are read by sbatch,
not by a shell; their values are double-quoted for sbatch's own tokenizer, and anything that
would break the line (a newline) is refused by the config checks.
"""

from __future__ import annotations

import re
import shlex
import signal
import sys
from pathlib import Path

from launch.run_plan import RESOLVED_CONFIG, Plan
from launch.signal_latch import HELD_SIGNALS_ENV
from moe.config.launch import SlurmConfig
from moe.config.run import RunConfig
from moe.core.errors import ConfigError
from moe.core.run_dir import RunDir

JOB_SCRIPT = "job.sbatch"
HELD = ("USR1", "USR2", "TERM")
"""The stop signals the job script holds for the supervisor (launch.signal_latch.CATCHABLE)."""


def job_log(cfg: RunConfig, run_dir: Path) -> str:
    """The job log path as given to sbatch (SLURM fills in %j and friends)."""
    return cfg.launch.slurm.output or str(RunDir(run_dir).logs / "slurm-%j.out")


def sbatch_directive(option: str, value: object = None) -> str:
    """One ``#SBATCH`` line. sbatch reads these itself, not through a shell: its tokenizer splits
    on blanks and ``#`` unless they are inside double quotes, where ``\\"`` and ``\\\\`` are the
    escapes; no expansion of ``$`` or backquotes happens there (checked with SLURM 22.05)."""
    if value is None:
        return f"#SBATCH {option}"
    if re.fullmatch(r"[A-Za-z0-9_./:@%=,+-]+", str(value)):
        return f"#SBATCH {option}={value}"
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'#SBATCH {option}="{text}"'


def site_directives(s: SlurmConfig) -> list[tuple[str, object]]:
    """Where and how long any job of the run may run: time limit, partition, account."""
    return [
        (f"--{key}", getattr(s, key))
        for key in ("time", "partition", "account")
        if getattr(s, key) is not None
    ]


def extra_directives(s: SlurmConfig) -> list[str]:
    return [f"#SBATCH {d}" for d in s.extra_sbatch]  # the user's own sbatch syntax


def env_exports(cfg: RunConfig, extra: dict[str, str] | None = None) -> list[str]:
    """``export`` lines for unbuffered Python output and the config's launch.env."""
    env = {"PYTHONUNBUFFERED": "1", **cfg.launch.env, **(extra or {})}
    return [f"export {k}={shlex.quote(v)}" for k, v in env.items()]


def job_script(cfg: RunConfig, run_dir: Path, cwd: Path, evaluate: bool = True) -> str:
    """Directives, then the supervisor (launch/supervise.py), which does the rest with the
    restart policy every scheduler shares."""
    s = cfg.launch.slurm
    q = shlex.quote
    directives = [
        ("--job-name", s.job_name or cfg.name),
        ("--nodes", s.nodes),
        ("--ntasks-per-node", cfg.parallel.world_size // s.nodes),
        ("--cpus-per-task", s.cpus_per_task),
    ]
    if s.gpus_per_node:
        directives.append(("--gpus-per-node", s.gpus_per_node))
    directives += site_directives(s)
    directives += [
        ("--output", job_log(cfg, run_dir)),
        ("--open-mode", "append"),
        ("--chdir", str(cwd)),
    ]
    if s.signal_seconds:
        # B: to the batch shell alone, which hands it to the supervisor; that one passes it on
        # to srun once the ranks run, and holds it (no rank started, requeue) before: a signal
        # to the whole step would also reach what a rank runs below it, such as a compiler.
        directives.append(("--signal", f"B:USR1@{s.signal_seconds}"))
    directives.append(("--requeue" if s.requeue else "--no-requeue", None))
    lines = [
        "#!/bin/bash",
        f"# Written by moe-launch for run {cfg.name!r}; resubmit with: "
        f"sbatch {q(str(run_dir / JOB_SCRIPT))}".replace("\n", " "),
    ]
    lines += [sbatch_directive(*d) for d in directives]
    lines += extra_directives(s)
    supervise = [
        sys.executable,
        "-u",
        "-m",
        "launch.supervise",
        "slurm",
        str(run_dir / RESOLVED_CONFIG),
        *([] if evaluate else ["--no-eval"]),
    ]
    lines += supervisor_lines(" ".join(q(a) for a in supervise))
    return "\n".join(lines) + "\n"


def supervisor_lines(command: str) -> list[str]:
    """The job's commands: ``command`` (the supervisor) as a child of the batch shell, which
    holds the job's stop signals from its first command on.

    SLURM signals the batch shell (``--signal=B:...``, ``scancel --batch``), and the default
    action of USR1, USR2 or TERM would end the job FAILED, with no requeue. Python takes a
    tenth of a second to start: the shell traps the signals first, records each in a file
    (:data:`~launch.signal_latch.HELD_SIGNALS_ENV`) and, once the supervisor catches the
    signal itself (its ``SigCgt`` mask), passes it on. The supervisor reads the file after it
    catches them (launch/supervise.py), so every signal reaches it one way or the other. The
    job ends with the supervisor's exit code."""
    nums = {name: int(getattr(signal, f"SIG{name}")) for name in HELD}
    return [
        "# Stop signals are held from here on and handed to the supervisor (launch/slurm/script.py).",
        # Node-local, one file per run of the job (builtins only: nothing slow before the trap).
        'moe_held=${TMPDIR:-/tmp}; [ -d "$moe_held" ] && [ -w "$moe_held" ] || moe_held=/tmp',
        "moe_held=$moe_held/moe_held_signals.${SLURM_JOB_ID:-0}.$$",
        # Whether process $1 catches signal number $2 (/proc/PID/status, SigCgt).
        'moe_catches() { local key mask; while read -r key mask; do [ "$key" = SigCgt: ] && '
        'return $(( (16#$mask >> ($2 - 1) & 1) == 0 )); done <"/proc/$1/status"; return 1; } '
        "2>/dev/null",
        # $! is the supervisor once it started (empty before).
        'moe_signal() { echo "$1" >>"$moe_held"; [ -n "$!" ] && moe_catches "$!" "$2" && '
        'kill -s "$1" "$!" 2>/dev/null; }',
        "; ".join(f"trap 'moe_signal {name} {num}' {name}" for name, num in nums.items()),
        f'{HELD_SIGNALS_ENV}="$moe_held" {command} &',
        # A trapped signal ends wait early; the supervisor's end ends the loop.
        'while wait "$!"; moe_rc=$?; kill -0 "$!" 2>/dev/null; do :; done',
        # Its status again, should a signal have ended the wait just as it ended (127: the
        # shell keeps no status of a process already waited for).
        'wait "$!" 2>/dev/null; moe_last=$?; [ "$moe_last" -eq 127 ] || moe_rc=$moe_last',
        'rm -f "$moe_held"',
        'exit "$moe_rc"',
    ]


def plan(cfg: RunConfig, run_dir: Path, evaluate: bool = True) -> Plan:
    s = cfg.launch.slurm
    problems = []
    if cfg.parallel.world_size % s.nodes:
        problems.append(
            f"parallel.world_size: {cfg.parallel.world_size} ranks cannot be spread "
            f"evenly over launch.slurm.nodes ({s.nodes})"
        )
    if s.output is None and ("%" in str(run_dir) or "\\" in str(run_dir)):
        problems.append(
            f"output_dir: {str(run_dir)!r} holds '%' or '\\', which SLURM "
            f"interprets in the job log path; set launch.slurm.output or use "
            f"another directory"
        )
    if "\n" in str(run_dir) or "\n" in cfg.name:
        problems.append("output_dir/name: a line break cannot appear in a job script line")
    if problems:
        raise ConfigError(problems)
    script = job_script(cfg, run_dir, Path.cwd(), evaluate)
    return Plan(
        "slurm",
        ["sbatch", "--parsable", str(run_dir / JOB_SCRIPT)],
        str(run_dir),
        cfg.parallel.world_size,
        nodes=s.nodes,
        files={JOB_SCRIPT: script},
        submits=True,
    )
