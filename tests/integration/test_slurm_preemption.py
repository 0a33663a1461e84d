"""SLURM's own grace-time preemption on a real single-node cluster: a job on a preemptable
partition (``PreemptMode=REQUEUE``, ``GraceTime``) is preempted by a job of a higher-priority
partition. SLURM sends the ranks TERM (``checkpoint.save_on_signals`` does not list it); they save
and exit 75, the job requeues, resumes once the other job is done and finishes with the same
losses as an uninterrupted run, step for step."""

import json

import pytest
import yaml

from moe.training.resilience.faults import PLAN_ENV
from tests.helpers import fault_runs as fr
from tests.helpers.slurm_cluster import single_node_cluster, wait_for
from tests.integration.launch_checks import moe_launch
from tests.integration.test_slurm_job_lifecycle import slurm_run, submit

pytestmark = pytest.mark.integration

PARTITIONS = ("PartitionName=low Nodes=ALL PreemptMode=REQUEUE GraceTime=120 PriorityTier=1 "
              "State=UP",
              "PartitionName=high Nodes=ALL PreemptMode=OFF PriorityTier=10 State=UP")
SETTINGS = ("PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE")
HOLD_AT = 8


def test_grace_time_preemption_saves_requeues_and_resumes_bitwise(tiny_data, tmp_path):
    max_steps = 120
    config, run_dir = slurm_run(tiny_data, tmp_path, name="low", max_steps=max_steps,
                                partition="low", cpus_per_task=2)
    reference = moe_launch([str(config), "--scheduler", "local", "--no-eval", "name=reference"])
    assert reference.returncode == 0, reference.stderr[-3000:]
    # The job's 120 steps take about 2 s: without a pause SLURM may not preempt it before it
    # ends. The test-only fault plan holds its rank 30 s at step 8 (a sleep: the losses stay
    # the reference's); the preemption's TERM arrives in that pause and is acted on after it.
    plan = tmp_path / "faults" / "plan.json"
    plan.parent.mkdir()
    plan.write_text(json.dumps({"fired_dir": str(plan.parent), "faults": [
        {"id": 0, "kind": "hang", "rank": 0, "step": HOLD_AT, "phase": "forward",
         "seconds": 30}]}))
    job = yaml.safe_load(config.read_text())
    job["launch"]["env"] = {PLAN_ENV: str(plan)}
    config.write_text(yaml.safe_dump(job))
    with single_node_cluster(tmp_path / "cluster", partitions=PARTITIONS,
                             settings=SETTINGS) as cluster:
        job_id = submit(config, cluster, "--no-eval")
        wait_for(lambda: (plan.parent / "fault_0").exists(), 240,
                 f"the job did not reach step {HOLD_AT}", cluster)
        # Needs both CPUs of the node: SLURM preempts the low job to start it.
        high = cluster.run(["sbatch", "--parsable", "-p", "high", "-c", "2", "-o", "/dev/null",
                            "--wrap", "sleep 1"])
        assert high.returncode == 0, high.stderr
        state = cluster.wait_job(job_id, 400)
        job_log = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
        assert state == "COMPLETED", job_log[-3000:]
        assert int(cluster.job_field(job_id, "Restarts")) >= 1
    log = (run_dir / "logs" / "rank0.log").read_text()
    saved = int(log.split("SIGTERM: saved step ")[1].split(";")[0])
    assert HOLD_AT <= saved < max_steps, log[-2000:]
    assert f"preempted, requeued, will resume from step {saved}" in job_log
    assert "launch: restart" not in job_log
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{saved:07d}'}" in log
    assert fr.loss_mismatches(run_dir, tmp_path / "runs" / "reference", max_steps, ranks=1) == []
