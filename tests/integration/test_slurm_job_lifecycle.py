"""The life of a SLURM job against a real single-node cluster (one cluster for the module): a
2-task job through a signal during start-up, a killed rank (restarted inside the allocation), a
preemption and its finish; refused resubmission, status and cancel, logs, the pre-submit check."""

import json
import shlex

import pytest

from moe.training.resilience.faults import PLAN_ENV
from tests.conftest import tiny_run_dict
from tests.helpers import fault_runs as fr
from tests.helpers.slurm_cluster import single_node_cluster, wait_for
from tests.integration.launch_checks import check_finished_run, moe_launch, write_config

pytestmark = [pytest.mark.integration, pytest.mark.slurm]

HOSTILE = "x; rm -rf \"$HOME\" $(touch {s}) `touch {s}` 'q' \\ #"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # A second partition that takes only the account "physics". Without an accounting database
    # sbatch --test-only accepts any account there (checked): moe-launch's own check refuses it.
    restricted = (
        "PartitionName=restricted Nodes=ALL AllowAccounts=physics MaxTime=INFINITE State=UP"
    )
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


def test_one_job_through_a_start_up_signal_a_killed_rank_a_preemption_and_the_finish(
    tiny_data, tmp_path, cluster
):
    """2 tasks, expert parallelism 2, hostile run directory, job name and environment value
    (they must arrive literally). In one job: ``scancel --signal=TERM`` to the ranks while they
    start (what a grace-time preemption sends; ``checkpoint.save_on_signals`` does not list
    TERM): requeued without a checkpoint, no restart. Then rank 1 is killed at step 25 (SIGKILL,
    the test-only fault plan): the supervisor starts srun again in the same allocation from the
    step-20 checkpoint (launch.max_restarts), naming the rank. Then ``scancel --batch
    --signal=TERM`` mid-run (to the supervisor, which passes USR1 on to the ranks): checkpoint,
    requeue, resume. Then the finish and one evaluation. Every sample index is consumed exactly
    once over the whole history."""
    sentinel = tmp_path / "SENTINEL"
    hostile = HOSTILE.format(s=sentinel)
    # SLURM reads '\\' and '%' in log paths as its own patterns: the launcher refuses those there.
    out_dir = tmp_path / f"runs {hostile.replace(chr(92), '')}"
    max_steps, kill_at = 200, 25
    run = tiny_run_dict(tiny_data, out_dir, max_steps=max_steps)
    run["checkpoint"] = {"every_n_steps": 20}
    plan = tmp_path / "faults" / "plan.json"
    plan.parent.mkdir()
    plan.write_text(
        json.dumps(
            {
                "fired_dir": str(plan.parent),
                "faults": [
                    {"id": 0, "kind": "kill", "rank": 1, "step": kill_at, "phase": "backward"}
                ],
            }
        )
    )
    run["launch"] = {
        "scheduler": "slurm",
        "env": {"MOE_TEST_VALUE": hostile, PLAN_ENV: str(plan)},
        "slurm": {"job_name": hostile, "cpus_per_task": 1},
    }
    config = write_config(tmp_path / "tiny.yaml", run)
    run_dir = out_dir / "tiny"
    job_id = submit(config, cluster)
    assert cluster.run(["squeue", "-h", "-j", job_id, "-o", "%j"]).stdout.rstrip("\n") == hostile
    rank0, job_log_path = run_dir / "logs" / "rank0.log", run_dir / "logs" / f"slurm-{job_id}.out"

    # 1. TERM to the ranks while they start: held, nothing to save, requeued.
    wait_for(rank0.exists, 120, "the rank did not start", cluster)
    assert "step " not in rank0.read_text()  # still starting: imports, DeepSpeed, data
    assert cluster.run(["scancel", "--signal=TERM", job_id]).returncode == 0
    wait_for(
        lambda: "requeueing job" in job_log_path.read_text(),
        120,
        "no requeue",
        cluster,
        job_log=job_log_path,
    )

    # 2. Rank 1 killed at step 25: srun started again in the allocation, from step 20.
    wait_for(
        lambda: "launch: restart 1/3: " in job_log_path.read_text(),
        240,
        "no restart inside the allocation",
        cluster,
    )

    # The ranks' own environment holds the hostile value, byte for byte.
    def rank_environs() -> list[bytes]:
        environs = []
        for r in cluster.run(["scontrol", "listpids", job_id]).stdout.splitlines()[1:]:
            r = r.split()
            if len(r) == 5 and r[4].isdigit():  # a task of the srun step (not the batch step)
                try:
                    environs.append(open(f"/proc/{r[0]}/environ", "rb").read())
                except OSError:
                    pass  # a step process that ended meanwhile
        return environs

    wait_for(
        lambda: any(b"MOE_TEST_VALUE=" + hostile.encode() + b"\0" in e for e in rank_environs()),
        60,
        "no rank with the hostile value",
        cluster,
    )

    # 3. TERM to the supervisor once the restarted attempt steps: checkpoint, requeue, resume.
    resumed_20 = f"resumed from {run_dir / 'checkpoints' / 'step_0000020'} at step 20"
    wait_for(
        lambda: (
            resumed_20 in rank0.read_text() and "] step " in rank0.read_text().split(resumed_20)[-1]
        ),
        240,
        "the restarted attempt did not step",
        cluster,
    )
    assert cluster.run(["scancel", "--batch", "--signal=TERM", job_id]).returncode == 0
    state = cluster.wait_job(job_id, 400)
    job_log = job_log_path.read_text()
    assert state == "COMPLETED", cluster.logs() + job_log[-4000:]
    assert cluster.job_field(job_id, "Restarts") == "2"  # two requeues; the kill was not one

    log = rank0.read_text()
    # The ranks held the TERM and stopped before their first step. When it also reached a process
    # a rank was running (DeepSpeed's ninja probe while it loads its op), that rank failed first:
    # it exits as preempted all the same (launch/train.py), and the job is requeued, not restarted.
    # That rank may be rank 1, and rank 0, still starting, is then ended with the step before it
    # logs anything: the record is in one of the ranks' logs, not always in rank 0's.
    rank_logs = {r: (run_dir / "logs" / f"rank{r}.log").read_text() for r in (0, 1)}
    assert any(
        "SIGTERM before the first step: nothing to save" in text
        or "after SIGTERM: taken as the stop the signal asked for" in text
        for text in rank_logs.values()
    ), "\n".join(f"rank {r}: {text[:3000]}" for r, text in rank_logs.items())
    assert (
        f"launch: restart 1/3: rank 1 exited with signal SIGKILL at step {kill_at}; "
        f"resuming from {run_dir / 'checkpoints' / 'step_0000020'}"
    ) in job_log, job_log[-3000:]
    assert job_log.count("launch: restart") == 1  # never for a signal
    saved = int(log.split("SIGUSR1: saved step ")[1].split(";")[0])
    assert 20 < saved < max_steps  # after the restart from step 20
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{saved:07d}'} at step {saved}" in log
    # srun's "Exited with exit code 75" is the planned exit of a preemption, and says so.
    exited = job_log.index("Exited with exit code 75")
    assert job_log.index("the exit code 75 above is the planned exit of a preempted run") > exited
    assert "preempted, requeued, will resume from step 0" in job_log
    assert (
        f"preempted, requeued, will resume from step {saved} (requeueing job {job_id})" in job_log
    )
    # Evaluated once, in the same allocation, after the last requeued run finished.
    assert job_log.count("training finished; evaluating the final checkpoint on one task") == 1
    assert job_log.rindex("requeueing job") < job_log.index("training finished")
    tail = job_log.splitlines()[-2:]
    report = run_dir / "checkpoints" / f"step_{max_steps:07d}" / "eval" / "report.md"
    assert tail == [
        f"eval report     {report}",
        f"compare         moe-eval --all {shlex.quote(str(run_dir))}   (every checkpoint of "
        "the run, one table)",
    ], job_log[-2000:]
    assert report.is_file() and (report.parent / "eval.json").is_file()
    assert "FutureWarning" not in job_log
    check_finished_run(run_dir, max_steps)
    assert fr.sample_problems(run_dir, max_steps, global_batch=4) == []
    assert not sentinel.exists()

    status = moe_launch(["status", str(run_dir)], env=cluster.env)
    assert f"job {job_id}: COMPLETED" in status.stdout, status.stdout + status.stderr
    job_out = moe_launch(["logs", str(run_dir)], env=cluster.env)
    assert job_out.returncode == 0 and "requeueing job" in job_out.stdout, job_out.stderr
    rank_out = moe_launch(["logs", str(run_dir), "--rank", "0"], env=cluster.env)
    # The rank's whole log, whichever of the two start-up stops above it recorded.
    assert rank_out.stdout == f"==> {rank0} <==\n" + log, rank_out.stderr


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
    wait_for(
        lambda: steps.exists() and len(steps.read_text().splitlines()) >= 3,
        180,
        "no steps logged",
        cluster,
    )
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
    assert (
        second.returncode != 0 and f"nothing cancelled: job {job_id} is CANCELLED" in second.stderr
    ), second.stderr
    unknown = moe_launch(["cancel", "999999"], env=cluster.env)
    assert (
        unknown.returncode != 0 and "nothing cancelled: job 999999 is unknown" in unknown.stderr
    ), unknown.stderr
    assert json.loads((run_dir / "slurm_jobs.json").read_text())[0]["state"] == "CANCELLED"
    # The cancel's TERM reached the ranks, which save on it under SLURM (within KillWait).
    latest = run_dir / "checkpoints" / "latest"
    saved = int(latest.read_text().split("_")[1]) if latest.exists() else 0
    # The job is over: the same run may be submitted again; it goes on from there.
    end = saved + 2
    resubmitted = submit(config, cluster, f"train.max_steps={end}", "--no-eval")
    # logs -f follows the job log while the job runs and returns once it is over
    followed = moe_launch(["logs", str(run_dir), "-f"], env=cluster.env, timeout=300)
    assert followed.returncode == 0, followed.stderr
    assert f"job {resubmitted} (restart 0, attempt 1): " in followed.stdout
    assert f"step {end:>5}/{end}" in followed.stdout, followed.stdout[-3000:]
    assert "training finished; evaluation skipped (--no-eval)" in followed.stdout
    assert not (run_dir / "checkpoints" / f"step_{end:07d}" / "eval").exists()
    assert cluster.wait_job(resubmitted, 60) == "COMPLETED"
    jobs = json.loads((run_dir / "slurm_jobs.json").read_text())
    assert [j["job_id"] for j in jobs] == [job_id, resubmitted]


