"""What local and hostfile launches start once per rank: the training entry point
(``launch.train``) as a child process, and a record of how it ended.

DeepSpeed's launcher and mpiexec report one exit code and never which rank failed, and a rank
killed by a signal cannot say anything itself. Its parent can: when the rank ends, this process
appends one JSON line (rank, pid, exit code or signal, time) to
``RUN_DIR/logs/exits_rank{R}.jsonl``, from which moe-launch names the failing rank in its
restart line (launch/restarts.py), then exits with the rank's exit code (128 + N for signal N).
Signals it receives (USR1, USR2, TERM, INT) are passed on to the rank (in an srun step, SLURM
signals the rank itself, so only those that came before the rank started). When the moe-launch
that started it is gone (killed), it kills the rank (launch/launcher_watch.py). Standard library
only, so that it starts at once and holds signals from its first instructions.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from launch.launcher_watch import die_with_parent, end_with_launcher
from launch.signal_latch import CATCHABLE

FORWARDED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
STOP_WITHIN_S = 2.0
"""How long the training process has to stop itself once moe-launch is gone."""


def exits_file(logs_dir: Path, rank: int) -> Path:
    return Path(logs_dir) / f"exits_rank{rank}.jsonl"


def rank_of(env: dict) -> int:
    """This rank's number from whichever launcher started it, in the order of
    launch/rank_env.py (which the training process reads; this module stays standard library
    only): torch/DeepSpeed's RANK, Open MPI, MPICH/Hydra and Intel MPI, then SLURM's srun."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"])
    for key in ("OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if key in env:
            return int(env[key])
    return int(env.get("SLURM_PROCID", "0")) if "SLURM_STEP_ID" in env else 0


def exit_record(rank: int, pid: int, returncode: int) -> dict:
    """How rank ``rank`` (process ``pid``) ended; ``returncode`` as subprocess reports it
    (negative: killed by that signal)."""
    if returncode < 0:
        return {
            "rank": rank,
            "pid": pid,
            "returncode": None,
            "signal": signal.Signals(-returncode).name,
            "time": time.time(),
        }
    return {"rank": rank, "pid": pid, "returncode": returncode, "signal": None, "time": time.time()}


def start_training(argv: list[str]) -> subprocess.Popen:
    """``python -m launch.train ARGV`` started with the preemption signals (``CATCHABLE``)
    blocked. An srun step signals every process of the step at once: one that reaches the
    training process before its first instruction stays pending until its latch is installed
    and unblocks them (launch/signal_latch.py), instead of ending it with the default action
    while the interpreter starts. The mask is inherited through fork and exec; this process's
    own is restored at once (a signal that came meanwhile runs its handler then). It is killed
    if this process is (launch/launcher_watch.py), which would otherwise leave it orphaned."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, CATCHABLE)
    try:
        return subprocess.Popen(
            [sys.executable, "-u", "-m", "launch.train", *argv],
            preexec_fn=die_with_parent(signal.SIGKILL),
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def end_child(child: subprocess.Popen) -> None:
    """moe-launch is gone: the training process says so in its log and stops itself
    (launch/train.py); killed here if it has not within :data:`STOP_WITHIN_S`."""
    deadline = time.monotonic() + STOP_WITHIN_S
    while child.returncode is None and time.monotonic() < deadline:  # the main thread reaps it
        time.sleep(0.05)
    if child.returncode is None:
        child.kill()


def main(argv: list[str]) -> int:
    child: subprocess.Popen | None = None
    held: list[int] = []

    # In an srun step SLURM signals every process of the step, the rank too: passing a signal on
    # would deliver it twice (and a second TERM ends a rank at once, unsaved).
    in_step = "SLURM_STEP_ID" in os.environ

    def forward(signum, frame) -> None:
        if child is None:
            held.append(signum)
        elif not in_step:
            try:
                child.send_signal(signum)
            except ProcessLookupError:
                pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    rank = rank_of(os.environ)
    config = argv[argv.index("--config") + 1] if "--config" in argv else None
    child = start_training(argv)
    for signum in held:
        child.send_signal(signum)

    end_with_launcher(lambda pid: end_child(child))
    rc = child.wait()  # signal handlers run while it waits (PEP 475 retries the wait)
    if config is not None:
        record = exit_record(rank, child.pid, rc)
        path = exits_file(Path(config).parent / "logs", rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
