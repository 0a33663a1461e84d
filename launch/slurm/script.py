"""A SLURM batch job: an sbatch script that starts one task per rank with srun.

The script finds rank 0's node in the allocation and uses the address SLURM itself knows it by
(its ``NodeAddr``), not the submitting host or a hostname that may resolve to loopback; it derives
the rendezvous port from the job id so that jobs sharing a node do not collide. srun exports
SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID to each task, which the entry point maps to rank and world
size. Before the time limit SLURM sends the ranks SIGUSR1; they save a checkpoint at the next step
boundary and leave a marker, and the script then requeues the job, which resumes from it. Once
training has finished, the script evaluates the final checkpoint on one task of the allocation
(``launch.finish``, what moe-launch runs after a local run).

Quoting: values in the script body go through shlex.quote. ``#SBATCH`` lines are read by sbatch,
not by a shell; their values are double-quoted for sbatch's own tokenizer, and anything that
would break the line (a newline) is refused by the config checks.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from launch.plan import RESOLVED_CONFIG, Plan, entry_point
from launch.slurm.jobs import ENDS_FILE
from moe.errors import ConfigError
from moe.training.config import RunConfig
from moe.training.launch_config import SlurmConfig
from moe.training.preemption import PREEMPTED_MARKER

JOB_SCRIPT = "job.sbatch"


def job_log(cfg: RunConfig, run_dir: Path) -> str:
    """The job log path as given to sbatch (SLURM fills in %j and friends)."""
    return cfg.launch.slurm.output or str(run_dir / "logs" / "slurm-%j.out")


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
    return [(f"--{key}", getattr(s, key)) for key in ("time", "partition", "account")
            if getattr(s, key) is not None]


def extra_directives(s: SlurmConfig) -> list[str]:
    return [f"#SBATCH {d}" for d in s.extra_sbatch]  # the user's own sbatch syntax


def env_exports(cfg: RunConfig, extra: dict[str, str] | None = None) -> list[str]:
    """``export`` lines for unbuffered Python output and the config's launch.env."""
    env = {"PYTHONUNBUFFERED": "1", **cfg.launch.env, **(extra or {})}
    return [f"export {k}={shlex.quote(v)}" for k, v in env.items()]


