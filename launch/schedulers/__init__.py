"""Scheduler back ends. Each turns a validated run config into a :class:`~launch.run_plan.Plan`
that starts ``launch.train`` once per rank; none of them runs anything."""

from __future__ import annotations

from pathlib import Path

from launch.run_plan import Plan
from launch.schedulers import hostfile, local, mpi
from launch.slurm import script as slurm
from moe.config.run import RunConfig
from moe.core.errors import ConfigError, LaunchError

BUILDERS = {"local": local.plan, "hostfile": hostfile.plan, "slurm": slurm.plan, "mpi": mpi.plan}


def build_plan(cfg: RunConfig, evaluate: bool = True) -> Plan:
    """The plan for ``cfg.launch.scheduler``; the run directory is made absolute so that ranks
    started elsewhere (other nodes, a batch job) find it. ``evaluate``: a SLURM job evaluates
    its final checkpoint itself (the other schedulers return to moe-launch, which does)."""
    run_dir = Path(cfg.run_dir).absolute()
    if cfg.launch.scheduler == "slurm":
        return slurm.plan(cfg, run_dir, evaluate=evaluate)
    return BUILDERS[cfg.launch.scheduler](cfg, run_dir)


def plan_problems(cfg: RunConfig) -> list[str]:
    """What the scheduler's plan builder refuses in ``cfg`` (ranks that do not spread over the
    nodes or the hostfile's slots, paths a job script or remote shell cannot carry), as config
    problems: moe-launch reports them together with the config's own, in one error."""
    try:
        build_plan(cfg)
    except ConfigError as e:
        return e.problems
    except LaunchError as e:  # e.g. a hostfile that cannot be read
        return [f"launch.{cfg.launch.scheduler}: {e}"]
    return []
