"""Hang detection on a real 2-rank run (gloo): a test-only fault injector makes rank 1 sleep
inside step 3; its watchdog (and rank 0's, blocked in the step's collectives) writes every
thread's stack and ends the process with the hang exit code long before the sleep would end.
Rank 0 names rank 1 as the rank that did not reach its collective (alive: its heartbeat went
on). A frozen rank (SIGSTOP) is tested through the real launcher in
tests/integration/test_launcher_signals.py."""

import copy
import json
import time

import pytest
import torch.multiprocessing as mp

from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.training.resilience.collectives import record_collectives
from moe.training.resilience.faults import FaultInjector
from moe.training.resilience.watchdog import (
    HANG_EXIT_CODE,
    STORE_TIMEOUT_S,
    hang_file,
    hang_records_file,
    not_arrived,
    poll_s,
    process_group_timeout_s,
)
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
    # As launch/train.py does (there before the group starts; the collectives our code and
    # DeepSpeed look up at call time are recorded all the same).
    record_collectives(rank, 0)
    train(
        from_dict(RunConfig, copy.deepcopy(cfg_dict)),
        DistEnv(rank, world, rank, world),
        faults=Stall(rank),
    )


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
    # Rank 0 waits inside a collective that rank 1 never entered, and says so; or, when rank
    # 1's watchdog fired first (the two time out together; a loaded machine decides), rank 0
    # was alarmed by it and points to its report.
    logs = tmp_path / "runs" / "tiny" / "logs"
    report = hang_file(logs, 0).read_text()
    record = json.loads(hang_records_file(logs, 0).read_text().splitlines()[-1])
    assert "still inside it" in report and record["inside"] and record["step"] == STALL_STEP
    if record["alarm_from"] == 1:
        assert "see the report of rank 1, whose watchdog fired first" in report, report
    else:
        assert "rank 1: alive but behind" in report, report
        assert list(record["missing"]) == ["1"]


def test_two_readings_of_the_heartbeats_name_a_frozen_and_a_late_rank():
    """Rank 0 waits in call 9: rank 1's heartbeat stood still (frozen), rank 2's moved on but
    it is at call 7 (behind), rank 3 is in call 9 too (arrived)."""

    def hb(beat, calls, inside=True):
        return {
            "beat": beat,
            "calls": calls,
            "name": "all_reduce",
            "inside": inside,
            "step": 4,
            "time": time.time(),
        }

    first = {0: hb(1, 9), 1: hb(5, 8), 2: hb(5, 7, False), 3: hb(5, 9)}
    second = {0: hb(2, 9), 1: hb(5, 8), 2: hb(6, 7, False), 3: hb(6, 9)}
    missing = not_arrived(0, 9, True, first, second, None, 1.5)
    assert sorted(missing) == [1, 2]
    assert missing[1].startswith("stopped responding: its heartbeat did not change in 1.5s")
    assert missing[2].startswith("alive but behind: it is past collective call 7")
    # A store that does not answer names the rank that holds it.
    assert list(not_arrived(1, 9, True, first, {}, "timeout", 1.5)) == [0]
    # Not inside a collective while the peers went further: this rank is the late one.
    assert list(not_arrived(2, 7, False, first, second, None, 1.5)) == [1, 2]


def test_the_process_group_times_out_after_the_watchdog_has_reported():
    for timeout in (6, 60, 1800):
        assert process_group_timeout_s(timeout) > timeout + 7 * poll_s(timeout) + STORE_TIMEOUT_S


def test_a_run_that_keeps_stepping_is_left_alone(tiny_data, tmp_path):
    """Each step is far shorter than the timeout: the run finishes, writes no stack file, and
    the watchdog stops with it."""
    cfg = tiny_run_dict(tiny_data, tmp_path / "runs", max_steps=3, hang_timeout_s=TIMEOUT_S * 5)
    cfg["logging"] = {"log_every": 1, "tensorboard": False}
    run_distributed(_worker_no_fault, 2, cfg)
    assert not list((tmp_path / "runs" / "tiny" / "logs").glob("hang_rank*"))


def _worker_no_fault(rank, world, cfg_dict):
    train(from_dict(RunConfig, copy.deepcopy(cfg_dict)), DistEnv(rank, world, rank, world))
