"""The fault campaign in CI: one 2-rank training job (checkpoints every step, validation every
2 steps) takes 10 seeded faults, each of SIGKILL of a random rank in the forward, the backward,
the optimizer step, a checkpoint save and the evaluation, SIGTERM, a hang and a failed save, and
recovers from each by itself (launch.max_restarts). At the end: every step's loss equals an
uninterrupted run's on every rank (fp32, bitwise), every global sample index was consumed exactly
once, every checkpoint verifies. benchmarks/fault_campaign.py runs the same with 100 faults."""

import pytest

from tests.conftest import tiny_run_dict
from tests.helpers.fault_runs import (
    campaign_figures,
    campaign_plan,
    campaign_steps,
    checkpoint_problems,
    launch,
    loss_mismatches,
    sample_problems,
    write_run_config,
)

pytestmark = pytest.mark.integration

FAULTS, SEED, EVAL_EVERY, HANG_S = 10, 1234, 2, 6


def config(tiny_data, tmp_path, name):
    d = tiny_run_dict(tiny_data, tmp_path / "runs", max_steps=campaign_steps(FAULTS),
                      hang_timeout_s=HANG_S)
    d.update(name=name, checkpoint={"every_n_steps": 1, "keep_last": 3},
             logging={"log_every": 1, "tensorboard": False},
             eval={"every_n_steps": EVAL_EVERY, "max_tokens": 256, "batch_size": 2})
    d["launch"] = {"max_restarts": FAULTS + 2}
    return write_run_config(tmp_path / f"{name}.yaml", d)


def test_ten_faults_in_one_job_recover_to_the_uninterrupted_run(tiny_data, tmp_path):
    steps = campaign_steps(FAULTS)
    ref = launch(config(tiny_data, tmp_path, "reference"), ["launch.max_restarts=0"])
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]

    plan = campaign_plan(tmp_path / "fired", FAULTS, SEED, EVAL_EVERY, HANG_S)
    assert {(f["kind"], f["phase"]) for f in plan["faults"]} >= {
        ("kill", p) for p in ("forward", "backward", "optimizer", "save", "eval")}
    proc = launch(config(tiny_data, tmp_path, "campaign"), plan=plan, timeout=1800)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    run_dir = tmp_path / "runs" / "campaign"

    figures = campaign_figures(run_dir, plan)
    assert figures["injected"] == FAULTS and figures["restarts"] == FAULTS, figures
    assert all(0 <= n <= 1 for n in figures["recomputed"]), figures  # checkpoint interval: 1
    assert loss_mismatches(run_dir, tmp_path / "runs" / "reference", steps) == []
    assert sample_problems(run_dir, steps, global_batch=4) == []
    assert checkpoint_problems(run_dir) == []
