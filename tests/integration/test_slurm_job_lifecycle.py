"""The life of a SLURM job against a real single-node cluster (one cluster for the module):
signals during start-up, refused resubmission, status and cancel, logs, the pre-submit check.
Tiny one-rank runs of a few steps."""

import json

import pytest

from tests.conftest import tiny_run_dict
from tests.helpers.slurm_cluster import single_node_cluster, wait_for
from tests.integration.launch_checks import moe_launch, write_config

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # A second partition that takes only the account "physics". Without an accounting database
    # sbatch --test-only accepts any account there (checked): moe-launch's own check refuses it.
    restricted = "PartitionName=restricted Nodes=ALL AllowAccounts=physics MaxTime=INFINITE State=UP"
    with single_node_cluster(tmp_path_factory.mktemp("cluster"), partitions=(restricted,)) as c:
        yield c




def slurm_run(tiny_data, tmp_path, name="tiny", max_steps=6, **slurm) -> tuple:
    run = tiny_run_dict(tiny_data, tmp_path / "runs", max_steps=max_steps)
    run["name"] = name
    run["parallel"] = {"world_size": 1, "expert_parallel_size": 1, "zero_stage": 2}
    run["checkpoint"] = {"every_n_steps": 0}
    run["launch"] = {"scheduler": "slurm", "slurm": {"cpus_per_task": 1, **slurm}}
    return write_config(tmp_path / f"{name}.yaml", run), tmp_path / "runs" / name