@pytest.mark.parametrize(
    "overrides, reason, finding",
    [
        (
            ["launch.slurm.partition=nosuchpartition"],
            "Invalid partition name specified",
            "launch.slurm.partition: SLURM has no partition 'nosuchpartition' (partitions: debug, "
            "restricted)",
        ),
        (
            ["launch.slurm.cpus_per_task=64"],
            "Requested node configuration is not available",
            "launch.slurm.cpus_per_task: 1 tasks per node x 64 CPUs = 64 CPUs per node, but the "
            "largest node of partition 'debug' has 2",
        ),
        (
            ["launch.slurm.nodes=2", "parallel.world_size=2"],
            "Requested node configuration is not available",
            "launch.slurm.nodes: 2 nodes requested, partition 'debug' has 1",
        ),
        (
            ["launch.slurm.gpus_per_node=1"],
            "Invalid generic resource (gres) specification",
            "launch.slurm.gpus_per_node: 1 GPUs per node requested, but the nodes of partition 'debug' "
            "have no GPUs",
        ),
        (
            ["launch.slurm.partition=restricted", "launch.slurm.account=chemistry"],
            None,
            "launch.slurm.account: partition 'restricted' allows only the accounts physics, not "
            "'chemistry'",
        ),
    ],
)
def test_impossible_requests_are_refused_before_any_data_work(
    tiny_data, tmp_path, cluster, overrides, reason, finding
):
    """Each case against the real controller: SLURM's own reason from ``sbatch --test-only``
    where it gives one, and what the partition lacks, named by config key."""
    config, run_dir = slurm_run(tiny_data, tmp_path)
    # A finished run's directory, submitted again with an impossible request: refused, and
    # left byte-identical.
    records = [
        {"job_id": "424242", "submitted": "t", "script": "s", "log": "l", "state": "COMPLETED"}
    ]
    files = {
        "config.yaml": "old config\n",
        "job.sbatch": "old script\n",
        "plan.json": "{}\n",
        "slurm_jobs.json": json.dumps(records),
    }
    run_dir.mkdir(parents=True)
    for name, text in files.items():
        (run_dir / name).write_text(text)
    proc = moe_launch([str(config), *overrides], env=cluster.env)
    assert proc.returncode != 0
    assert {p.name: p.read_text() for p in run_dir.iterdir()} == files
    assert "SLURM would refuse this job; nothing was prepared or submitted" in proc.stderr, (
        proc.stderr
    )
    said = [line for line in proc.stderr.splitlines() if "sbatch --test-only: " in line]
    if reason is not None:  # SLURM's own words
        assert len(said) == 1 and reason in said[0], proc.stderr
    else:
        assert said == [], proc.stderr
    assert f"  - {finding}" in proc.stderr, proc.stderr
    assert "data:" not in proc.stdout
    assert cluster.run(["squeue", "-h"]).stdout.strip() == ""


