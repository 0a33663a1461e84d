"""Scheduler back ends. Each turns a validated run config into a :class:`~launch.plan.Plan`
that starts ``launch.train`` once per rank; none of them runs anything."""

from __future__ import annotations

from pathlib import Path

from launch.plan import Plan
from launch.schedulers import hostfile, local, mpi, slurm
from moe.training.config import RunConfig

BUILDERS = {"local": local.plan, "hostfile": hostfile.plan, "slurm": slurm.plan, "mpi": mpi.plan}


def build_plan(cfg: RunConfig) -> Plan:
    """The plan for ``cfg.launch.scheduler``; the run directory is made absolute so that ranks
    started elsewhere (other nodes, a batch job) find it."""
    run_dir = Path(cfg.run_dir).absolute()
    return BUILDERS[cfg.launch.scheduler](cfg, run_dir)
