"""Rank and world size from each launcher's environment, as the training entry point reads them."""

import pytest

from launch.rank import rank_of
from launch.rank_env import dist_env_from_environment
from moe.core.errors import LaunchError


@pytest.mark.parametrize(
    "env, expected",
    [
        (
            {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"},
            (3, 8, 1, 4),
        ),
        (
            {
                "OMPI_COMM_WORLD_RANK": "5",
                "OMPI_COMM_WORLD_SIZE": "6",
                "OMPI_COMM_WORLD_LOCAL_RANK": "2",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
            },
            (5, 6, 2, 3),
        ),
        (
            {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
            (1, 2, 1, 2),
        ),
        # srun step: 7 tasks laid out 2,2,2,1; the task on the last node is alone there.
        (
            {
                "SLURM_PROCID": "6",
                "SLURM_NTASKS": "7",
                "SLURM_LOCALID": "0",
                "SLURM_NODEID": "3",
                "SLURM_STEP_ID": "0",
                "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
            },
            (6, 7, 0, 1),
        ),
        # mpiexec inside an allocation: MPI's ranks, not the batch step's SLURM_PROCID.
        (
            {
                "SLURM_PROCID": "0",
                "SLURM_NTASKS": "2",
                "SLURM_STEP_ID": "0",
                "PMI_RANK": "1",
                "PMI_SIZE": "2",
            },
            (1, 2, 0, 2),
        ),
        # The batch script itself (no step): one process, not rank 0 of SLURM_NTASKS.
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "2"}, (0, 1, 0, 1)),
        ({}, (0, 1, 0, 1)),
    ],
)
def test_each_launcher_environment_maps_to_rank_and_world(env, expected):
    d = dist_env_from_environment(env)
    assert (d.rank, d.world_size, d.local_rank, d.local_world_size) == expected
    # The rank wrapper records the training process's end under the same rank.
    assert rank_of(env) == expected[0]


def test_torch_env_carries_the_launchers_rendezvous():
    d = dist_env_from_environment(
        {
            "SLURM_PROCID": "1",
            "SLURM_NTASKS": "2",
            "SLURM_STEP_ID": "0",
            "SLURM_LOCALID": "0",
            "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
            "MASTER_ADDR": "10.1.0.1",
            "MASTER_PORT": "15004",
        }
    )
    assert d.torch_env() == {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "10.1.0.1",
        "MASTER_PORT": "15004",
    }


def test_several_ranks_without_a_master_address_is_a_clear_error():
    with pytest.raises(LaunchError, match="rank 1 of 2: MASTER_ADDR and MASTER_PORT"):
        dist_env_from_environment({"PMI_RANK": "1", "PMI_SIZE": "2"}).torch_env()
    single = dist_env_from_environment({}).torch_env()
    assert single["MASTER_ADDR"] == "127.0.0.1" and int(single["MASTER_PORT"]) > 0
