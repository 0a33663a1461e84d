"""moe-prepare --slurm-parts N without a cluster: the three job scripts parsed back, the array
range and the dependency chain, a hostile data directory and job name arriving literally, the
job records and status, and the refusals (no parts, s3://, no sbatch)."""

import json
import shlex
import shutil
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


SBATCH = """#!/bin/bash
# --test-only: the script's job name to LOG.test, refused when FAKE_SBATCH_REFUSE=test-only.
# Else: refused when FAKE_SBATCH_REFUSE names this submission (1, 2, 3); each taken one's
# arguments to LOG, and its job id 101, 102, ...
if [ "$1" = --test-only ]; then
    grep -o -- '--job-name=[^ ]*' >> LOG.test
    if [ "$FAKE_SBATCH_REFUSE" = test-only ]; then
        echo 'sbatch: error: Batch job submission failed: Invalid account' >&2
        exit 1
    fi
    echo 'sbatch: Job 1 to start at 2026-01-01T00:00:00 on n1 in partition cpu' >&2
    exit 0
fi
n=$(( $(cat LOG 2>/dev/null | wc -l) + 1 ))
if [ "$FAKE_SBATCH_REFUSE" = "$n" ]; then
    echo 'sbatch: error: Batch job submission failed: Job violates accounting/QOS policy' >&2
    exit 1
fi
printf '%s\\n' "$*" >> LOG
echo $(( 100 + n ))
"""


def fake_slurm(bin_dir: Path, log: Path) -> None:
    """sbatch (SBATCH) that records its arguments and prints job ids 101, 102, ...; squeue that
    says every job completed."""
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(SBATCH.replace("LOG", shlex.quote(str(log))))
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


def submission(tmp_path, monkeypatch, refuse: str | None = None) -> tuple[Path, Path, Path]:
    """A config, its job directory and the fake sbatch's log; ``refuse``: what sbatch refuses
    (``test-only``, or the number of a submission)."""
    monkeypatch.chdir(tmp_path)
    log = tmp_path / "sbatch.log"
    fake_slurm(tmp_path / "bin", log)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    if refuse:
        monkeypatch.setenv("FAKE_SBATCH_REFUSE", refuse)
    data_dir = tmp_path / "data"
    return write_config(tmp_path, str(data_dir)), Path(f"{data_dir}.slurm"), log


def earlier_submission(job_dir: Path) -> dict[str, bytes]:
    """The files of an earlier, finished submission in ``job_dir``; its bytes by name."""
    (job_dir / "logs").mkdir(parents=True)
    files = {
        "config.yaml": b"name: earlier\n",
        "tokenizer.sbatch": b"#!/bin/bash\n# earlier tokenizer\n",
        "parts.sbatch": b"#!/bin/bash\n# earlier parts\n",
        "merge.sbatch": b"#!/bin/bash\n# earlier merge\n",
        "slurm_jobs.json": b'[{"job_id": "7", "state": "COMPLETED", "log": "x"}]',
        "logs/merge-7.out": b"merged\n",
    }
    for name, data in files.items():
        (job_dir / name).write_bytes(data)
    return files


def files_of(job_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(job_dir)): p.read_bytes() for p in job_dir.rglob("*") if p.is_file()}


