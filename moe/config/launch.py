"""Typed configuration of how a run is started (the ``launch`` section of a run config).

Every value here can end up in a command line, an environment or a SLURM job script, so the
checks below are strict about what may reach a shell: names that a scheduler interprets are
limited to safe characters; free-form values are quoted when the plan is rendered and refused
only where no quoting survives (a newline in an ``#SBATCH`` line).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from moe.core.config_schema import minimums

Scheduler = Literal["local", "hostfile", "slurm", "mpi"]
ELASTIC_SCHEDULERS = ("local", "hostfile")
"""Where moe-launch itself restarts the ranks and can start fewer of them (launch.elastic)."""

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Host, partition, account and interface names: what clusters actually use. Anything else is
# far more likely an injection or a typo than a real name.
PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*\Z")
# SLURM --time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or no limit.
SLURM_TIME = re.compile(r"(?:(\d+)-(\d+)(?::(\d+))?(?::(\d+))?|(\d+)(?::(\d+))?(?::(\d+))?)\Z")
UNLIMITED = ("UNLIMITED", "INFINITE")


def slurm_time_seconds(value: str) -> int | None:
    """Seconds of a SLURM time limit; None for no limit. Raises ValueError, naming the field,
    for anything SLURM does not accept: a field after the first out of range (minutes and
    seconds 0-59, hours after a day 0-23) or a shape it does not know."""
    if value.upper() in UNLIMITED:
        return None
    m = SLURM_TIME.match(value)
    if not m:
        raise ValueError("not a SLURM time")
    days, d_hours, d_minutes, d_seconds, first, second, third = m.groups()
    if days is not None:
        fields = [("hours", d_hours, 24), ("minutes", d_minutes, 60), ("seconds", d_seconds, 60)]
        total = int(days) * 86400
        units: tuple[int, ...] = (3600, 60, 1)
    elif third is not None:  # HH:MM:SS
        fields = [("minutes", second, 60), ("seconds", third, 60)]
        total, units = int(first) * 3600, (60, 1)
    elif second is not None:  # MM:SS
        fields = [("seconds", second, 60)]
        total, units = int(first) * 60, (1,)
    else:  # minutes; 0 asks for no limit (sbatch --time=0)
        return int(first) * 60 or None
    for (name, text, bound), unit in zip(fields, units):
        if text is None:
            continue
        if int(text) >= bound:
            raise ValueError(f"{name} {text} out of range 0-{bound - 1}")
        total += int(text) * unit
    return total


def line_breaks(value: str) -> bool:
    return any(c in value for c in "\n\r\0")


def port_problems(key: str, port: int | None) -> list[str]:
    if port is None or 1024 <= port <= 65535:
        return []
    return [f"{key}: must be in 1024..65535, got {port}"]


def name_problems(key: str, value: str | None, what: str) -> list[str]:
    if value is None or PLAIN_NAME.match(value):
        return []
    return [f"{key}: {value!r} is not a valid {what} (letters, digits and _.:- only)"]


@dataclass
class HostfileConfig:
    """Multi-node through DeepSpeed's runner (pdsh over ssh) and a hostfile."""

    path: str | None = None
    """A DeepSpeed hostfile: one ``HOST slots=N`` line per node; ``#`` starts a comment."""
    include: str = ""
    """DeepSpeed's resource filter, ``HOST[:SLOT,...]@HOST...``: use only these."""
    exclude: str = ""
    """The same syntax: use everything but these. Exclusive with include."""
    master_addr: str | None = None
    """Address of the first used host as the others reach it (null: its hostfile name)."""
    master_port: int = 29500
    ssh_check: bool = True
    """Let DeepSpeed check passwordless ssh to the first host before starting (false skips it,
    e.g. for a one-host hostfile on a machine without an ssh server)."""

    def problems(self) -> list[str]:
        out = []
        if self.include and self.exclude:
            out.append("include/exclude: give one of them, not both")
        out += name_problems("master_addr", self.master_addr, "host address")
        return out + port_problems("master_port", self.master_port)


