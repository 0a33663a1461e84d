"""The fault campaign in CI: one 2-rank training job (checkpoints every step, validation every
2 steps) takes 8 seeded faults, one of each kind: SIGKILL of a random rank in the forward, the backward,
the optimizer step, a checkpoint save and the evaluation, SIGTERM, a hang and a failed save, and
recovers from each by itself (launch.max_restarts). At the end: every step's loss equals an
uninterrupted run's on every rank (fp32, bitwise), every global sample index was consumed exactly
once, every checkpoint verifies. Each restart is announced with the failing rank, its signal or
exit code and the step; the hang is detected within train.hang_timeout_s (not waited out), with
its stacks and last collective on disk; nothing an earlier attempt wrote is lost.
benchmarks/fault_campaign.py runs the same with 100 faults."""

import json

import pytest

from moe.training.resilience.watchdog import HANG_EXIT_CODE, hang_file, poll_s
from tests.helpers import fault_runs as fr

pytestmark = pytest.mark.integration

FAULTS, SEED = len(fr.FAULTS), 1234  # every kind once: each restart costs seconds


def test_every_kind_of_fault_in_one_job_recovers_to_the_uninterrupted_run(tiny_data, tmp_path):
    ref = fr.launch(
        fr.campaign_config(tiny_data, tmp_path, "reference", FAULTS), ["launch.max_restarts=0"]
    )
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]

    plan = fr.campaign_plan(
        tmp_path / "fired", FAULTS, SEED, fr.CAMPAIGN_EVAL_EVERY, fr.CAMPAIGN_HANG_S
    )
    assert {(f["kind"], f["phase"]) for f in plan["faults"]} == set(fr.FAULTS)
    proc = fr.launch(
        fr.campaign_config(tiny_data, tmp_path, "campaign", FAULTS), plan=plan, timeout=1800
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    run_dir = tmp_path / "runs" / "campaign"

    figures = fr.campaign_figures(run_dir, plan)
    assert figures["injected"] == FAULTS and figures["restarts"] == FAULTS, figures
    assert all(0 <= n <= 1 for n in figures["recomputed"]), figures  # checkpoint interval: 1
    assert fr.campaign_problems(run_dir, tmp_path / "runs" / "reference", FAULTS) == []

    records = fr.restarts(run_dir)
    # The restart after the kill in the forward (a step no other fault fails in) names it.
    kill = next(f for f in plan["faults"] if (f["kind"], f["phase"]) == ("kill", "forward"))
    killed = next(r for r in records if r["step"] == kill["step"])
    assert killed["signal"] == "SIGKILL", killed
    resumed_from = killed["resume"] or "the start (no complete checkpoint yet)"
    assert (
        f"launch: restart {killed['restart']}/{FAULTS + 2}: rank {killed['rank']} exited with "
        f"signal SIGKILL at step {killed['step']}; resuming from {resumed_from}"
    ) in proc.stdout + proc.stderr
    hang = next(f for f in plan["faults"] if f["kind"] == "hang")
    hang_restart = next(r for r in records if r["returncode"] == HANG_EXIT_CODE)
    assert hang_restart["step"] == hang["step"], (hang, hang_restart)
    # Detected within the timeout plus the watchdog's polling and its two readings of the
    # heartbeats (three polls apart), not waited out (the fault sleeps 20 timeouts). Either
    # rank's watchdog may fire first and both exit with HANG_EXIT_CODE once both have reported;
    # the launcher then kills what is left, so the hung rank's own exit may be that kill (or go
    # unrecorded if its recorder is killed with it): the first watchdog exit after the fault is
    # what the bound is about.
    hung_at = float((tmp_path / "fired" / f"fault_{hang['id']}").read_text())
    ends = [
        json.loads(line)
        for r in range(2)
        for line in (run_dir / "logs" / f"exits_rank{r}.jsonl").read_text().splitlines()
    ]
    hang_end = min(
        (e for e in ends if e["returncode"] == HANG_EXIT_CODE and e["time"] > hung_at),
        key=lambda e: e["time"],
    )
    assert hang_end["time"] - hung_at < fr.CAMPAIGN_HANG_S + 4 + 3 * poll_s(fr.CAMPAIGN_HANG_S)
    stacks = hang_file(run_dir / "logs", hang["rank"]).read_text()
    assert f"the last completed step is {hang['step'] - 1}" in stacks and "in _fire" in stacks
    assert "last collective entered" in stacks
    # Nothing written before a restart is lost: rank 0's log holds every resumption, and every
    # attempt wrote its own TensorBoard event file.
    resumed = sum(1 for r in records if r["resume"])
    assert (run_dir / "logs" / "rank0.log").read_text().count("resumed from") == resumed
    assert len(list((run_dir / "tensorboard").glob("events.*"))) == len(records) + 1
