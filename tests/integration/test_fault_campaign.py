"""The fault campaign in CI: one 2-rank training job (checkpoints every step, validation every
2 steps) takes 10 seeded faults, each of SIGKILL of a random rank in the forward, the backward,
the optimizer step, a checkpoint save and the evaluation, SIGTERM, a hang and a failed save, and
recovers from each by itself (launch.max_restarts). At the end: every step's loss equals an
uninterrupted run's on every rank (fp32, bitwise), every global sample index was consumed exactly
once, every checkpoint verifies. benchmarks/fault_campaign.py runs the same with 100 faults."""

import pytest

from tests.helpers import fault_runs as fr

pytestmark = pytest.mark.integration

FAULTS, SEED = 10, 1234


def test_ten_faults_in_one_job_recover_to_the_uninterrupted_run(tiny_data, tmp_path):
    ref = fr.launch(fr.campaign_config(tiny_data, tmp_path, "reference", FAULTS),
                    ["launch.max_restarts=0"])
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]

    plan = fr.campaign_plan(tmp_path / "fired", FAULTS, SEED, fr.CAMPAIGN_EVAL_EVERY,
                            fr.CAMPAIGN_HANG_S)
    assert {(f["kind"], f["phase"]) for f in plan["faults"]} == set(fr.FAULTS)
    proc = fr.launch(fr.campaign_config(tiny_data, tmp_path, "campaign", FAULTS), plan=plan,
                     timeout=1800)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    run_dir = tmp_path / "runs" / "campaign"

    figures = fr.campaign_figures(run_dir, plan)
    assert figures["injected"] == FAULTS and figures["restarts"] == FAULTS, figures
    assert all(0 <= n <= 1 for n in figures["recomputed"]), figures  # checkpoint interval: 1
    assert fr.campaign_problems(run_dir, tmp_path / "runs" / "reference", FAULTS) == []
