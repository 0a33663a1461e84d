"""SLURM's own grace-time preemption on a real single-node cluster: a job on a preemptable
partition (``PreemptMode=REQUEUE``, ``GraceTime``) is preempted by a job of a higher-priority
partition. SLURM sends the ranks TERM (``checkpoint.save_on_signals`` does not list it); they save
and exit 75, the job requeues, resumes once the other job is done and finishes with the same
losses as an uninterrupted run, step for step."""

import pytest

from tests.helpers import fault_runs as fr
from tests.helpers.slurm_cluster import single_node_cluster, wait_for
from tests.integration.launch_checks import moe_launch
from tests.integration.test_slurm_job_lifecycle import slurm_run, submit

pytestmark = pytest.mark.integration

PARTITIONS = ("PartitionName=low Nodes=ALL PreemptMode=REQUEUE GraceTime=120 PriorityTier=1 "
              "State=UP",
              "PartitionName=high Nodes=ALL PreemptMode=OFF PriorityTier=10 State=UP")
SETTINGS = ("PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE")


def test_grace_time_preemption_saves_requeues_and_resumes_bitwise(tiny_data, tmp_path):
    max_steps = 120
    config, run_dir = slurm_run(tiny_data, tmp_path, name="low", max_steps=max_steps,
                                partition="low", cpus_per_task=2)
    reference = moe_launch([str(config), "--scheduler", "local", "--no-eval", "name=reference"])
    assert reference.returncode == 0, reference.stderr[-3000:]
    with single_node_cluster(tmp_path / "cluster", partitions=PARTITIONS,
                             settings=SETTINGS) as cluster:
        job_id = submit(config, cluster, "--no-eval")
        steps = run_dir / "logs" / "steps_rank0.jsonl"
        wait_for(lambda: steps.exists() and len(steps.read_text().splitlines()) >= 4, 240,
                 "the job did not step", cluster)
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
    assert 4 <= saved < max_steps, log[-2000:]
    assert f"preempted, requeued, will resume from step {saved}" in job_log
    assert "launch: restart" not in job_log
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{saved:07d}'}" in log
    assert fr.loss_mismatches(run_dir, tmp_path / "runs" / "reference", max_steps, ranks=1) == []
