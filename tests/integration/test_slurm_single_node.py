"""moe-launch --scheduler slurm against a real single-node SLURM cluster started by the test:
2 tasks, expert parallelism 2, preempted by SIGUSR1, requeued, resumed, finished. The run
directory, job name and an environment value are hostile strings that must arrive literally."""

import time

import pytest

from tests.conftest import tiny_run_dict
from tests.helpers.slurm_cluster import single_node_cluster, wait_for
from tests.integration.launch_checks import check_finished_run, moe_launch, write_config

pytestmark = pytest.mark.integration

HOSTILE = "x; rm -rf \"$HOME\" $(touch {s}) `touch {s}` 'q' \\ #"




def test_slurm_two_tasks_ep2_preempt_requeue_resume(tiny_data, tmp_path):
    sentinel = tmp_path / "SENTINEL"
    hostile = HOSTILE.format(s=sentinel)
    # SLURM reads '\\' and '%' in log paths as its own patterns: the launcher refuses those there.
    out_dir = tmp_path / f"runs {hostile.replace(chr(92), '')}"
    max_steps = 150  # about 10 s of steps: room for the signal to land mid-run under load
    run = tiny_run_dict(tiny_data, out_dir, max_steps=max_steps)
    run["checkpoint"] = {"every_n_steps": 0}
    run["launch"] = {"scheduler": "slurm", "env": {"MOE_TEST_VALUE": hostile},
                     "slurm": {"job_name": hostile, "cpus_per_task": 1}}
    config = write_config(tmp_path / "tiny.yaml", run)
    run_dir = out_dir / "tiny"

    with single_node_cluster(tmp_path / "cluster") as cluster:
        t0 = time.time()
        proc = moe_launch([str(config)], env=cluster.env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        job_id = proc.stdout.split("submitted SLURM job ")[1].split()[0]
        assert cluster.run(["squeue", "-h", "-j", job_id, "-o", "%j"]).stdout.rstrip("\n") \
            == hostile

        # Preempt mid-run: SIGUSR1 to the ranks, as SLURM sends it before the time limit.
        rank0 = run_dir / "logs" / "rank0.log"
        wait_for(lambda: rank0.exists() and "step     2/" in rank0.read_text(), 240,
                 "no training step", cluster)
        # The ranks' own environment holds the hostile value, byte for byte.
        rows = [r.split() for r in cluster.run(["scontrol", "listpids", job_id]).stdout
                .splitlines()[1:]]
        environs = [open(f"/proc/{r[0]}/environ", "rb").read() for r in rows
                    if len(r) == 5 and r[4].isdigit()]
        assert any(b"MOE_TEST_VALUE=" + hostile.encode() + b"\0" in e for e in environs)
        assert cluster.run(["scancel", "--signal=USR1", job_id]).returncode == 0

        state = cluster.wait_job(job_id, 400)
        seconds = time.time() - t0
        assert state == "COMPLETED", cluster.logs() + (run_dir / "logs").joinpath(
            f"slurm-{job_id}.out").read_text()[-4000:]
        assert cluster.job_field(job_id, "Restarts") == "1"
        status = moe_launch(["status", str(run_dir)], env=cluster.env)
        assert f"job {job_id}: COMPLETED" in status.stdout, status.stdout + status.stderr

    log = rank0.read_text()
    assert "SIGUSR1: saved step" in log and "resumed from" in log, log[-3000:]
    saved = int(log.split("SIGUSR1: saved step ")[1].split(";")[0])
    assert 2 <= saved < max_steps
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{saved:07d}'} at step {saved}" in log
    assert (run_dir / "checkpoints" / f"step_{saved:07d}").is_dir()
    # The job log: srun's exit code 75 explained as a preemption, the step it resumes from, then
    # (once, after the requeued run finished) the evaluation; no rank printed a FutureWarning.
    job_log = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert "the exit code 75 above is the planned exit of a preempted run, not a failure" \
        in job_log, job_log[-3000:]
    assert f"preempted, requeued, will resume from step {saved} (requeueing job {job_id})" \
        in job_log
    assert job_log.count("training finished; evaluating the final checkpoint on one task") == 1
    assert f"eval report     {run_dir / 'checkpoints' / f'step_{max_steps:07d}' / 'eval'}" \
        in job_log
    assert "FutureWarning" not in job_log
    check_finished_run(run_dir, max_steps)
    assert not sentinel.exists()
    print(f"\nsingle-node SLURM job (submit, preempt, requeue, finish): {seconds:.1f}s")
