"""The reader's state through real checkpoints: a 2-rank run resumed with another micro-batch
size continues the global sample cursor exactly (the order itself is checked in
tests/data_pipeline/test_reader.py). Both runs in one start of the two rank processes."""

import copy

import pytest
import torch

from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.training.trainer import DistEnv, train
from tests.conftest import tiny_run_dict
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.multiprocess


def _train_twice(rank, world, first, second):
    for d in (first, second):
        train(from_dict(RunConfig, copy.deepcopy(d)), DistEnv(rank, world, rank, world))


def data_state(run_dir, step):
    path = run_dir / "checkpoints" / f"step_{step:07d}" / "mp_rank_00_model_states.pt"
    return torch.load(path, map_location="cpu", weights_only=True)["data"]


def test_resume_with_another_micro_batch_continues_the_cursor(tiny_data, tmp_path):
    first = tiny_run_dict(tiny_data, tmp_path / "runs", max_steps=2)
    first["logging"] = {"log_every": 1, "tensorboard": False}
    second = copy.deepcopy(first)
    second["train"].update(max_steps=3, micro_batch_size=1)
    run_distributed(_train_twice, 2, first, second)
    run_dir = tmp_path / "runs" / "tiny"
    before = data_state(run_dir, 2)
    assert before["consumed_samples"] == 2 * 2 * 2  # steps x ranks x micro-batch
    after = data_state(run_dir, 3)
    assert after["consumed_samples"] == 8 + 1 * 2 * 1  # from scratch it would be 3 x 2 x 1
    assert after["fingerprint"] == before["fingerprint"]
