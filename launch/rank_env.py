"""Rank and world size from whichever launcher started this process: the environment variables
of torch/DeepSpeed, MPI and SLURM, read here once by the training entry point (launch/train.py),
which hands the trainer the result."""

from __future__ import annotations

import os

from moe.training.trainer import DistEnv


def _slurm_tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """SLURM's compressed per-node task counts, e.g. ``2(x3),1``: entry ``node_id``."""
    counts = []
    for part in tasks_per_node.split(","):
        n, _, rep = part.partition("(x")
        counts += [int(n)] * (int(rep.rstrip(")")) if rep else 1)
    return counts[min(node_id, len(counts) - 1)]


def dist_env_from_environment(env: dict | None = None) -> DistEnv:
    """Rank and world size from whichever launcher started us, in this order: torch/DeepSpeed
    variables (RANK, WORLD_SIZE), MPI (Open MPI, MPICH/Hydra and Intel MPI), SLURM's srun. MPI
    comes before SLURM because mpiexec inside a SLURM allocation inherits the batch step's
    SLURM_PROCID (0 on every rank). Nothing set: a single rank."""
    env = os.environ if env is None else env
    master = (env.get("MASTER_ADDR"), int(env["MASTER_PORT"]) if "MASTER_PORT" in env else None)
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", 0))
        local_world = int(env.get("LOCAL_WORLD_SIZE", env.get("LOCAL_SIZE", world)))
    elif "OMPI_COMM_WORLD_RANK" in env:
        rank, world = int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"])
        local = int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0))
        local_world = int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", world))
    elif "PMI_RANK" in env:
        rank, world = int(env["PMI_RANK"]), int(env["PMI_SIZE"])
        local = int(env.get("MPI_LOCALRANKID", 0))
        local_world = int(env.get("MPI_LOCALNRANKS", world))
    elif "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        # Only inside an srun step: the batch script itself also has SLURM_PROCID (0).
        rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        local = int(env.get("SLURM_LOCALID", 0))
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        local_world = (
            _slurm_tasks_on_node(per_node, int(env.get("SLURM_NODEID", 0))) if per_node else 1
        )
    else:
        rank, world, local, local_world = 0, 1, 0, 1
    return DistEnv(rank, world, local, local_world, *master)
