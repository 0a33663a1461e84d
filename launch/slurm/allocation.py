"""Inside a SLURM allocation: what ``python -m launch.supervise slurm`` needs besides the restart
policy. Rank 0's address and a rendezvous port, the srun command that starts one task per rank,
the DeepSpeed op built before any rank can be signalled, the job's requeue and the line the job
leaves in ``slurm_job_ends.txt`` (what ``moe-launch status`` reads once SLURM forgot the job).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from launch.launcher_watch import ENV as WATCH_ENV
from launch.slurm.jobs import ENDS_FILE
from moe.config.run import SIGNALS, RunConfig

ENDING_STATES = ("CANCELLED", "TIMEOUT", "DEADLINE", "COMPLETING")
"""Job states in which SLURM itself is ending the job (see Allocation.ended_state)."""

SAVE_SIGNAL = signal.SIGUSR1
"""What the supervisor sends srun when the job is told to stop (USR1, USR2 or TERM reaching the
batch step). srun hands USR1 to every task as it is; TERM it would turn into SIGKILL."""
HELD_BY_BUILD = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
POLL_S = 0.5
"""How often a wait for the build looks at the supervisor's signals."""
STALE_LOCK_S = 600
"""A torch-extensions build lock older than this, with no build running, is left by a dead
build (a compile takes well under a minute here)."""


def scontrol(*args: str) -> str:
    proc = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)
    return proc.stdout if proc.returncode == 0 else ""


def master_address(nodelist: str) -> str:
    """Rank 0 runs on the allocation's first node: reach it by the address SLURM itself uses
    for it (its ``NodeAddr``), not a hostname that may resolve to loopback."""
    first = scontrol("show", "hostnames", nodelist).split()
    node = first[0] if first else nodelist
    for token in scontrol("show", "node", node).split():
        if token.startswith("NodeAddr="):
            return token.split("=", 1)[1]
    return node


