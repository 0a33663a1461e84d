"""Job records of a run directory, without a cluster: the state once SLURM and sacct know
nothing, the last step after a requeue repeated steps, and cancel of a job nobody knows."""

import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from launch.launch import main
from launch.slurm.jobs import last_steps


@pytest.fixture
def no_slurm_memory(tmp_path, monkeypatch):
    """squeue that has forgotten every job and sacct without an accounting database."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, message in [
        ("squeue", "slurm_load_jobs error: Invalid job id specified"),
        ("sacct", "Slurm accounting storage is disabled"),
        ("scancel", "should not be called"),
    ]:
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\necho '{message}' >&2\nexit 1\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")


def test_status_falls_back_to_the_run_directory_records(tmp_path, no_slurm_memory, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "slurm_jobs.json").write_text(
        json.dumps(
            [
                {
                    "job_id": "41",
                    "submitted": "t",
                    "script": "s",
                    "log": "/x/slurm-%j.out",
                    "state": None,
                },
                {
                    "job_id": "42",
                    "submitted": "t",
                    "script": "s",
                    "log": "/x/slurm-%j.out",
                    "state": None,
                },
            ]
        )
    )
    (run_dir / "slurm_job_ends.txt").write_text("42 0 requeued\n42 0 ended\n")
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "latest").write_text("step_0000008\n")
    main(["status", str(run_dir)])
    out = capsys.readouterr().out
    assert "job 42: COMPLETED [from records]" in out
    assert f"checkpoint      {run_dir / 'checkpoints' / 'step_0000008'}" in out
    assert "job log         /x/slurm-42.out" in out
    with pytest.raises(SystemExit) as e:
        main(["cancel", str(run_dir)])
    assert e.value.code != 0
    assert "nothing cancelled: job 42 is COMPLETED [from records]" in capsys.readouterr().err


def test_unknown_job_is_said_to_be_unknown_and_status_exits_non_zero(no_slurm_memory, capsys):
    with pytest.raises(SystemExit) as e:
        main(["status", "999"])
    assert e.value.code == 1
    assert "job 999: unknown to SLURM" in capsys.readouterr().out


def write_records(run_dir: Path, ends: str) -> None:
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "slurm_jobs.json").write_text(
        json.dumps(
            [
                {
                    "job_id": "41",
                    "submitted": "t",
                    "script": "s",
                    "log": "/x/slurm-%j.out",
                    "state": "COMPLETED",
                },
                {
                    "job_id": "42",
                    "submitted": "t",
                    "script": "s",
                    "log": "/x/slurm-%j.out",
                    "state": None,
                },
            ]
        )
    )
    (run_dir / "slurm_job_ends.txt").write_text(ends)


def test_a_requeued_job_slurm_forgot_is_finished_not_requeued_forever(
    tmp_path, no_slurm_memory, capsys
):
    """No accounting: the job requeued itself at step 5, was then killed hard and purged from
    squeue. It is over, its state unknown: status says so (and exits 1), the history line says
    the same, nothing is recorded as if known, and the run directory is free again."""
    run_dir = tmp_path / "run"
    write_records(run_dir, "42 75 requeued 5\n")
    with pytest.raises(SystemExit) as e:
        main(["status", str(run_dir)])
    assert e.value.code == 1
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith(
        "job 42: finished, final state unknown: neither squeue nor sacct knows the job"
    ), out
    assert "REQUEUED" not in out and "will resume" not in out
    assert "jobs of the run 41 (COMPLETED), 42 (finished, final state unknown)" in out
    assert json.loads((run_dir / "slurm_jobs.json").read_text())[1]["state"] is None
    from launch.slurm.jobs import refuse_if_active

    refuse_if_active(run_dir)  # resubmission is not blocked
    with pytest.raises(SystemExit):
        main(["cancel", str(run_dir)])
    assert "nothing cancelled: job 42 is finished, final state unknown" in capsys.readouterr().err


def test_a_job_the_controller_cannot_be_asked_about_still_blocks_resubmission(
    tmp_path, monkeypatch
):
    """squeue failing for another reason (controller down) proves nothing: a requeued job
    stays requeued, and the run directory stays its own."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, message in [
        ("squeue", "slurm_load_jobs error: Unable to contact slurm controller"),
        ("sacct", "Slurm accounting storage is disabled"),
    ]:
        (bin_dir / name).write_text(f"#!/bin/sh\necho '{message}' >&2\nexit 1\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    run_dir = tmp_path / "run"
    write_records(run_dir, "42 75 requeued 5\n")
    from launch.slurm.jobs import refuse_if_active
    from moe.core.errors import LaunchError

    with pytest.raises(LaunchError, match="belongs to SLURM job 42, which is REQUEUED"):
        refuse_if_active(run_dir)


def snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_a_submission_sbatch_refuses_leaves_the_run_directory_byte_identical(
    tiny_data, tmp_path, no_slurm_memory, capsys
):
    """A finished run submitted again with a request SLURM refuses (sbatch --test-only): the
    resolved config, job script, plan and records stay as they were, byte for byte."""
    import yaml

    from tests.conftest import tiny_run_dict

    run = tiny_run_dict(tiny_data, tmp_path / "runs")
    run["launch"] = {"scheduler": "slurm"}
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(run))
    run_dir = tmp_path / "runs" / "tiny"
    write_records(run_dir, "42 0 ended\n")
    for name in ("config.yaml", "job.sbatch", "plan.json"):
        (run_dir / name).write_text(f"the finished run's {name}\n")
    sbatch = tmp_path / "bin" / "sbatch"
    sbatch.write_text(
        "#!/bin/sh\necho 'sbatch: error: Batch job submission failed: Requested "
        "node configuration is not available' >&2\nexit 1\n"
    )
    sbatch.chmod(0o755)
    before = snapshot(run_dir)
    with pytest.raises(SystemExit) as e:
        main([str(config), "parallel.world_size=4", "launch.slurm.nodes=4"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "SLURM would refuse this job; nothing was prepared or submitted" in err
    assert "Requested node configuration is not available" in err
    assert snapshot(run_dir) == before
    with pytest.raises(SystemExit) as e:
        main(["cancel", "999"])
    assert e.value.code != 0 and "nothing cancelled" in capsys.readouterr().err


def test_last_step_counts_a_rerun_step_once_with_its_latest_line(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    # Steps 3 and 4 ran, the job was preempted after a checkpoint at step 2 and re-ran them.
    for rank, shift in [(0, 0.0), (1, 1.0)]:
        lines = [{"step": s, "loss": 10.0 + s + shift} for s in (1, 2, 3, 4)]
        lines += [{"step": s, "loss": 20.0 + s + shift} for s in (3, 4)]
        (logs / f"steps_rank{rank}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in lines) + '{"step": 5, "lo'
        )  # cut mid-write
    (logs / "rank0.log").write_text(
        "12:00:00 [rank 0] step     4/9 | loss 9.0 (lm 9 aux 0) | lr 1e-3 | 1,234 tok/s | x\n"
    )
    assert last_steps(tmp_path) == {"step": 4, "loss": 24.5, "tokens_per_s": 1234}


def test_last_step_leaves_out_the_ranks_a_resume_on_fewer_ranks_dropped(tmp_path):
    """Resumed from step 2 on 1 rank of 2: rank 1's log stops at step 2 (cut back), rank 0's
    records name the world size they ran on."""
    logs = tmp_path / "logs"
    logs.mkdir()
    rank0 = [{"step": s, "loss": 10.0 + s, "world_size": 2} for s in (1, 2)]
    rank0 += [{"step": s, "loss": 20.0 + s, "world_size": 1} for s in (3, 4, 5)]
    rank1 = [{"step": s, "loss": 30.0 + s, "world_size": 2} for s in (1, 2)]
    for rank, lines in enumerate((rank0, rank1)):
        (logs / f"steps_rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert last_steps(tmp_path) == {"step": 5, "loss": 25.0, "tokens_per_s": None}


def test_logs_show_the_job_log_and_a_rank_log(tmp_path, no_slurm_memory, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "slurm_jobs.json").write_text(
        json.dumps(
            [{"job_id": "42", "log": str(run_dir / "logs" / "slurm-%j.out"), "state": "COMPLETED"}]
        )
    )
    (run_dir / "logs" / "slurm-42.out").write_text("job 42 (restart 0): 2 ranks\n")
    (run_dir / "logs" / "rank1.log").write_text("step 3/3\n")
    main(["logs", str(run_dir), "-f"])  # the job is over: prints all and returns
    assert capsys.readouterr().out.endswith("job 42 (restart 0): 2 ranks\n")
    main(["logs", str(run_dir), "--rank", "1"])
    assert "step 3/3" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["logs", str(run_dir), "--rank", "5"])
    assert "rank5.log does not exist" in capsys.readouterr().err


def test_output_cut_short_by_the_reader_ends_without_a_traceback(tmp_path, no_slurm_memory):
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "slurm_jobs.json").write_text(
        json.dumps(
            [{"job_id": "42", "log": str(run_dir / "logs" / "slurm-%j.out"), "state": "COMPLETED"}]
        )
    )
    (run_dir / "logs" / "slurm-42.out").write_text("a log line\n" * 200_000)  # > a pipe buffer
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        f"{shlex.quote(sys.executable)} -m launch.launch logs {shlex.quote(str(run_dir))} | head -1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert proc.stdout.startswith("==> ")
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


def test_status_of_a_requeued_job_says_preempted_and_where_it_resumes(
    tmp_path, monkeypatch, capsys
):
    """After a preemption the job is pending again (SLURM's requeue): status says that exit 75
    was the planned stop and from which step the job resumes, until a later run ended."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    squeue = bin_dir / "squeue"
    squeue.write_text("#!/bin/sh\necho 'PENDING|BeginTime|0:00|30:00'\n")
    squeue.chmod(squeue.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "slurm_jobs.json").write_text(
        json.dumps(
            [
                {
                    "job_id": "42",
                    "submitted": "t",
                    "script": "s",
                    "log": "/x/slurm-%j.out",
                    "state": None,
                }
            ]
        )
    )
    ends = run_dir / "slurm_job_ends.txt"
    ends.write_text("42 75 requeued 17\n")
    main(["status", str(run_dir)])
    out = capsys.readouterr().out
    assert "job 42: PENDING (BeginTime)" in out
    assert (
        "preempted       exit code 75 on purpose (not a failure): requeued, will resume "
        "from step 17"
    ) in out
    squeue.write_text("#!/bin/sh\necho 'RUNNING|None|0:05|30:00'\n")  # it runs again
    main(["status", str(run_dir)])
    out = capsys.readouterr().out
    assert "job 42: RUNNING" in out and "will resume" not in out
    ends.write_text("42 75 requeued 17\n42 0 ended\n")  # the requeued run finished
    main(["status", str(run_dir)])
    assert "preempted" not in capsys.readouterr().out


def test_a_run_directory_from_before_the_job_list_is_still_read(tmp_path):
    """Earlier versions kept one job in slurm_job.json; status, cancel and logs still find it."""
    import json

    from launch.slurm.jobs import read_jobs

    (tmp_path / "slurm_job.json").write_text(
        json.dumps(
            {"job_id": "77", "submitted": "2026-01-01T00:00:00+0000", "script": "job.sbatch"}
        )
    )
    jobs = read_jobs(tmp_path)
    assert [j["job_id"] for j in jobs] == ["77"] and jobs[0]["state"] is None
    assert jobs[0]["log"] == str(tmp_path / "logs" / "slurm-%j.out")
    (tmp_path / "slurm_jobs.json").write_text(json.dumps([{"job_id": "78", "state": None}]))
    assert [j["job_id"] for j in read_jobs(tmp_path)] == ["78"]
