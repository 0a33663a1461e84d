"""Automatic restart with the real launcher (launch.max_restarts): rank 1 of a 2-rank
expert-parallel run is killed with SIGKILL in the backward of step 4, and later sleeps inside the
forward of step 7 (test-only fault plan, moe/training/faults.py). The launcher stops the other
rank, restarts both from the newest complete checkpoint each time; the hang is detected by the
watchdog within train.hang_timeout_s, its stacks are on disk; the run finishes with the losses
of an uninterrupted run at every step, every sample consumed once."""

import json

import pytest

from moe.training.watchdog import HANG_EXIT_CODE, hang_file
from tests.conftest import tiny_run_dict
from tests.helpers.fault_runs import (
    checkpoint_problems,
    launch,
    loss_mismatches,
    restarts,
    sample_problems,
    write_run_config,
)

pytestmark = pytest.mark.integration

MAX_STEPS, HANG_TIMEOUT_S = 9, 8


def config(tiny_data, tmp_path, name):
    d = tiny_run_dict(tiny_data, tmp_path / "runs", max_steps=MAX_STEPS,
                      hang_timeout_s=HANG_TIMEOUT_S)
    d["name"] = name
    d["checkpoint"] = {"every_n_steps": 2}
    d["logging"] = {"log_every": 1}
    return write_run_config(tmp_path / f"{name}.yaml", d)


def test_a_killed_and_a_hung_rank_are_restarted_and_the_run_matches_an_uninterrupted_one(
        tiny_data, tmp_path):
    ref = launch(config(tiny_data, tmp_path, "reference"), ["launch.max_restarts=0"])
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]

    fired = tmp_path / "fired"
    plan = {"fired_dir": str(fired), "faults": [
        {"id": 0, "kind": "kill", "rank": 1, "step": 4, "phase": "backward"},
        {"id": 1, "kind": "hang", "rank": 1, "step": 7, "phase": "forward", "seconds": 600}]}
    proc = launch(config(tiny_data, tmp_path, "faulty"), plan=plan)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    run_dir = tmp_path / "runs" / "faulty"

    assert "restart 1/3: rank 1 exited with signal SIGKILL at step 4; resuming from " \
           f"{run_dir / 'checkpoints' / 'step_0000002'}" in out
    second = restarts(run_dir)[1]
    assert (second["returncode"], second["signal"], second["step"]) == (HANG_EXIT_CODE, None, 7)
    assert second["resume"].endswith("step_0000006")
    # The hang was detected within the timeout (plus the watchdog's polling), not waited out.
    hung_at = float((fired / "fault_1").read_text())
    ends = [json.loads(line) for line in
            (run_dir / "logs" / "exits_rank1.jsonl").read_text().splitlines()]
    hang_end = next(e for e in ends if e["returncode"] == HANG_EXIT_CODE)
    assert hang_end["time"] - hung_at < HANG_TIMEOUT_S + 4
    stacks = hang_file(run_dir / "logs", 1).read_text()
    assert "the last completed step is 6" in stacks and "in _fire" in stacks
    assert "last collective entered" in stacks

    ref_dir = tmp_path / "runs" / "reference"
    assert loss_mismatches(run_dir, ref_dir, MAX_STEPS) == []
    assert sample_problems(run_dir, MAX_STEPS, global_batch=4) == []
    assert checkpoint_problems(run_dir) == []
    # Nothing written before a restart is lost: rank 0's log holds both resumptions, and every
    # attempt wrote its own TensorBoard event file.
    assert (run_dir / "logs" / "rank0.log").read_text().count("resumed from") == 2
    assert len(list((run_dir / "tensorboard").glob("events.*"))) == 3