@dataclass
class Allocation:
    """This job's allocation and the run it trains."""

    cfg: RunConfig
    config_path: Path
    job_id: str
    requeues: int
    """SLURM_RESTART_COUNT: how often the job was requeued before this run."""
    master_addr: str
    ended: bool = field(default=False, init=False)
    """Whether this run of the job has recorded how it ended (:meth:`record_end`)."""

    @classmethod
    def from_environment(cls, cfg: RunConfig, config_path: Path) -> Allocation:
        env = os.environ
        return cls(
            cfg,
            config_path,
            env.get("SLURM_JOB_ID", "0"),
            int(env.get("SLURM_RESTART_COUNT", "0") or 0),
            master_address(env.get("SLURM_JOB_NODELIST", "localhost")),
        )

    @property
    def run_dir(self) -> Path:
        return self.config_path.parent

    def port(self, attempt: int) -> int:
        """Derived from the job id so that jobs sharing a node do not collide, and moved on with
        every attempt so that a restart never waits for the last one's sockets."""
        s = self.cfg.launch.slurm
        if s.master_port is not None:
            return s.master_port
        return 15000 + (int(self.job_id) % 3750) * 4 + (self.requeues + attempt) % 4

    def env(self, attempt: int) -> dict[str, str]:
        s = self.cfg.launch.slurm
        extra = {"PYTHONUNBUFFERED": "1", **self.cfg.launch.env}
        if s.socket_ifname:
            extra |= {"GLOO_SOCKET_IFNAME": s.socket_ifname, "NCCL_SOCKET_IFNAME": s.socket_ifname}
        # The ranks of a job are watched by SLURM, not by a moe-launch that submitted it.
        own = {k: v for k, v in os.environ.items() if k != WATCH_ENV}
        return {
            **own,
            **extra,
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.port(attempt)),
        }

    def header(self, attempt: int) -> str:
        return (
            f"job {self.job_id} (restart {self.requeues}, attempt {attempt + 1}): "
            f"{self.cfg.parallel.world_size} ranks, master {self.master_addr}:"
            f"{self.port(attempt)}"
        )

    def srun(self) -> list[str]:
        """One task per rank, each the rank wrapper (launch/rank.py: it records how the rank
        ended, so the restart line names it). The ranks save on USR1 and TERM whatever
        ``checkpoint.save_on_signals`` says: SLURM's time-limit warning and the supervisor send
        USR1, a grace-time preemption and ``scancel --signal=TERM`` send TERM to the tasks."""
        s, world = self.cfg.launch.slurm, self.cfg.parallel.world_size
        saved = list(dict.fromkeys([*self.cfg.checkpoint.save_on_signals, "USR1", "TERM"]))
        assert all(name in SIGNALS for name in saved)
        return [
            "srun",
            f"--ntasks={world}",
            f"--ntasks-per-node={world // s.nodes}",
            f"--cpus-per-task={s.cpus_per_task}",
            "--kill-on-bad-exit=1",
            "--label",
            *s.srun_args,
            sys.executable,
            "-u",
            "-m",
            "launch.rank",
            "--config",
            str(self.config_path),
            f"checkpoint.save_on_signals=[{', '.join(saved)}]",
        ]

    def finish(self, evaluate: bool) -> list[str]:
        """The finished run's summary and evaluation, on one task of the allocation."""
        return [
            "srun",
            "--ntasks=1",
            "--nodes=1",
            f"--cpus-per-task={self.cfg.launch.slurm.cpus_per_task}",
            sys.executable,
            "-u",
            "-m",
            "launch.finish",
            str(self.run_dir),
            *([] if evaluate else ["--no-eval"]),
        ]

    def record_end(self, status: int, requeued_step: int | None = None) -> None:
        """``JOB STATUS requeued STEP`` or ``JOB STATUS ended`` (launch/slurm/jobs.py)."""
        self.ended = True
        line = (
            f"{self.job_id} {status} requeued {requeued_step}"
            if requeued_step is not None
            else f"{self.job_id} {status} ended"
        )
        try:
            with (self.run_dir / ENDS_FILE).open("a") as f:
                f.write(line + "\n")
        except OSError as e:  # a full or read-only disk must not hide how the job ended
            print(f"could not record the job's end in {self.run_dir / ENDS_FILE}: {e}", flush=True)

    def ended_state(self) -> str | None:
        """SLURM's state for this job when SLURM itself is ending it (CANCELLED, TIMEOUT,
        DEADLINE, or COMPLETING: scontrol shows a cancelled job whose steps are still ending
        as COMPLETING, and this batch step, still running, has not completed it): the TERM
        that reached the job was a cancel or the time limit, not a preemption to requeue
        after. None while the job runs on."""
        for token in scontrol("show", "job", self.job_id).split():
            if token.startswith("JobState="):
                state = token.split("=", 1)[1]
                return state if state in ENDING_STATES else None
        return None

    def requeue(self) -> bool:
        proc = subprocess.run(
            ["scontrol", "requeue", self.job_id], capture_output=True, text=True, timeout=60
        )
        # The requeue ends this batch step, scontrol included: killed by a signal, it worked.
        if proc.returncode > 0:
            print(
                f"scontrol requeue {self.job_id} failed: {proc.stderr.strip()} (a cancelled "
                f"job, or one past its time limit, cannot be requeued)",
                flush=True,
            )
        return proc.returncode <= 0


def ignore_stop_signals() -> None:
    """In a build child: the signals that stop a job are ignored, and so by the compiler and
    linker it starts (an ignored signal stays ignored across exec)."""
    for signum in HELD_BY_BUILD:
        signal.signal(signum, signal.SIG_IGN)


def orphan_build_locks(extensions_dir: Path, now: float | None = None) -> list[tuple[Path, float]]:
    """Build locks under ``extensions_dir`` (torch's ``FileBaton`` files, ``NAME/lock``) with no
    live process of this node building there, each with its age in seconds."""
    now = time.time() if now is None else now
    # ROOT/NAME/lock under TORCH_EXTENSIONS_DIR, ROOT/py311_cpu/NAME/lock under the default.
    locks = []
    for lock in [*extensions_dir.glob("*/lock"), *extensions_dir.glob("*/*/lock")]:
        try:
            locks.append((lock, now - lock.stat().st_mtime))
        except FileNotFoundError:  # its build just finished
            continue
    if not locks:
        return []
    building = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        building.add(Path(cwd))
    return [(lock, age) for lock, age in locks if lock.parent not in building]


