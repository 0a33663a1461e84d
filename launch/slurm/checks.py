"""Would SLURM take this job? Checked before any data work, in two ways.

``sbatch --test-only`` gives SLURM's own verdict, but its reason is often generic ("Requested
node configuration is not available"). So the partition is also read back from the controller
(``scontrol show partition``, ``sinfo``): a partition that does not exist, more nodes than it
has, more CPUs per node than its largest node, GPUs where its nodes have none, an account it
does not allow. Each finding names the config key and what the partition offers.
"""

from __future__ import annotations

import re
import subprocess

from launch.run_plan import Plan
from launch.slurm.jobs import slurm_command
from launch.slurm.script import JOB_SCRIPT
from moe.config.run import RunConfig
from moe.core.errors import LaunchError


def fields(line: str) -> dict[str, str]:
    """``Key=Value`` tokens of one ``scontrol -o`` line."""
    return dict(token.split("=", 1) for token in line.split() if "=" in token)


def gpu_count(gres: str) -> int:
    """GPUs in a node's ``Gres`` string (``gpu:4``, ``gpu:a100:8(S:0-1)``, ``(null)``)."""
    return sum(int(m.group(1)) for m in re.finditer(r"gpu(?::[\w-]+)?:(\d+)", gres))


def partition_problems(cfg: RunConfig) -> list[str]:
    """What the partition cannot give this job, from the controller's own description of it;
    empty when scontrol is not installed (sbatch --test-only still runs)."""
    s = cfg.launch.slurm
    proc = slurm_command(["scontrol", "show", "partition", "-o"])
    if proc is None or proc.returncode != 0:
        return []
    partitions = [fields(line) for line in proc.stdout.splitlines() if line.strip()]
    names = [p.get("PartitionName") for p in partitions]
    part = next(
        (
            p
            for p in partitions
            if (p.get("PartitionName") == s.partition if s.partition else p.get("Default") == "YES")
        ),
        None,
    )
    if part is None:
        which = (
            f"no partition {s.partition!r}"
            if s.partition
            else "no default partition; set launch.slurm.partition"
        )
        return [
            f"launch.slurm.partition: SLURM has {which} (partitions: "
            f"{', '.join(n for n in names if n) or 'none'})"
        ]
    name = part["PartitionName"]
    problems = []
    total = int(part.get("TotalNodes", "0"))
    max_nodes = part.get("MaxNodes", "UNLIMITED")
    if s.nodes > total:
        problems.append(
            f"launch.slurm.nodes: {s.nodes} nodes requested, partition {name!r} has {total}"
        )
    elif max_nodes.isdigit() and s.nodes > int(max_nodes):
        problems.append(
            f"launch.slurm.nodes: {s.nodes} nodes requested, partition {name!r} "
            f"allows at most {max_nodes} per job (MaxNodes)"
        )
    nodes = slurm_command(["sinfo", "-h", "-N", "-p", name, "-o", "%N|%c|%G"])
    if nodes is not None and nodes.returncode == 0 and nodes.stdout.strip():
        rows = [line.split("|") for line in nodes.stdout.splitlines() if line.count("|") == 2]
        cpus = max((int(c) for _, c, _ in rows if c.isdigit()), default=None)
        per_node = cfg.parallel.world_size // s.nodes * s.cpus_per_task
        if cpus is not None and per_node > cpus:
            problems.append(
                f"launch.slurm.cpus_per_task: {cfg.parallel.world_size // s.nodes} "
                f"tasks per node x {s.cpus_per_task} CPUs = {per_node} CPUs per node, "
                f"but the largest node of partition {name!r} has {cpus}"
            )
        gpus = max((gpu_count(g) for _, _, g in rows), default=0)
        if s.gpus_per_node and gpus == 0:
            problems.append(
                f"launch.slurm.gpus_per_node: {s.gpus_per_node} GPUs per node "
                f"requested, but the nodes of partition {name!r} have no GPUs "
                f"(Gres {', '.join(sorted({g for _, _, g in rows}))})"
            )
        elif s.gpus_per_node and s.gpus_per_node > gpus:
            problems.append(
                f"launch.slurm.gpus_per_node: {s.gpus_per_node} GPUs per node "
                f"requested, the nodes of partition {name!r} have at most {gpus}"
            )
    if s.account:
        allowed = part.get("AllowAccounts", "ALL")
        denied = part.get("DenyAccounts", "")
        if allowed != "ALL" and s.account not in allowed.split(","):
            problems.append(
                f"launch.slurm.account: partition {name!r} allows only the accounts "
                f"{allowed}, not {s.account!r}"
            )
        elif s.account in denied.split(","):
            problems.append(
                f"launch.slurm.account: partition {name!r} denies account {s.account!r}"
            )
        else:
            problems += account_problems(s.account)
    return problems


def account_problems(account: str) -> list[str]:
    """An account the accounting database does not know. Without one (AccountingStorageType
    none) SLURM takes any account name, and so does this check."""
    proc = slurm_command(["sacctmgr", "-n", "-P", "show", "account", account, "format=Account"])
    if proc is None or proc.returncode != 0:
        return []
    if account.lower() not in proc.stdout.lower().split():
        return [
            f"launch.slurm.account: SLURM's accounting has no account {account!r} "
            f"(sacctmgr show account)"
        ]
    return []


def check_submission(cfg: RunConfig, plan: Plan) -> None:
    """Refuse, before any data work, a job SLURM would not take: its own reason
    (``sbatch --test-only``, which schedules nothing) and what the partition lacks."""
    problems = partition_problems(cfg)
    proc = subprocess.run(
        [plan.command[0], "--test-only"],
        input=plan.files[JOB_SCRIPT],
        env=plan.run_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode == 0 and not problems:
        return
    lines = [
        "SLURM would refuse this job; nothing was prepared or submitted (--dry-run prints "
        "the job script):"
    ]
    if proc.returncode != 0:
        reason = (proc.stderr.strip() or proc.stdout.strip()).replace("sbatch: error: ", "")
        lines.append("  sbatch --test-only: " + "; ".join(reason.splitlines()))
    lines += [f"  - {p}" for p in problems]
    raise LaunchError("\n".join(lines))