def submit(config, cluster, *overrides) -> str:
    proc = moe_launch([str(config), *overrides], env=cluster.env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout.split("submitted SLURM job ")[1].split()[0]


def test_usr1_to_the_batch_shell_during_start_up_requeues_cleanly(tiny_data, tmp_path, cluster):
    """``scancel --signal=USR1 --batch`` (what ``--signal=B:USR1@N`` does) while the rank is
    still starting: the script passes it on, the rank exits 75 without a checkpoint, the job is
    requeued and then finishes."""
    config, run_dir = slurm_run(tiny_data, tmp_path)
    job_id = submit(config, cluster)
    rank0 = run_dir / "logs" / "rank0.log"
    wait_for(rank0.exists, 120, "the rank did not start", cluster)
    assert "step " not in rank0.read_text()  # still starting: imports, DeepSpeed, data
    assert cluster.run(["scancel", "--signal=USR1", "--batch", job_id]).returncode == 0
    state = cluster.wait_job(job_id, 300)
    job_log = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert state == "COMPLETED", job_log[-3000:]
    assert cluster.job_field(job_id, "Restarts") == "1"
    log = rank0.read_text()
    assert "SIGUSR1 before the first step: nothing to save" in log, log[-3000:]
    assert "requeueing job" in job_log
    # srun's "Exited with exit code 75" is the planned exit of a preemption, and says so.
    exited = job_log.index("Exited with exit code 75")
    assert job_log.index("the exit code 75 above is the planned exit of a preempted run") > exited
    assert "preempted, requeued, will resume from step 0" in job_log
    # Evaluated once, in the same allocation, after the requeued run finished; not after exit 75.
    assert job_log.count("training finished; evaluating the final checkpoint on one task") == 1
    assert job_log.index("requeueing job") < job_log.index("training finished")
    tail = job_log.splitlines()[-2:]
    report = run_dir / "checkpoints" / "step_0000006" / "eval" / "report.md"
    assert tail == [f"eval report     {report}",
                    f"compare         moe-eval --all {run_dir}   (every checkpoint of the run, "
                    "one table)"], job_log[-2000:]
    assert report.is_file() and (report.parent / "eval.json").is_file()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_0000006"
    job_out = moe_launch(["logs", str(run_dir)], env=cluster.env)
    assert job_out.returncode == 0 and "requeueing job" in job_out.stdout, job_out.stderr
    rank_out = moe_launch(["logs", str(run_dir), "--rank", "0"], env=cluster.env)
    assert "SIGUSR1 before the first step" in rank_out.stdout, rank_out.stderr


def test_resubmit_refused_while_queued_status_then_cancel(tiny_data, tmp_path, cluster):
    config, run_dir = slurm_run(tiny_data, tmp_path, max_steps=100000, time="10:00")
    job_id = submit(config, cluster)
    resolved = (run_dir / "config.yaml").read_text()

    # Resubmitting into the run directory of a queued or running job: refused, nothing touched.
    again = moe_launch([str(config), "train.lr=0.5"], env=cluster.env)
    assert again.returncode != 0
    assert f"belongs to SLURM job {job_id}" in again.stderr, again.stderr
    assert f"moe-launch cancel {run_dir}" in again.stderr and "name=" in again.stderr
    assert (run_dir / "config.yaml").read_text() == resolved
    assert [j["job_id"] for j in json.loads((run_dir / "slurm_jobs.json").read_text())] == [job_id]

    # status: state, elapsed and limit, the last logged step, checkpoint, log paths.
    steps = run_dir / "logs" / "steps_rank0.jsonl"
    wait_for(lambda: steps.exists() and len(steps.read_text().splitlines()) >= 3, 180,
             "no steps logged", cluster)
    out = moe_launch(["status", str(run_dir)], env=cluster.env)
    assert out.returncode == 0, out.stderr
    assert f"job {job_id}: RUNNING" in out.stdout and "of 10:00" in out.stdout, out.stdout
    assert "last step       " in out.stdout and "loss " in out.stdout
    assert "checkpoint      none yet" in out.stdout
    assert f"job log         {run_dir / 'logs' / f'slurm-{job_id}.out'}" in out.stdout

    # cancel: says what happened; a second cancel, or an unknown job, cancels nothing: exit != 0.
    first = moe_launch(["cancel", str(run_dir)], env=cluster.env)
    assert first.returncode == 0, first.stderr
    assert f"cancelled SLURM job {job_id} (was RUNNING)" in first.stdout
    second = moe_launch(["cancel", job_id], env=cluster.env)
    assert second.returncode != 0 and f"nothing cancelled: job {job_id} is CANCELLED" \
        in second.stderr, second.stderr
    unknown = moe_launch(["cancel", "999999"], env=cluster.env)
    assert unknown.returncode != 0 and "nothing cancelled: job 999999 is unknown" \
        in unknown.stderr, unknown.stderr
    assert json.loads((run_dir / "slurm_jobs.json").read_text())[0]["state"] == "CANCELLED"
    # The job is over: the same run may be submitted again.
    resubmitted = submit(config, cluster, "train.max_steps=2", "--no-eval")
    # logs -f follows the job log while the job runs and returns once it is over
    followed = moe_launch(["logs", str(run_dir), "-f"], env=cluster.env, timeout=300)
    assert followed.returncode == 0, followed.stderr
    assert f"job {resubmitted} (restart 0, attempt 1): " in followed.stdout
    assert "step     2/2" in followed.stdout, followed.stdout[-3000:]
    assert "training finished; evaluation skipped (--no-eval)" in followed.stdout
    assert not (run_dir / "checkpoints" / "step_0000002" / "eval").exists()
    assert cluster.wait_job(resubmitted, 60) == "COMPLETED"
    jobs = json.loads((run_dir / "slurm_jobs.json").read_text())
    assert [j["job_id"] for j in jobs] == [job_id, resubmitted]


@pytest.mark.parametrize("overrides, reason, finding", [
    (["launch.slurm.partition=nosuchpartition"], "Invalid partition name specified",
     "launch.slurm.partition: SLURM has no partition 'nosuchpartition' (partitions: debug, "
     "restricted)"),
    (["launch.slurm.cpus_per_task=64"], "Requested node configuration is not available",
     "launch.slurm.cpus_per_task: 1 tasks per node x 64 CPUs = 64 CPUs per node, but the "
     "largest node of partition 'debug' has 2"),
    (["launch.slurm.nodes=2", "parallel.world_size=2"],
     "Requested node configuration is not available",
     "launch.slurm.nodes: 2 nodes requested, partition 'debug' has 1"),
    (["launch.slurm.gpus_per_node=1"], "Invalid generic resource (gres) specification",
     "launch.slurm.gpus_per_node: 1 GPUs per node requested, but the nodes of partition 'debug' "
     "have no GPUs"),
    (["launch.slurm.partition=restricted", "launch.slurm.account=chemistry"], None,
     "launch.slurm.account: partition 'restricted' allows only the accounts physics, not "
     "'chemistry'"),
])
def test_impossible_requests_are_refused_before_any_data_work(tiny_data, tmp_path, cluster,
                                                              overrides, reason, finding):
    """Each case against the real controller: SLURM's own reason from ``sbatch --test-only``
    where it gives one, and what the partition lacks, named by config key."""
    config, run_dir = slurm_run(tiny_data, tmp_path)
    proc = moe_launch([str(config), *overrides], env=cluster.env)
    assert proc.returncode != 0
    assert "SLURM would refuse this job; nothing was prepared or submitted" in proc.stderr, \
        proc.stderr
    said = [line for line in proc.stderr.splitlines() if "sbatch --test-only: " in line]
    if reason is not None:  # SLURM's own words
        assert len(said) == 1 and reason in said[0], proc.stderr
    else:
        assert said == [], proc.stderr
    assert f"  - {finding}" in proc.stderr, proc.stderr
    assert "data:" not in proc.stdout and not (run_dir / "slurm_jobs.json").exists()
    assert cluster.run(["squeue", "-h"]).stdout.strip() == ""
