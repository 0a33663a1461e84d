"""``mpiexec -n WORLD_SIZE``: MPICH (Hydra) or Open MPI. The ranks read their rank and world size
from the MPI launcher's environment; the rendezvous address for torch.distributed is passed
explicitly, in each flavor's own syntax, so it reaches ranks on other hosts too."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from launch.run_plan import RESOLVED_CONFIG, Plan, entry_point
from launch.schedulers.local import free_port
from moe.config.run import RunConfig
from moe.core.errors import LaunchError


def detect_flavor(mpiexec: str) -> str:
    if shutil.which(mpiexec) is None:
        raise LaunchError(
            f"{mpiexec!r} not found on PATH: install MPI (e.g. pip install mpich) "
            f"or set launch.mpi.mpiexec; with launch.mpi.flavor set, --dry-run "
            f"works without it"
        )
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LaunchError(f"could not run {mpiexec} --version: {e}") from None
    text = out.stdout + out.stderr
    if "Open MPI" in text or "OpenRTE" in text:
        return "openmpi"
    if "HYDRA" in text or "MPICH" in text or "Intel(R) MPI" in text:
        return "mpich"
    raise LaunchError(
        f"cannot tell which MPI {mpiexec} belongs to; set launch.mpi.flavor to 'mpich' or 'openmpi'"
    )


def plan(cfg: RunConfig, run_dir: Path) -> Plan:
    m = cfg.launch.mpi
    flavor = m.flavor if m.flavor != "auto" else detect_flavor(m.mpiexec)
    n = cfg.parallel.world_size
    env = {
        "MASTER_ADDR": m.master_addr,
        "MASTER_PORT": str(m.master_port or free_port()),
        "PYTHONUNBUFFERED": "1",
        **cfg.launch.env,
    }
    cmd = [m.mpiexec, "-n", str(n)]
    if m.hostfile:
        cmd += ["-f" if flavor == "mpich" else "--hostfile", m.hostfile]
    for k, v in env.items():
        cmd += ["-genv", k, v] if flavor == "mpich" else ["-x", f"{k}={v}"]
    cmd += [*m.extra_args, *entry_point(run_dir / RESOLVED_CONFIG)]
    return Plan("mpi", cmd, str(run_dir), n, nodes=0 if m.hostfile else 1)