def build_lock_problems(extensions_dir: Path, now: float | None = None) -> list[Path]:
    """The build locks under ``extensions_dir`` that a dead build left: older than
    :data:`STALE_LOCK_S` and no live process building there (a build on another node sharing
    the directory, which this node cannot see, takes well under that)."""
    return [lock for lock, age in orphan_build_locks(extensions_dir, now) if age > STALE_LOCK_S]


def extensions_dir(env: dict[str, str]) -> Path:
    """Where torch builds its JIT extensions in a process with environment ``env`` (the ranks':
    ``launch.env`` may set TORCH_EXTENSIONS_DIR): TORCH_EXTENSIONS_DIR, else its cache
    default."""
    if env.get("TORCH_EXTENSIONS_DIR"):
        return Path(env["TORCH_EXTENSIONS_DIR"])
    cache = Path(env.get("XDG_CACHE_HOME") or Path(env.get("HOME") or Path.home()) / ".cache")
    return cache / "torch_extensions"


def clear_stale_build_locks(root: Path) -> list[Path]:
    """Remove the locks a dead build left under ``root`` and name them on the job log: torch
    waits on such a lock forever, saying nothing. A younger lock with no build on this node is
    named, not removed (another node may be building there)."""
    cleared = []
    for lock, age in orphan_build_locks(root) if root.is_dir() else []:
        if age > STALE_LOCK_S:
            print(
                f"removing a stale torch-extensions build lock {lock} (older than "
                f"{STALE_LOCK_S // 60} minutes, no build running there): a build that died "
                f"left it, and every start would wait on it forever",
                flush=True,
            )
            lock.unlink(missing_ok=True)
            cleared.append(lock)
        else:
            print(
                f"a torch-extensions build lock {lock} ({age:.0f} s old) has no build running "
                f"on this node: the ranks wait until it is gone. If no other node is building "
                f"there, a build died and left it: remove it (it is removed here once older "
                f"than {STALE_LOCK_S // 60} minutes)",
                flush=True,
            )
    return cleared


OP_NAME = "deepspeed_shm_comm"


def op_built(env: dict[str, str]) -> bool:
    """Whether the op is built where the ranks (environment ``env``) look for it and no build of
    it is under way (a lock): then the ranks only load it, and starting Python to ask DeepSpeed
    (seconds) is skipped."""
    import torch

    if torch.version.cuda is not None or torch.version.hip is not None:
        return True  # DeepSpeed builds this op only for its CPU accelerator
    root = extensions_dir(env)
    if not env.get("TORCH_EXTENSIONS_DIR"):
        root = root / f"py{sys.version_info.major}{sys.version_info.minor}{sys.abiflags}_cpu"
    return (root / OP_NAME / f"{OP_NAME}.so").is_file() and not (root / OP_NAME / "lock").exists()


BUILD_OP = "from deepspeed.comm.torch import build_shm_op\nbuild_shm_op()\n"


def build_ops(
    env: dict[str, str], timeout: float = 1800, tick: Callable[[], None] | None = None
) -> int:
    """Build DeepSpeed's JIT communication op once, before srun starts any rank, in a child
    whose compilers ignore the job's stop signals: a signal that reaches the whole step (SLURM's
    time-limit warning) can no longer kill a compiler and leave a half-built op and its lock.
    Returns the build's exit code (nonzero: the ranks build it themselves, as before).
    ``env``: the ranks' environment, which decides where the op is built and looked for;
    ``tick``: called every :data:`POLL_S` while the build runs (the supervisor's signals)."""
    clear_stale_build_locks(extensions_dir(env))
    if op_built(env):
        return 0
    proc = subprocess.Popen(
        [sys.executable, "-c", BUILD_OP],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ignore_stop_signals,
    )
    deadline = time.monotonic() + timeout
    while True:
        try:
            _, err = proc.communicate(timeout=POLL_S)
            break
        except subprocess.TimeoutExpired:
            if time.monotonic() > deadline:
                proc.kill()
                _, err = proc.communicate()
                err += f"\nstopped after {timeout:g} s"
                break
            if tick is not None:
                tick()
    if proc.returncode != 0:
        print(
            f"building DeepSpeed's op before the ranks failed (exit code {proc.returncode}); "
            f"the ranks build it themselves: {err.strip()[-500:]}",
            flush=True,
        )
    return proc.returncode
