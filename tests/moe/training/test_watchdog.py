"""Hang detection on a real 2-rank run (gloo): a test-only fault injector makes rank 1 sleep
inside step 3; its watchdog (and rank 0's, blocked in the step's collectives) writes every
thread's stack and ends the process with the hang exit code long before the sleep would end."""

import copy
import time

import pytest
import torch.multiprocessing as mp

from moe.config.run import RunConfig
from moe.config_schema import from_dict
from moe.training.resilience.faults import FaultInjector
from moe.training.resilience.watchdog import HANG_EXIT_CODE, hang_file
from moe.training.trainer import DistEnv, train
from tests.conftest import tiny_run_dict
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.multiprocess

STALL_STEP, STALL_S, TIMEOUT_S = 3, 120, 4


class Stall(FaultInjector):
    def __init__(self, rank: int):
        self.rank = rank

    def before_update(self, step, engine):
        if step == STALL_STEP and self.rank == 1:
            stalled_inside_a_step()


def stalled_inside_a_step():
    time.sleep(STALL_S)


def _worker(rank, world, cfg_dict):
    train(from_dict(RunConfig, copy.deepcopy(cfg_dict)), DistEnv(rank, world, rank, world),
          faults=Stall(rank))


def test_a_stalled_rank_is_detected_and_its_stacks_written(tiny_data, tmp_path):
    cfg = tiny_run_dict(tiny_data, tmp_path / "runs", max_steps=6, hang_timeout_s=TIMEOUT_S)
    cfg["logging"] = {"log_every": 1, "tensorboard": False}
    cfg["checkpoint"] = {"every_n_steps": 0}
    t0 = time.monotonic()
    with pytest.raises(mp.ProcessExitedException) as e:
        run_distributed(_worker, 2, cfg)
    assert e.value.exit_code == HANG_EXIT_CODE
    assert time.monotonic() - t0 < STALL_S / 2  # detected, not waited out
    stacks = hang_file(tmp_path / "runs" / "tiny" / "logs", 1).read_text()
    assert stacks.startswith("rank 1: hang: no training step completed for ")
    assert f"the last completed step is {STALL_STEP - 1}" in stacks
    assert "stalled_inside_a_step" in stacks  # the sleeping frame, from the main thread


def test_a_run_that_keeps_stepping_is_left_alone(tiny_data, tmp_path):
    """Each step is far shorter than the timeout: the run finishes, writes no stack file, and
    the watchdog stops with it."""
    cfg = tiny_run_dict(tiny_data, tmp_path / "runs", max_steps=3, hang_timeout_s=TIMEOUT_S * 5)
    cfg["logging"] = {"log_every": 1, "tensorboard": False}
    run_distributed(_worker_no_fault, 2, cfg)
    assert not list((tmp_path / "runs" / "tiny" / "logs").glob("hang_rank*"))


def _worker_no_fault(rank, world, cfg_dict):
    train(from_dict(RunConfig, copy.deepcopy(cfg_dict)), DistEnv(rank, world, rank, world))
