"""A launch plan: what moe-launch will run, as data. Printable (--dry-run), saved in the run
directory (plan.json), and executed as an argument list, never through a shell."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moe.core.errors import LaunchError
from moe.core.fileio import write_atomic
from moe.core.run_dir import RunDir

RESOLVED_CONFIG = "config.yaml"
PLAN_FILE = "plan.json"


@dataclass
class Plan:
    scheduler: str
    command: list[str]
    """What moe-launch runs on this host: a launcher that starts the ranks, or sbatch."""
    run_dir: str
    world_size: int
    nodes: int = 1
    env: dict[str, str] = field(default_factory=dict)
    """Added to this host's environment for ``command``."""
    files: dict[str, str] = field(default_factory=dict)
    """Files (relative to the run directory) written before ``command`` runs: a job script,
    DeepSpeed's environment file."""
    requires: list[str] = field(default_factory=list)
    """Programs this host needs besides ``command[0]`` (e.g. pdsh for a multi-node hostfile)."""
    submits: bool = False
    """True: ``command`` submits a job and returns; False: it runs the training to its end."""

    def render(self) -> str:
        where = (
            f"{self.nodes} node{'s' if self.nodes > 1 else ''}"
            if self.nodes
            else "the hosts of the machine file"
        )
        head = (
            f"# {self.scheduler}: {self.world_size} ranks on {where}; run directory {self.run_dir}"
        )
        parts = [head]
        for name, text in self.files.items():
            parts.append(f"# file {Path(self.run_dir) / name}:\n{text.rstrip()}")
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        parts.append("# command:\n" + (env + " " if env else "") + shlex.join(self.command))
        return "\n".join(parts)

    def check_runnable(self) -> None:
        for exe in [self.command[0], *self.requires]:
            if shutil.which(exe) is None:
                raise LaunchError(
                    f"{exe!r} not found on PATH: the {self.scheduler} scheduler "
                    f"needs it on this host (--dry-run prints the plan without it)"
                )

    def write(self, run_dir: Path) -> None:
        """Write the plan and its files; each file appears whole or not at all."""
        for name, text in {**self.files, PLAN_FILE: json.dumps(asdict(self), indent=2)}.items():
            write_atomic(run_dir / name, text)

    def write_run_dir(self, config_text: str) -> None:
        """The resolved config, the logs directory (SLURM does not create a job log's directory)
        and the plan with its files."""
        run_dir = Path(self.run_dir)
        write_atomic(run_dir / RESOLVED_CONFIG, config_text)
        RunDir(run_dir).logs.mkdir(exist_ok=True)
        self.write(run_dir)

    def run_env(self) -> dict[str, str]:
        return {**os.environ, **self.env}


def entry_point(config_path: Path) -> list[str]:
    """What a scheduler that starts processes itself (mpiexec) starts once per rank: the rank
    wrapper (launch/rank.py), which runs the training entry point (``launch.train``) and records
    how it ended, so that a failure names its rank."""
    return [sys.executable, "-u", "-m", "launch.rank", "--config", str(config_path)]


# What DeepSpeed's multi-node runner passes through a remote shell unquoted.
SHELL_INERT = re.compile(r"[\w@%+=:,./-]*\Z")
