"""SLURM's own grace-time preemption on a real single-node cluster: a job on a preemptable
partition (``PreemptMode=REQUEUE``, ``GraceTime``) is preempted by a job of a higher-priority
partition. SLURM sends the ranks TERM (``checkpoint.save_on_signals`` does not list it); they save
and exit 75, the job requeues, resumes once the other job is done and finishes with the same
losses as an uninterrupted run, step for step."""

import json
import re
from pathlib import Path

import pytest
import yaml

from moe.training.resilience.faults import PLAN_ENV
from tests.helpers import fault_runs as fr
from tests.helpers.slurm_cluster import single_node_cluster, wait_for
from tests.integration.launch_checks import moe_launch
from tests.integration.test_slurm_job_lifecycle import slurm_run, submit

pytestmark = pytest.mark.integration

PARTITIONS = (
    "PartitionName=low Nodes=ALL PreemptMode=REQUEUE GraceTime=120 PriorityTier=1 State=UP",
    "PartitionName=high Nodes=ALL PreemptMode=OFF PriorityTier=10 State=UP",
)
SETTINGS = ("PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE")
HOLD_AT = 8


def test_grace_time_preemption_saves_requeues_and_resumes_bitwise(tiny_data, tmp_path):
    max_steps = 120
    config, run_dir = slurm_run(
        tiny_data, tmp_path, name="low", max_steps=max_steps, partition="low", cpus_per_task=2
    )
    reference = moe_launch([str(config), "--scheduler", "local", "--no-eval", "name=reference"])
    assert reference.returncode == 0, reference.stderr[-3000:]
    # The job's 120 steps take about 2 s: without a pause SLURM may not preempt it before it
    # ends. The test-only fault plan holds its rank 30 s at step 8 (a sleep: the losses stay
    # the reference's); the preemption's TERM arrives in that pause and is acted on after it.
    plan = tmp_path / "faults" / "plan.json"
    plan.parent.mkdir()
    plan.write_text(
        json.dumps(
            {
                "fired_dir": str(plan.parent),
                "faults": [
                    {
                        "id": 0,
                        "kind": "hang",
                        "rank": 0,
                        "step": HOLD_AT,
                        "phase": "forward",
                        "seconds": 30,
                    }
                ],
            }
        )
    )
    job = yaml.safe_load(config.read_text())
    job["launch"]["env"] = {PLAN_ENV: str(plan)}
    config.write_text(yaml.safe_dump(job))
    with single_node_cluster(
        tmp_path / "cluster", partitions=PARTITIONS, settings=SETTINGS
    ) as cluster:
        job_id = submit(config, cluster, "--no-eval")
        wait_for(
            lambda: (plan.parent / "fault_0").exists(),
            240,
            f"the job did not reach step {HOLD_AT}",
            cluster,
        )
        # Needs both CPUs of the node: SLURM preempts the low job to start it.
        high = cluster.run(
            [
                "sbatch",
                "--parsable",
                "-p",
                "high",
                "-c",
                "2",
                "-o",
                "/dev/null",
                "--wrap",
                "sleep 1",
            ]
        )
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


def job_fields(cluster, job_id: str) -> dict[str, str]:
    """Every ``KEY=VALUE`` of ``scontrol show job`` at once (one call: a fast poll)."""
    out = cluster.run(["scontrol", "show", "job", job_id]).stdout
    return dict(t.split("=", 1) for t in out.split() if "=" in t)


def batch_shell(job_id: str, restarts: int) -> int | None:
    """The pid of the job's batch step process (the child of its ``slurmstepd: [JOB.batch]``:
    the job script's shell, or what it execs) in its run ``restarts``; None before."""
    want = {f"SLURM_JOB_ID={job_id}".encode(), f"SLURM_RESTART_COUNT={restarts}".encode()}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            environ = set((proc / "environ").read_bytes().split(b"\0"))
            if f"SLURM_JOB_ID={job_id}".encode() not in environ:
                continue
            parent = (proc / "stat").read_text().rsplit(")", 1)[1].split()[1]
            stepd = f"slurmstepd: [{job_id}.batch]".encode()
            if not Path(f"/proc/{parent}/cmdline").read_bytes().startswith(stepd):
                continue
        except OSError:
            continue
        counts = {e for e in environ if e.startswith(b"SLURM_RESTART_COUNT=")}
        if want <= environ or (restarts == 0 and not counts):
            return int(proc.name)
    return None


EARLY_SIGNALS = 5


