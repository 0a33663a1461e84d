"""N ranks on this machine through the ``deepspeed`` launcher."""

from __future__ import annotations

import sys
from pathlib import Path

from launch.run_plan import RESOLVED_CONFIG, Plan
from moe.config.run import RunConfig
from moe.training.ports import free_port


def plan(cfg: RunConfig, run_dir: Path) -> Plan:
    n = cfg.parallel.world_size
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        str(n),
        "--master_port",
        str(free_port()),
        "--log_level",
        "warning",
        "--no_local_rank",
        "--module",
        "launch.rank",
        "--config",
        str(run_dir / RESOLVED_CONFIG),
    ]
    return Plan("local", cmd, str(run_dir), n, env={"PYTHONUNBUFFERED": "1", **cfg.launch.env})