def test_time_limits_as_sbatch_reads_them_and_a_job_slurm_forgot(tiny_data, tmp_path, cluster):
    """``time: 30`` is 30 minutes, ``0`` no limit, an unquoted ``0:30`` 30 seconds (never
    YAML's base-60 30; the controller rounds it up to a minute), as the controller itself
    reports them. Then, without accounting: a job
    whose records say it was requeued but that the controller does not know is finished (state
    unknown), status exits 1, and the run directory takes a new job."""
    limits = {}
    for name, value in [("thirty", "30"), ("none", "0"), ("seconds", "0:30")]:
        config, run_dir = slurm_run(tiny_data, tmp_path, name=name, signal_seconds=0)
        # Unquoted on the command line: read as YAML, as in a config file.
        job_id = submit(config, cluster, f"launch.slurm.time={value}", "train.max_steps=100000")
        limits[name] = cluster.run(["squeue", "-h", "-j", job_id, "-o", "%l"]).stdout.strip()
        cluster.run(["scancel", job_id])
    # SLURM counts limits in whole minutes: 30 seconds become one minute, never 30 minutes.
    assert limits == {"thirty": "30:00", "none": "UNLIMITED", "seconds": "1:00"}, limits

    config, run_dir = slurm_run(tiny_data, tmp_path, name="phantom")
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "slurm_jobs.json").write_text(
        json.dumps(
            [{"job_id": "999999", "submitted": "t", "script": "s", "log": "l", "state": None}]
        )
    )
    (run_dir / "slurm_job_ends.txt").write_text("999999 75 requeued 5\n")
    status = moe_launch(["status", str(run_dir)], env=cluster.env)
    assert status.returncode == 1, status.stdout + status.stderr
    first = status.stdout.splitlines()[0]
    assert first.startswith("job 999999: finished, final state unknown"), status.stdout
    assert "jobs of the run 999999 (finished, final state unknown)" in status.stdout
    job_id = submit(config, cluster, "train.max_steps=100000")  # not refused
    assert moe_launch(["cancel", str(run_dir)], env=cluster.env).returncode == 0
    assert [j["job_id"] for j in json.loads((run_dir / "slurm_jobs.json").read_text())] == [
        "999999",
        job_id,
    ]
