"""moe-prepare --slurm-parts N without a cluster: the three job scripts parsed back, the array
range and the dependency chain, a hostile data directory and job name arriving literally, the
job records and status, and the refusals (no parts, s3://, no sbatch)."""

import json
import shlex
import stat
import sys
from pathlib import Path

import pytest
import yaml

from launch.launch import main as launch_main
from launch.prepare import main
from tests.launch.test_slurm_plan import sbatch_options

# No '%' or '\\' (SLURM patterns in log paths, refused) and no line break (refused too).
HOSTILE = "a; rm -rf \"$HOME\" $(touch {s}) `touch {s}` 'q' #"


def write_config(tmp_path: Path, data_dir: str, **slurm) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump({"name": "prep", "data": {"dir": data_dir}, "launch": {"slurm": slurm}})
    )
    return path


def script_blocks(out: str) -> dict[str, str]:
    """The scripts of a dry run, by step, from its '# file PATH:' headers."""
    blocks, name = {}, None
    for line in out.splitlines():
        if line.startswith("# file "):
            name = Path(line[len("# file ") : -1]).stem
            blocks[name] = ""
        elif line.startswith("# commands"):
            name = None
        elif name:
            blocks[name] += line + "\n"
    return blocks


def test_dry_run_prints_three_chained_scripts_quoted(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sentinel = tmp_path / "SENTINEL"
    hostile = HOSTILE.format(s=sentinel)
    data_dir = tmp_path / f"data {hostile}"
    config = write_config(
        tmp_path,
        str(data_dir),
        partition="cpu",
        account="proj-1",
        time="2:00:00",
        job_name=hostile,
        extra_sbatch=["--mem=8G"],
    )
    main([str(config), "--slurm-parts", "4", "--dry-run", "data.prepare_workers=3", "--force"])
    out = capsys.readouterr().out
    job_dir = Path(str(data_dir) + ".slurm")
    scripts = script_blocks(out)
    assert list(scripts) == ["tokenizer", "parts", "merge"]
    for step, script in scripts.items():
        opts = sbatch_options(script)
        assert opts["--job-name"] == f"{hostile}-prepare-{step}"
        assert (opts["--partition"], opts["--account"], opts["--time"], opts["--mem"]) == (
            "cpu",
            "proj-1",
            "2:00:00",
            "8G",
        )
        assert opts["--cpus-per-task"] == "3" and opts["--ntasks"] == "1"
        assert opts["--output"].startswith(str(job_dir / "logs") + "/")
        assert ("--array" in opts) == (step == "parts")
        command = shlex.split(script.strip().splitlines()[-1])
        assert command[:5] == [
            sys.executable,
            "-u",
            "-m",
            "launch.prepare",
            str(job_dir / "config.yaml"),
        ]
        cd = next(line for line in script.splitlines() if line.startswith("cd "))
        assert shlex.split(cd) == ["cd", str(tmp_path)]
    assert sbatch_options(scripts["parts"])["--array"] == "0-3"
    parts_cmd = shlex.split(scripts["parts"].strip().splitlines()[-1])
    assert parts_cmd[5:] == ["--part", "$SLURM_ARRAY_TASK_ID/4"]  # bash fills in the task
    assert scripts["parts"].strip().endswith('--part "$SLURM_ARRAY_TASK_ID/4"')
    assert shlex.split(scripts["tokenizer"].strip().splitlines()[-1])[5:] == ["--tokenizer-only"]
    assert shlex.split(scripts["merge"].strip().splitlines()[-1])[5:] == ["--merge", "--force"]
    commands = [shlex.split(line) for line in out.splitlines() if line.startswith("sbatch ")]
    assert commands == [
        ["sbatch", "--parsable", str(job_dir / "tokenizer.sbatch")],
        [
            "sbatch",
            "--parsable",
            "--dependency=afterok:<tokenizer job id>",
            str(job_dir / "parts.sbatch"),
        ],
        [
            "sbatch",
            "--parsable",
            "--dependency=afterok:<parts job id>",
            str(job_dir / "merge.sbatch"),
        ],
    ]
    assert not job_dir.exists() and not sentinel.exists()  # a dry run writes nothing


def fake_slurm(bin_dir: Path, log: Path) -> None:
    """sbatch that records its arguments and prints job ids 101, 102, ...; squeue that says
    every job completed."""
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(
        f"#!/bin/bash\nprintf '%s\\n' \"$*\" >> {shlex.quote(str(log))}\n"
        f"echo $(( 100 + $(wc -l < {shlex.quote(str(log))}) ))\n"
    )
    squeue = bin_dir / "squeue"
    squeue.write_text("#!/bin/sh\necho 'COMPLETED|None|0:05|2:00:00'\n")
    for path in (sbatch, squeue):
        path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_submit_chains_records_and_reports_the_jobs(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    log = tmp_path / "sbatch.log"
    fake_slurm(tmp_path / "bin", log)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    data_dir = tmp_path / "my data"
    config = write_config(tmp_path, str(data_dir))
    main([str(config), "--slurm-parts", "2", "data.valid_fraction=0.25"])
    out = capsys.readouterr().out
    job_dir = Path(str(data_dir) + ".slurm")
    assert log.read_text().splitlines() == [
        f"--parsable {job_dir / 'tokenizer.sbatch'}",
        f"--parsable --dependency=afterok:101 {job_dir / 'parts.sbatch'}",
        f"--parsable --dependency=afterok:102 {job_dir / 'merge.sbatch'}",
    ]
    assert "submitted SLURM jobs: tokenizer 101, parts 102 (array), merge 103" in out
    assert "squeue -j 101,102,103" in out
    records = json.loads((job_dir / "slurm_jobs.json").read_text())
    assert [r["job_id"] for r in records] == ["101", "102", "103"]
    assert records[1]["log"] == str(job_dir / "logs" / "part-%A_%a.out")
    snapshot = yaml.safe_load((job_dir / "config.yaml").read_text())
    assert snapshot["data"]["valid_fraction"] == 0.25  # the override reaches the jobs
    for step in ("tokenizer", "parts", "merge"):
        assert (job_dir / f"{step}.sbatch").read_text().startswith("#!/bin/bash\n")

    launch_main(["status", str(job_dir)])
    status = capsys.readouterr().out
    assert "job 103: COMPLETED" in status
    assert "jobs of the run 101 (COMPLETED), 102 (COMPLETED), 103 (COMPLETED)" in status
    assert "checkpoint" not in status and "rank logs" not in status  # not a training run


@pytest.mark.parametrize(
    "args, message",
    [
        (["--slurm-parts", "0"], "--slurm-parts: the number of parts must be at least 1, got 0"),
        (["--slurm-parts", "2", "data.dir=s3://bucket/data"], "data.dir s3://bucket/data: the "),
        (["--slurm-parts", "2"], "'sbatch' not found on PATH"),
        (["--dry-run"], "--dry-run goes with --slurm-parts"),
    ],
)
def test_bad_input_is_refused_clearly(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    config = write_config(tmp_path, str(tmp_path / "data"))
    with pytest.raises(SystemExit) as e:
        main([str(config), *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "data.slurm").exists() and not (tmp_path / "data").exists()
