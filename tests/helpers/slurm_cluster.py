"""Real SLURM clusters on this machine for the integration tests, started and stopped by the test.

Everything lives in one temporary directory: a munge key, the slurm.conf, state, pid and log
files; the munged socket and slurmd's spool (where each job step gets a Unix socket) live in a
short directory of their own under the system's temporary directory, since a Unix socket's path
may hold at most 108 bytes (a test's own directory under pytest-xdist is longer than that
allows). Daemons run in the foreground as children we hold,
so they are stopped by their own pid. ``two_node_cluster`` builds two hosts from network
namespaces joined by a veth pair (each with its own address, interface ``eth1`` and hostname) with
one slurmd in each and slurmctld on the first; client commands run inside the first host's
namespace.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from moe.training.ports import free_port

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "srun", "scontrol")


def wait_for(
    predicate, timeout: float, what: str, cluster, poll: float = 0.2, job_log: Path | None = None
) -> None:
    """Poll ``predicate`` until it holds; after ``timeout`` seconds fail with ``what``, the end
    of ``job_log`` (if given) and the cluster's daemon logs."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(poll)
    tail = ""
    if job_log is not None:
        text = job_log.read_text(errors="replace") if job_log.exists() else "(none)"
        tail = f"--- {job_log.name} (end)\n{text[-4000:]}\n"
    raise TimeoutError(f"{what} after {timeout}s\n{tail}{cluster.logs()}")


def require_slurm() -> None:
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        pytest.skip(f"SLURM/munge not installed ({', '.join(missing)}); .ci/run installs them")
    if os.geteuid() != 0:
        pytest.skip("the test cluster runs its daemons as root")