@pytest.mark.parametrize("earlier", [False, True])
def test_a_job_sbatch_test_only_refuses_writes_and_submits_nothing(
    tmp_path, capsys, monkeypatch, earlier
):
    config, job_dir, log = submission(tmp_path, monkeypatch, refuse="test-only")
    before = earlier_submission(job_dir) if earlier else None
    with pytest.raises(SystemExit) as e:
        main([str(config), "--slurm-parts", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "SLURM would refuse this job; nothing was prepared or submitted" in err
    assert "sbatch --test-only: Batch job submission failed: Invalid account" in err
    assert not log.exists()  # nothing submitted
    assert (files_of(job_dir) == before) if earlier else not job_dir.exists()


@pytest.mark.parametrize("earlier", [False, True])
def test_a_refused_first_submission_leaves_the_job_directory_as_it_was(
    tmp_path, capsys, monkeypatch, earlier
):
    config, job_dir, log = submission(tmp_path, monkeypatch, refuse="1")
    before = earlier_submission(job_dir) if earlier else None
    with pytest.raises(SystemExit) as e:
        main([str(config), "--slurm-parts", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "sbatch refused the tokenizer job (exit code 1): " in err
    assert f"no job was submitted, {job_dir} is as it was" in err
    # every job was checked with --test-only first
    assert Path(f"{log}.test").read_text().splitlines() == [
        f"--job-name=prep-prepare-{step}" for step in ("tokenizer", "parts", "merge")
    ]
    assert not log.exists()
    assert (files_of(job_dir) == before) if earlier else not job_dir.exists()


def test_a_refusal_after_some_jobs_keeps_what_they_need_and_names_them(
    tmp_path, capsys, monkeypatch
):
    config, job_dir, log = submission(tmp_path, monkeypatch, refuse="3")
    with pytest.raises(SystemExit) as e:
        main([str(config), "--slurm-parts", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "sbatch refused the merge job (exit code 1): " in err
    assert "jobs already submitted: tokenizer 101, parts 102; they stay queued" in err
    assert "scancel 101 102" in err
    assert len(log.read_text().splitlines()) == 2
    records = json.loads((job_dir / "slurm_jobs.json").read_text())
    assert [r["job_id"] for r in records] == ["101", "102"]
    for name in ("config.yaml", "tokenizer.sbatch", "parts.sbatch", "merge.sbatch"):
        assert (job_dir / name).is_file()


def test_a_full_disk_while_writing_the_jobs_submits_nothing_and_names_the_file(
    tmp_path, capsys, monkeypatch
):
    import errno

    from launch.slurm import prepare as prepare_slurm

    config, job_dir, log = submission(tmp_path, monkeypatch)
    real = prepare_slurm.write_atomic

    def full_at_parts(path, data):
        if path.name == "parts.sbatch":
            path.with_name(f".{path.name}.tmp1").write_text("#!/bin/bash\n#SBA")
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(prepare_slurm, "write_atomic", full_at_parts)
    with pytest.raises(SystemExit) as e:
        main([str(config), "--slurm-parts", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write {job_dir}: the disk holding it is full (")
    assert f"no job was submitted, {job_dir} is as it was" in err
    assert not log.exists() and not job_dir.exists()


def test_the_partition_is_checked_against_a_preparation_job_not_the_training_job(
    tmp_path, capsys, monkeypatch
):
    """One node, data.prepare_workers CPUs, no GPU: a partition too small for the training job
    (launch.slurm.nodes, gpus_per_node) takes the preparation, and one with too few CPUs per
    node for data.prepare_workers is refused before anything is written."""
    config, job_dir, log = submission(tmp_path, monkeypatch)
    for name, out in (
        ("scontrol", "PartitionName=cpu TotalNodes=1 MaxNodes=UNLIMITED Default=YES"),
        ("sinfo", "n1|4|(null)"),
    ):
        (tmp_path / "bin" / name).write_text(f"#!/bin/sh\necho '{out}'\n")
        (tmp_path / "bin" / name).chmod(0o755)
    training = ["launch.slurm.nodes=2", "launch.slurm.gpus_per_node=4", "data.prepare_workers=4"]
    main([str(config), "--slurm-parts", "2", *training])
    assert "submitted SLURM jobs: tokenizer 101" in capsys.readouterr().out
    shutil.rmtree(job_dir)
    log.unlink()
    with pytest.raises(SystemExit):
        main([str(config), "--slurm-parts", "2", "data.prepare_workers=8"])
    assert "8 CPUs per node, but the largest node of partition 'cpu' has 4" in (
        capsys.readouterr().err
    )
    assert not job_dir.exists() and not log.exists()
