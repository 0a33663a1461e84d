"""Reading SLURM's description of a partition's nodes (the cluster-facing checks run against a
real controller in tests/integration/test_slurm_job_lifecycle.py)."""

import pytest

from launch.slurm.checks import fields, gpu_count


@pytest.mark.parametrize(
    "gres, gpus",
    [
        ("(null)", 0),
        ("gpu:4", 4),
        ("gpu:a100:8(S:0-1)", 8),
        ("gpu:a100:2,gpu:v100:2", 4),
        ("mps:100", 0),
    ],
)
def test_gpus_in_a_gres_string(gres, gpus):
    assert gpu_count(gres) == gpus


def test_partition_fields_of_one_scontrol_line():
    line = "PartitionName=gpu AllowAccounts=physics,chem Default=NO TotalNodes=4 MaxNodes=2"
    assert fields(line) == {
        "PartitionName": "gpu",
        "AllowAccounts": "physics,chem",
        "Default": "NO",
        "TotalNodes": "4",
        "MaxNodes": "2",
    }