def job_script(cfg: RunConfig, run_dir: Path, cwd: Path, evaluate: bool = True) -> str:
    s = cfg.launch.slurm
    world = cfg.parallel.world_size
    per_node = world // s.nodes
    q = shlex.quote
    output = job_log(cfg, run_dir)
    directives = [("--job-name", s.job_name or cfg.name), ("--nodes", s.nodes),
                  ("--ntasks-per-node", per_node), ("--cpus-per-task", s.cpus_per_task)]
    if s.gpus_per_node:
        directives.append(("--gpus-per-node", s.gpus_per_node))
    directives += site_directives(s)
    directives += [("--output", output), ("--open-mode", "append")]
    if s.signal_seconds:
        directives.append(("--signal", f"USR1@{s.signal_seconds}"))
    directives.append(("--requeue" if s.requeue else "--no-requeue", None))
    lines = ["#!/bin/bash", f"# Written by moe-launch for run {cfg.name!r}; resubmit with: "
                            f"sbatch {q(str(run_dir / JOB_SCRIPT))}".replace("\n", " ")]
    lines += [sbatch_directive(*d) for d in directives]
    lines += extra_directives(s)
    lines += ["set -euo pipefail",
              # SLURM may signal this shell alone (--signal=B:..., scancel --batch): hold a
              # signal until srun runs, then pass it on to srun, which hands it to every rank.
              # bash runs a trap only between commands, so srun runs in the background and the
              # script waits for it, again after each trap.
              "srun_pid=",
              "held=",
              'forward() { if [ -n "$srun_pid" ]; then kill -s "$1" "$srun_pid" 2>/dev/null '
              '|| true; else held=$1; fi; }',
              "trap 'forward USR1' USR1",
              "trap 'forward TERM' TERM",
              f"cd {q(str(cwd))}"]
    env = {}
    if s.socket_ifname:
        env |= {"GLOO_SOCKET_IFNAME": s.socket_ifname, "NCCL_SOCKET_IFNAME": s.socket_ifname}
    lines += env_exports(cfg, env)
    port = (str(s.master_port) if s.master_port is not None else
            "$(( 15000 + (SLURM_JOB_ID % 3750) * 4 + (${SLURM_RESTART_COUNT:-0} + restarts) % 4 ))")
    marker = q(str(run_dir / PREEMPTED_MARKER))
    srun = ["srun", f"--ntasks={world}", f"--ntasks-per-node={per_node}",
            f"--cpus-per-task={s.cpus_per_task}", "--kill-on-bad-exit=1", "--label",
            *s.srun_args, *entry_point(run_dir / RESOLVED_CONFIG)]
    latest_file = q(str(run_dir / "checkpoints" / "latest"))
    lines += [
        "# Rank 0 runs on the allocation's first node; reach it by the address SLURM uses for it.",
        'nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        'master_node=${nodes%%$\'\\n\'*}',
        "MASTER_ADDR=$(scontrol show node \"$master_node\" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')",
        'export MASTER_ADDR=${MASTER_ADDR:-$master_node}',
        "newest_step() {  # the step of the newest checkpoint (0: none)",
        f"  local latest; latest=$(cat {latest_file} 2>/dev/null || true)",
        "  latest=${latest##*_}",
        "  case $latest in ''|*[!0-9]*) latest=0;; esac",
        "  echo $(( 10#$latest ))",
        "}",
        # A failed srun step is started again inside this allocation (launch.max_restarts):
        # no wait in the queue, the same nodes. srun --kill-on-bad-exit ends every task once
        # one fails. Requeueing stays for preemption, which is not a failure.
        "restarts=0",
        "previous=",
        "while :; do",
        f"  export MASTER_PORT={port}",
        f'  echo "job $SLURM_JOB_ID (restart ${{SLURM_RESTART_COUNT:-0}}, attempt '
        f'$(( restarts + 1 ))): {world} ranks, master $MASTER_ADDR:$MASTER_PORT"',
        f"  rm -f {marker}",
        "  started=$(date +%s)",
        "  resumed=$(newest_step)",
        # A signal before srun starts: no rank has started, so there is nothing to save.
        '  if [ -n "$held" ]; then',
        f"""    printf '{{"step": null, "signal": "%s"}}\\n' "$held" > {marker}""",
        "  else",
        "    " + " ".join(q(a) for a in srun) + " &",
        "    srun_pid=$!",
        "  fi",
        "  status=0",
        '  if [ -n "$srun_pid" ]; then',
        '    while kill -0 "$srun_pid" 2>/dev/null; do wait "$srun_pid" || true; done',
        '    wait "$srun_pid" || status=$?',
        "  fi",
        "  srun_pid=",
        # Preempted: the ranks saved (or had nothing to save yet) and exited 75 on purpose.
        # srun reports that as "Exited with exit code 75"; say what it means right below it.
        f"  if [ -e {marker} ]; then",
        f"""    step=$(sed -n 's/.*"step": *\\([0-9][0-9]*\\).*/\\1/p' {marker})""",
        '    if [ -z "$step" ]; then  # signalled before the first step: the newest checkpoint',
        "      step=$(newest_step)",
        "    fi",
        f'    echo "preemption signal ($(cat {marker})): the exit code 75 above is the planned '
        'exit of a preempted run, not a failure"',
    ]
    ends = q(str(run_dir / ENDS_FILE))  # for moe-launch status once SLURM forgot the job
    if s.requeue:
        lines += ['    echo "preempted, requeued, will resume from step $step (requeueing job '
                  '$SLURM_JOB_ID)"',
                  f'    printf "%s %s requeued %s\\n" "$SLURM_JOB_ID" "$status" "$step" >> {ends} '
                  "|| true",
                  '    scontrol requeue "$SLURM_JOB_ID"', "    exit 0"]
    else:
        lines += ['    echo "preempted, not requeued (launch.slurm.requeue: false): submit the '
                  'same run again to resume from step $step"', "    break"]
    # The step a failed attempt was in (launch/supervise.py reads the ranks' step records).
    failed_step = [sys.executable, "-m", "launch.supervise", str(run_dir), str(world)]
    n = cfg.launch.max_restarts
    lines += [
        "  fi",
        '  if [ "$status" -eq 0 ]; then break; fi',
        "  step=$(" + " ".join(q(a) for a in failed_step)
        + ' "$started" "$resumed" 2>/dev/null) || step=unknown',
        f'  if [ "$restarts" -ge {n} ]; then',
        f'    echo "training failed: srun exited with status $status at step $step, after '
        f'$restarts restart(s) (launch.max_restarts {n})"',
        "    break",
        "  fi",
        '  if [ "$status:$step" = "$previous" ]; then',
        '    echo "training failed the same way twice in a row: srun exited with status $status '
        'at step $step; not restarting again"',
        "    break",
        "  fi",
        '  previous="$status:$step"',
        "  restarts=$(( restarts + 1 ))",
        f'  echo "restart $restarts/{n}: srun exited with status $status at step $step (srun\'s '
        'task lines above name the failing rank); starting the step again in this allocation '
        'from the newest complete checkpoint"',
        "done",
    ]
    # Training finished: the summary, and the evaluation of the final checkpoint on one task of
    # the same allocation (the code moe-launch runs after a local run). Not after a preemption:
    # that requeued the job above, and the requeued job evaluates once it finishes.
    finish = ["srun", "--ntasks=1", "--nodes=1", f"--cpus-per-task={s.cpus_per_task}",
              sys.executable, "-u", "-m", "launch.finish", str(run_dir), *([] if evaluate else ["--no-eval"])]
    lines += ['if [ "$status" -eq 0 ]; then',
              '  echo "training finished; ' + ("evaluating the final checkpoint on one task"
                                               if evaluate else "evaluation skipped (--no-eval)")
              + '"',
              "  " + " ".join(q(a) for a in finish) + " || status=$?",
              "fi",
              f'printf "%s %s ended\\n" "$SLURM_JOB_ID" "$status" >> {ends} || true',
              'exit "$status"']
    return "\n".join(lines) + "\n"


def plan(cfg: RunConfig, run_dir: Path, evaluate: bool = True) -> Plan:
    s = cfg.launch.slurm
    problems = []
    if cfg.parallel.world_size % s.nodes:
        problems.append(f"parallel.world_size: {cfg.parallel.world_size} ranks cannot be spread "
                        f"evenly over launch.slurm.nodes ({s.nodes})")
    if s.output is None and ("%" in str(run_dir) or "\\" in str(run_dir)):
        problems.append(f"output_dir: {str(run_dir)!r} holds '%' or '\\', which SLURM "
                        f"interprets in the job log path; set launch.slurm.output or use "
                        f"another directory")
    if "\n" in str(run_dir) or "\n" in cfg.name:
        problems.append("output_dir/name: a line break cannot appear in a job script line")
    if problems:
        raise ConfigError(problems)
    script = job_script(cfg, run_dir, Path.cwd(), evaluate)
    return Plan("slurm", ["sbatch", "--parsable", str(run_dir / JOB_SCRIPT)], str(run_dir),
                cfg.parallel.world_size, nodes=s.nodes, files={JOB_SCRIPT: script}, submits=True)