@dataclass
class Cluster:
    root: Path
    conf: Path
    sockets: Path  # the short directory: munged's socket, slurmd's spool
    client_prefix: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)
    netns: list[str] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` as a SLURM client command: inside the controller's network namespace."""
        return self.client_prefix + argv

    def run(self, argv: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.command(argv), env=self.env, capture_output=True, text=True, timeout=60, **kw
        )

    def start(self, argv: list[str], log: str) -> None:
        out = open(self.root / log, "ab")
        self.procs.append(
            subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        )
        out.close()

    def wait_ready(self, nodes: int, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a SLURM daemon exited ({p.args}):\n{self.logs()}")
            # One line per node and partition: count each node once.
            rows = set(self.run(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout.splitlines())
            if [row.split()[-1] for row in rows].count("idle") == nodes:
                return
            time.sleep(0.5)
        raise RuntimeError(f"the SLURM cluster did not come up in {timeout}s:\n{self.logs()}")

    def wait_job(
        self,
        job_id: str,
        timeout: float,
        done=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"),
    ):
        deadline = time.time() + timeout
        state = None
        while time.time() < deadline:
            state = self.job_field(job_id, "JobState")
            if state in done:
                return state
            time.sleep(1)
        raise TimeoutError(f"job {job_id} still {state} after {timeout}s:\n{self.logs()}")

    def job_field(self, job_id: str, name: str) -> str | None:
        for token in self.run(["scontrol", "show", "job", job_id]).stdout.split():
            if token.startswith(name + "="):
                return token.split("=", 1)[1]
        return None

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.root.glob("*.log"))
        )

    def cancel_all(self, timeout: float = 30) -> None:
        """Cancel every job and wait until none is left: slurmstepd outlives slurmd."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                jobs = self.run(["squeue", "-h", "-o", "%i"]).stdout.split()
            except (OSError, subprocess.SubprocessError):
                return
            if not jobs:
                return
            self.run(["scancel", *jobs])
            time.sleep(0.5)

    def stop(self) -> None:
        if self.procs and all(p.poll() is None for p in self.procs):
            self.cancel_all()
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for ns in self.netns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(self.sockets, ignore_errors=True)


def socket_dir() -> Path:
    """A short directory for Unix sockets (at most 108 bytes of path each)."""
    return Path(tempfile.mkdtemp(prefix="slurm-"))


def write_munge(root: Path, sockets: Path) -> list[str]:
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    return [
        "munged",
        "--foreground",
        "--force",
        f"--socket={sockets / 'munge.sock'}",
        f"--key-file={key}",
        f"--pid-file={root / 'munged.pid'}",
        f"--log-file={root / 'munged.log'}",
        f"--seed-file={root / 'munged.seed'}",
    ]


def slurm_conf(
    root: Path,
    sockets: Path,
    controller: str,
    nodes: list[str],
    cpus: int,
    partitions: tuple[str, ...] = (),
    settings: tuple[str, ...] = (),
) -> str:
    root.mkdir(parents=True, exist_ok=True)
    lines = [
        "ClusterName=moetest",
        f"SlurmctldHost={controller}",
        f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire also delays a requeued job's restart (default 120 s).
        f"AuthInfo=socket={sockets / 'munge.sock'},cred_expire=5",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "ReturnToService=2",
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        # A requeued job becomes eligible after cred_expire; the periodic pass (sched_interval)
        # is what then starts it.
        "SchedulerType=sched/builtin",
        "SchedulerParameters=sched_interval=2",
        "KillWait=5",
        "InactiveLimit=0",
        "MinJobAge=600",
        *settings,
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={sockets / 'spool%n'}",
        f"SlurmctldPidFile={root / 'ctld.pid'}",
        f"SlurmdPidFile={root / 'd%n.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'slurmd-%n.log'}",
        *nodes,
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        *partitions,
    ]
    # A setting replaces the default line of the same key (e.g. KillWait=2).
    keys = {line.split("=", 1)[0] for line in settings}
    lines = [line for line in lines if line in settings or line.split("=", 1)[0] not in keys]
    (root / "state").mkdir()
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def single_node_cluster(
    root: Path, cpus: int = 2, partitions: tuple[str, ...] = (), settings: tuple[str, ...] = ()
):
    """``partitions``: more ``PartitionName=...`` lines besides the default ``debug``;
    ``settings``: more slurm.conf lines (e.g. ``PreemptType=...``), each replacing a default
    line of the same key (e.g. ``KillWait=2``)."""
    require_slurm()
    host = socket.gethostname()
    conf = root / "slurm.conf"
    sockets = socket_dir()
    conf.write_text(
        slurm_conf(
            root,
            sockets,
            host,
            [f"NodeName={host} CPUs={cpus} RealMemory=20000"],
            cpus,
            partitions,
            settings,
        )
    )
    cluster = Cluster(root, conf, sockets)
    try:
        cluster.start(write_munge(root, sockets), "munged-stdout.log")
        time.sleep(0.5)
        cluster.start(["slurmctld", "-D", "-f", str(conf)], "slurmctld-stdout.log")
        cluster.start(["slurmd", "-D", "-f", str(conf)], "slurmd-stdout.log")
        cluster.wait_ready(1)
        yield cluster
    finally:
        cluster.stop()


def _sh(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip()}")


@contextlib.contextmanager
def two_node_cluster(root: Path, ifname: str = "eth1"):
    """Hosts node1 and node2 (1 CPU each) on 10.N.0.1 and 10.N.0.2, N unique to this process."""
    require_slurm()
    if shutil.which("nsenter") is None or shutil.which("ip") is None:
        pytest.skip("needs nsenter and ip (util-linux, iproute2)")
    tag = f"{os.getpid() % 100000}"
    net = 100 + os.getpid() % 150
    names = [f"moe{tag}n1", f"moe{tag}n2"]
    addrs = [f"10.{net}.0.1", f"10.{net}.0.2"]
    conf = root / "slurm.conf"
    nodes = [
        f"NodeName=node{i + 1} NodeAddr={a} CPUs=1 RealMemory=8000" for i, a in enumerate(addrs)
    ]
    sockets = socket_dir()
    conf.write_text(slurm_conf(root, sockets, f"node1({addrs[0]})", nodes, 1))
    cluster = Cluster(
        root, conf, sockets, client_prefix=["nsenter", f"--net=/var/run/netns/{names[0]}"]
    )
    try:
        for ns in names:
            _sh("ip", "netns", "add", ns)
            cluster.netns.append(ns)
        veth = [f"v{tag}a", f"v{tag}b"]
        _sh("ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for ns, dev, addr in zip(names, veth, addrs):
            _sh("ip", "link", "set", dev, "netns", ns)
            inside = ["nsenter", f"--net=/var/run/netns/{ns}"]
            _sh(*inside, "ip", "link", "set", dev, "name", ifname)
            _sh(*inside, "ip", "addr", "add", f"{addr}/24", "dev", ifname)
            _sh(*inside, "ip", "link", "set", ifname, "up")
            _sh(*inside, "ip", "link", "set", "lo", "up")
        cluster.start(write_munge(root, sockets), "munged-stdout.log")
        time.sleep(0.5)
        for i, ns in enumerate(names, 1):
            # nsenter --net, not `ip netns exec` (which remounts /sys; slurmd then fails on
            # cgroups); unshare --uts gives each host its own hostname.
            script = f'hostname node{i}; exec slurmd -D -f "$0" -N node{i}'
            if i == 1:
                cluster.start(
                    [
                        "nsenter",
                        f"--net=/var/run/netns/{ns}",
                        "unshare",
                        "--uts",
                        "sh",
                        "-c",
                        'hostname node1; exec slurmctld -D -f "$0"',
                        str(conf),
                    ],
                    "slurmctld-stdout.log",
                )
            cluster.start(
                [
                    "nsenter",
                    f"--net=/var/run/netns/{ns}",
                    "unshare",
                    "--uts",
                    "sh",
                    "-c",
                    script,
                    str(conf),
                ],
                f"slurmd{i}-stdout.log",
            )
        cluster.wait_ready(2)
        yield cluster
    finally:
        cluster.stop()