@pytest.mark.slurm
def test_usr1_as_the_job_starts_requeues_it_every_time(tiny_data, tmp_path):
    """USR1 to the batch shell (``scancel --batch``, what ``--signal=B:USR1@N`` sends) the moment
    the job's batch shell runs, five times: the first run and four requeued runs. It lands while
    the shell starts the supervisor and Python starts (0.1-0.2 s), where its default action
    would end the job FAILED, with no requeue; the job script holds it from its first command
    and hands it to the supervisor (launch/slurm/script.py), which requeues the job. (Sent when
    SLURM first says RUNNING, before slurmd has started the shell, SLURM drops it.)"""
    config, run_dir = slurm_run(tiny_data, tmp_path, name="early", max_steps=100_000)
    with single_node_cluster(tmp_path / "cluster") as cluster:
        job_id = submit(config, cluster, "--no-eval")
        job_log = run_dir / "logs" / f"slurm-{job_id}.out"

        def over(run: int) -> bool:
            fields = job_fields(cluster, job_id)
            return fields.get("Restarts") == str(run + 1) or fields.get("JobState") in (
                "FAILED",
                "COMPLETED",
                "CANCELLED",
            )

        for run in range(EARLY_SIGNALS):
            wait_for(
                lambda r=run: batch_shell(job_id, r) is not None,
                240,
                f"run {run} did not start",
                cluster,
                poll=0.005,
                job_log=job_log,
            )
            sent = cluster.run(["scancel", "--batch", "--signal=USR1", job_id])
            assert sent.returncode == 0, sent.stderr
            wait_for(
                lambda r=run: over(r), 120, f"run {run} was not requeued", cluster, job_log=job_log
            )
            fields = job_fields(cluster, job_id)
            assert fields.get("Restarts") == str(run + 1), (
                fields,
                job_log.read_text()[-3000:],
                cluster.logs()[-3000:],
            )
        cluster.run(["scancel", job_id])
        cluster.wait_job(job_id, 120)
    log = job_log.read_text()
    assert log.count("USR1 before srun started: no rank ran, nothing to save") == EARLY_SIGNALS, (
        log[-4000:]
    )
    assert log.count("preempted, requeued, will resume from step 0") == EARLY_SIGNALS
    assert "launch: restart" not in log and "] step " not in log
    requeued = [
        line
        for line in (run_dir / "slurm_job_ends.txt").read_text().splitlines()
        if line.split()[2] == "requeued"
    ]
    assert len(requeued) == EARLY_SIGNALS, requeued


@pytest.mark.slurm
def test_a_cancel_while_the_ranks_start_leaves_the_last_line_and_the_record(tiny_data, tmp_path):
    """``moe-launch cancel`` before the rank's first step ends (imports, DeepSpeed, data, the
    first step's compile): the rank holds the TERM until its first step is done, which comes
    later than SLURM's KillWait (2 s here; ranks of a large model outlast the default 30 s), and
    SLURM kills the job's processes, the supervisor included, before srun ends. The supervisor
    said how the job ended, and recorded it, as the TERM arrived.

    The tiny model's first steps take well under a second, so a cancel sent when the rank's
    task appears can arrive after several steps on a loaded machine. The test-only fault plan
    holds the rank 60 s in the forward of its first step (a sleep, with the TERM handler
    installed, as in a long start-up), and the cancel is sent once the rank is there."""
    config, run_dir = slurm_run(tiny_data, tmp_path, name="cancelled", max_steps=100_000)
    plan = tmp_path / "faults" / "plan.json"
    plan.parent.mkdir()
    hang = {"id": 0, "kind": "hang", "rank": 0, "step": 1, "phase": "forward", "seconds": 60}
    plan.write_text(json.dumps({"fired_dir": str(plan.parent), "faults": [hang]}))
    job = yaml.safe_load(config.read_text())
    job["launch"]["env"] = {PLAN_ENV: str(plan)}
    config.write_text(yaml.safe_dump(job))
    with single_node_cluster(tmp_path / "cluster", settings=("KillWait=2",)) as cluster:
        job_id = submit(config, cluster, "--no-eval")
        job_log = run_dir / "logs" / f"slurm-{job_id}.out"
        wait_for(
            lambda: (plan.parent / "fault_0").exists(),
            240,
            "the rank did not reach its first step",
            cluster,
            job_log=job_log,
        )
        cancelled = moe_launch(["cancel", str(run_dir)], env=cluster.env)
        assert cancelled.returncode == 0, cancelled.stderr
        assert cluster.wait_job(job_id, 120) == "CANCELLED"
        # Until every process of the job is gone: a supervisor still alive could still write.
        wait_for(
            lambda: cluster.run(["squeue", "-h", "-j", job_id]).stdout.strip() == "",
            120,
            "the job's processes did not end",
            cluster,
        )
    log = job_log.read_text()
    rank0 = run_dir / "logs" / "rank0.log"
    assert not rank0.exists() or "] step " not in rank0.read_text()
    # CANCELLED, or COMPLETING while SLURM still ends the job's steps.
    said = [line for line in log.splitlines() if line.startswith(f"job {job_id} is ")]
    assert said and re.match(
        f"job {job_id} is (CANCELLED|COMPLETING .*): not requeued, not "
        f"restarted; submit the same run again to resume from step 0",
        said[0],
    ), log[-3000:]
    assert (run_dir / "slurm_job_ends.txt").read_text().splitlines() == [f"{job_id} 143 ended"]
    status = moe_launch(["status", str(run_dir)], env=cluster.env)
    assert f"job {job_id}: CANCELLED" in status.stdout, status.stdout + status.stderr
