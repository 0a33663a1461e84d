"""moe-scaling run --scheduler slurm against a real single-node SLURM cluster started by the test:
a 3-run dense sweep of tiny shapes, one job per run, at most 2 at once, in a directory whose name
is hostile shell text. One run is preempted mid-run: its job requeues itself and resumes from its
checkpoint while the sweep waits. One run has a bad config (an srun option that does not exist):
it fails, the others finish and fit, the failure is reported with the run's name, and running the
sweep again while its jobs are queued submits nothing twice, once they ended only the failed
run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from moe.training.resilience.faults import PLAN_ENV
from tests.conftest import tiny_run_dict
from tests.helpers.slurm_cluster import single_node_cluster

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.slurm]

# SLURM reads '%' and '\' in job log paths as its own patterns: the launcher refuses those there.
HOSTILE = "sweep 'q' \"d\" $(touch {s}) `touch {s}`; #"


def scaling(env, *args, timeout=400):
    return subprocess.run(
        [sys.executable, "-m", "launch.scaling", *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def jobs_of(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "slurm_jobs.json").read_text())


def test_a_sweep_runs_as_slurm_jobs_resumes_and_reports_the_failed_run(tiny_data, tmp_path):
    sentinel = tmp_path / "SENTINEL"
    sweep = tmp_path / HOSTILE.format(s=sentinel)
    d = tiny_run_dict(tiny_data, tmp_path / "unused", max_steps=1)
    d["parallel"] = {"world_size": 1, "expert_parallel_size": 1, "zero_stage": 2}
    d["logging"] = {"log_every": 10, "tensorboard": False}
    d["checkpoint"] = {"every_n_steps": 20}
    d["eval"] = {"max_tokens": 2048}
    d["launch"] = {"scheduler": "slurm", "slurm": {"cpus_per_task": 1, "time": "10:00"}}
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(d))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = scaling(
        env,
        "plan",
        base,
        "--budgets",
        "3e9",
        "--families",
        "dense",
        "--widths",
        "64,96,128",
        "--out",
        sweep,
        "--allow-repeat",
        "--min-steps",
        "25",
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    names = [r["name"] for r in json.loads((sweep / "sweep.json").read_text())["runs"]]
    bad = names[-1]
    config = sweep / "configs" / f"{bad}.yaml"
    broken = yaml.safe_load(config.read_text())
    broken["launch"]["slurm"]["srun_args"] = ["--no-such-srun-option"]
    config.write_text(yaml.safe_dump(broken, sort_keys=False))
    runs = {n: sweep / "runs" / n for n in names}
    # The first run is preempted at step 30 (a TERM to its rank, as a grace-time preemption
    # sends): it saves, its job requeues itself and resumes, and the sweep waits through that.
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "plan.json").write_text(
        json.dumps(
            {
                "fired_dir": str(faults),
                "faults": [{"id": 0, "kind": "term", "rank": 0, "step": 30, "phase": "backward"}],
            }
        )
    )
    config = sweep / "configs" / f"{names[0]}.yaml"
    preempted = yaml.safe_load(config.read_text())
    preempted["launch"]["env"] = {PLAN_ENV: str(faults / "plan.json")}
    config.write_text(yaml.safe_dump(preempted, sort_keys=False))

    with single_node_cluster(tmp_path / "cluster") as cluster:
        env = {**cluster.env, "PYTHONPATH": str(ROOT)}
        t0 = time.time()
        out = scaling(env, "run", sweep, "--scheduler", "slurm", "--jobs", "2", "--no-wait")
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert "3 submitted, at most 2 running at once" in out.stdout, out.stdout
        ids = {n: jobs_of(runs[n])[0]["job_id"] for n in names}
        assert (
            cluster.run(["squeue", "-h", "-j", ids[names[0]], "-o", "%j"]).stdout.strip()
            == names[0]
        )
        # The third run waits for one of the first two: never more than 2 at once.
        first_two = {ids[n] for n in names[:2]}
        after = jobs_of(runs[bad])[0]["after"]
        assert after in first_two and "after" not in jobs_of(runs[names[0]])[0]

        # Again while they are queued or running (the configs say slurm: the default): nothing
        # submitted twice; it waits, with a progress line, and reports the failed run by name.
        out = scaling(env, "run", sweep, "--jobs", "2")
        seconds = time.time() - t0
        text = out.stdout + out.stderr
        assert out.returncode == 2, text[-4000:] + cluster.logs()
        assert "0 submitted" in out.stdout and "3 with a SLURM job queued or running" in out.stdout
        assert "runs 2/3" in out.stdout and "FLOP" in out.stdout
        assert f"1 run(s) failed: {bad} (job {ids[bad]} FAILED" in out.stderr, text[-4000:]
        assert [len(jobs_of(r)) for r in runs.values()] == [1, 1, 1]
        assert cluster.job_field(ids[bad], "StartTime") >= cluster.job_field(after, "EndTime")
        job_log = (runs[bad] / "logs" / f"slurm-{ids[bad]}.out").read_text()
        assert "no-such-srun-option" in job_log, job_log[-3000:]
        # The preempted run resumed in its own job, requeued once, from the step it saved.
        assert cluster.job_field(ids[names[0]], "Restarts") == "1"
        rank0 = (runs[names[0]] / "logs" / "rank0.log").read_text()
        saved = int(rank0.split(": saved step ")[1].split(";")[0])
        assert f"at step {saved}" in rank0.split("resumed from")[-1], rank0[-3000:]

        # The finished runs leave what a local sweep leaves: the fit reads them.
        for n in names[:2]:
            summary = json.loads((runs[n] / "train_summary.json").read_text())
            assert (Path(summary["checkpoint"]) / "eval" / "eval.json").is_file()
        out = scaling(env, "fit", sweep, "--bootstrap", "5")
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert (sweep / "report" / "report.md").is_file()

        # Once the jobs ended: finished runs are skipped, the failed one alone submitted again.
        out = scaling(env, "run", sweep, "--scheduler", "slurm", "--jobs", "2")
        assert out.returncode == 2 and f"1 run(s) failed: {bad}" in out.stderr, out.stderr
        assert "2 of 3 runs finished" in out.stdout and "1 submitted" in out.stdout
        assert [len(jobs_of(runs[n])) for n in names] == [1, 1, 2]
    assert not sentinel.exists()
    print(f"\nSLURM sweep of 3 runs, 2 at a time (to the reported failure): {seconds:.1f}s")