@dataclass
class SlurmConfig:
    """A batch job: one task per rank, started with srun inside the allocation."""

    nodes: int = 1
    """Nodes to allocate; parallel.world_size ranks are spread evenly over them."""
    gpus_per_node: int = 0
    """GPUs to request per node (0: none, the CPU/gloo case)."""
    cpus_per_task: int = 1
    """CPU cores per rank."""
    time: str | int | None = None
    """Time limit as sbatch reads it: ``30`` is 30 minutes, ``'30:00'`` 30 minutes too, ``'02:00:00'``
    two hours, ``1-00:00:00`` a day, ``0`` or ``UNLIMITED`` no limit (null: the partition's
    default). Written unquoted, ``0:30`` stays the text ``0:30`` (30 seconds), never the base-60
    number 30."""
    partition: str | None = None
    account: str | None = None
    job_name: str | None = None
    """null: the run name."""
    output: str | None = None
    """Job log file (SLURM's %j and friends allowed); null: RUN_DIR/logs/slurm-%j.out."""
    extra_sbatch: list[str] = field(default_factory=list)
    """More #SBATCH options, one per item, e.g. ``--exclusive`` or ``--mem=0``."""
    srun_args: list[str] = field(default_factory=list)
    """More srun arguments, e.g. ``--cpu-bind=cores``."""
    socket_ifname: str | None = None
    """Network interface the ranks talk over (GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME). Set it
    on multi-node jobs whose hostnames resolve to loopback, or gloo never leaves the node."""
    master_port: int | None = None
    """null: derived from the job id (and restart count), so jobs sharing a node do not collide."""
    signal_seconds: int = 180
    """SLURM sends the ranks SIGUSR1 this long before the time limit (0: no signal); they save a
    checkpoint at the next step boundary and the job requeues itself."""
    requeue: bool = True
    """Requeue the job after a signal-triggered checkpoint; it resumes from that checkpoint."""

    def problems(self) -> list[str]:
        out = []
        for key in ("nodes", "cpus_per_task"):
            if getattr(self, key) < 1:
                out.append(f"{key}: must be >= 1, got {getattr(self, key)}")
        if self.gpus_per_node < 0:
            out.append(f"gpus_per_node: must be >= 0, got {self.gpus_per_node}")
        if self.time is not None:
            try:
                limit = slurm_time_seconds(str(self.time))  # a number: minutes, as sbatch
            except ValueError as e:
                out.append(
                    f"time: {self.time!r} is not a SLURM time ({e}); write minutes, "
                    f"MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED"
                )
            else:
                if limit is not None and self.signal_seconds and limit <= self.signal_seconds + 60:
                    out.append(
                        f"time: a limit of {limit} s leaves no time to train before the "
                        f"preemption signal at signal_seconds ({self.signal_seconds} s) "
                        f"before it; it must exceed {self.signal_seconds + 60} s "
                        f"(signal_seconds + 60): raise time or lower signal_seconds"
                    )
        out += name_problems("partition", self.partition, "partition name")
        out += name_problems("account", self.account, "account name")
        out += name_problems("socket_ifname", self.socket_ifname, "network interface name")
        for key in ("job_name", "output"):
            value = getattr(self, key)
            if value is not None and (not value or line_breaks(value)):
                out.append(f"{key}: {value!r} must be non-empty and on one line")
        for i, item in enumerate(self.extra_sbatch):
            if line_breaks(item) or not item.startswith("-"):
                out.append(
                    f"extra_sbatch[{i}]: {item!r} must be one sbatch option on one line, "
                    f"e.g. '--exclusive'"
                )
            elif item.startswith("--signal") and self.signal_seconds:
                out.append(
                    f"extra_sbatch[{i}]: {item!r} would conflict with the job's own "
                    f"--signal=USR1@{self.signal_seconds} (signal_seconds); set "
                    f"signal_seconds: 0 to use yours (the job script passes B: signals "
                    f"on to the ranks) or drop it"
                )
        out += port_problems("master_port", self.master_port)
        if self.signal_seconds < 0:
            out.append(f"signal_seconds: must be >= 0, got {self.signal_seconds}")
        return out


@dataclass
class MpiConfig:
    """``mpiexec -n WORLD_SIZE``: MPICH or Open MPI."""

    mpiexec: str = "mpiexec"
    """The MPI launcher to run (a name on PATH or a path), e.g. ``mpirun``."""
    flavor: Literal["auto", "mpich", "openmpi"] = "auto"
    """How to pass environment variables (-genv or -x); auto: ask ``mpiexec --version``."""
    hostfile: str | None = None
    """A machine file for multi-host runs (null: all ranks on this host)."""
    master_addr: str = "127.0.0.1"
    """Address of rank 0's host as the other ranks reach it."""
    master_port: int | None = None
    """null: a free port on this host."""
    extra_args: list[str] = field(default_factory=list)
    """More mpiexec arguments, e.g. ``--bind-to none``."""

    def problems(self) -> list[str]:
        return name_problems("master_addr", self.master_addr, "host address") + port_problems(
            "master_port", self.master_port
        )


@dataclass
class LaunchConfig:
    scheduler: Scheduler = "local"
    """Where the ranks run: this machine (deepspeed launcher), hosts of a DeepSpeed hostfile,
    a SLURM batch job, or mpiexec. ``moe-launch --scheduler`` overrides it."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables every rank gets, whatever the scheduler."""
    hostfile: HostfileConfig = field(default_factory=HostfileConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    mpi: MpiConfig = field(default_factory=MpiConfig)
    max_restarts: int = 3
    """When a rank exits abnormally (a crash, a kill, the hang watchdog's exit 70), stop the
    other ranks and start all ranks again from the newest complete checkpoint, up to this many
    times (0: never). The same failure (exit code or signal) at the same step twice in a row
    stops at once. Local and hostfile launches restart in moe-launch; a SLURM job restarts its
    srun step inside the allocation. A preemption (exit code 75) is not a failure."""
    elastic: bool = False
    """Local and hostfile launches: before each automatic restart, check which hosts (hostfile:
    over ssh, as DeepSpeed's runner reaches them) or GPUs (local) are usable; with fewer than
    ``parallel.world_size`` slots, resume on the largest smaller world size that keeps the
    global batch (more gradient accumulation) and that an expert-parallel size divides, from
    the newest checkpoint (launch/elastic.py). A later restart with every slot usable again
    goes back to the configured layout."""
    min_world_size: int = 1
    """launch.elastic: stop instead of resuming on fewer ranks than this."""

    def problems(self) -> list[str]:
        out = [
            f"env.{k}: not a valid environment variable name"
            for k in self.env
            if not ENV_NAME.match(k)
        ]
        if self.elastic and self.scheduler not in ELASTIC_SCHEDULERS:
            out.append(
                f"elastic: the {self.scheduler} scheduler does not resume on fewer ranks "
                f"by itself (launch.elastic applies to "
                f"{' and '.join(ELASTIC_SCHEDULERS)} launches); set elastic: false"
            )
        return out + minimums(self, max_restarts=0, min_world_size=1)
