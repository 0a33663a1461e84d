"""moe-scaling run --scheduler slurm without a cluster: a fake sbatch records what reaches it and a
fake squeue answers from a file. One job per run, the --jobs bound as chains of
``--dependency=afterany``, no job submitted twice, hostile paths arriving literally, a refused
config submitting nothing, and the wait reporting the failed run."""

from __future__ import annotations

import json
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launch.scaling import main
from launch.signal_latch import HELD_SIGNALS_ENV
from launch.slurm import sweep as slurm_sweep
from launch.slurm.jobs import JobState
from tests.conftest import tiny_run_dict

SBATCH = """#!{python}
import json, os, sys
from pathlib import Path
calls = Path(os.environ["FAKE_SLURM"]) / "sbatch"
calls.mkdir(exist_ok=True)
if "--test-only" in sys.argv:
    sys.exit(0)
n = len(list(calls.iterdir())) + 1
if os.environ.get("FAKE_SBATCH_REFUSE") == str(n):
    print("sbatch: error: Batch job submission failed: Job violates accounting/QOS policy",
          file=sys.stderr)
    sys.exit(1)
(calls / f"{{n:03d}}.json").write_text(json.dumps(sys.argv[1:]))
print(100 + n)
"""
SQUEUE = """#!{python}
import json, os, sys
from pathlib import Path
states = json.loads((Path(os.environ["FAKE_SLURM"]) / "states.json").read_text())
ids, fmt = sys.argv[sys.argv.index("-j") + 1].split(","), sys.argv[sys.argv.index("-o") + 1]
for i in ids:
    if i in states:
        print(f"{{i}}|{{states[i]}}" if fmt == "%i|%T" else f"{{states[i]}}|None|0:01|10:00")
"""
HOSTILE = "sweep 'q' \"d\" $(touch {s}) `touch {s}`; #"


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    bin_dir, state = tmp_path / "bin", tmp_path / "fake"
    bin_dir.mkdir()
    state.mkdir()
    (state / "states.json").write_text("{}")
    for name, text in (("sbatch", SBATCH), ("squeue", SQUEUE)):
        path = bin_dir / name
        path.write_text(text.format(python=sys.executable))
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_SLURM", str(state))
    monkeypatch.delenv("SLURM_CONF", raising=False)
    return state


def sbatch_calls(state: Path) -> list[list[str]]:
    calls = state / "sbatch"
    return [json.loads(p.read_text()) for p in sorted(calls.iterdir())] if calls.exists() else []


def set_states(state: Path, states: dict[str, str]) -> None:
    (state / "states.json").write_text(json.dumps(states))


@pytest.fixture
def sweep(tiny_data, tmp_path):
    """4 planned runs (2 budgets x 2 widths) in a directory named with hostile shell text."""
    d = tiny_run_dict(tiny_data, tmp_path / "unused", max_steps=1)
    d["parallel"] = {"world_size": 1, "expert_parallel_size": 1, "zero_stage": 2}
    d["launch"] = {"scheduler": "slurm", "slurm": {"cpus_per_task": 1}}
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(d))
    out = tmp_path / HOSTILE.format(s=tmp_path / "SENTINEL")
    main(
        [
            "plan",
            str(base),
            "--budgets",
            "3e9,6e9",
            "--families",
            "dense",
            "--widths",
            "64,96",
            "--out",
            str(out),
            "--allow-repeat",
        ]
    )
    return out


def names_of(sweep: Path) -> list[str]:
    return [r["name"] for r in json.loads((sweep / "sweep.json").read_text())["runs"]]


def test_each_run_is_one_job_chained_k_at_a_time_with_every_value_literal(
    sweep, fake_slurm, tmp_path, capsys
):
    main(["run", str(sweep), "--scheduler", "slurm", "--jobs", "2", "--no-wait"])
    names = names_of(sweep)
    calls = sbatch_calls(fake_slurm)
    assert len(calls) == 4
    scripts = [str((sweep / "runs" / n / "job.sbatch").absolute()) for n in names]
    assert [c[-1] for c in calls] == scripts  # the path is one argument, never split
    # Runs of 3e9, 3e9, 6e9, 6e9 FLOPs: the first two start at once, each later one waits for
    # the chain with the least planned compute.
    assert [c[:-1] for c in calls] == [
        ["--parsable"],
        ["--parsable"],
        ["--parsable", "--dependency=afterany:101"],
        ["--parsable", "--dependency=afterany:102"],
    ]
    records = [json.loads((sweep / "runs" / n / "slurm_jobs.json").read_text()) for n in names]
    assert [r[0]["job_id"] for r in records] == ["101", "102", "103", "104"]
    assert [r[0].get("after") for r in records] == [None, None, "101", "102"]
    # The job script's supervisor line, read by a real shell, gives back each value as it was.
    script = Path(scripts[0]).read_text()
    line = next(x for x in script.splitlines() if x.startswith(f"{HELD_SIGNALS_ENV}="))
    command = line.split(" ", 1)[1].removesuffix(" &")
    argv = subprocess.run(
        ["bash", "-c", "printf '%s\\0' " + command], capture_output=True, check=True, cwd=tmp_path
    ).stdout.split(b"\0")[:-1]
    config = str((sweep / "runs" / names[0] / "config.yaml").absolute())
    assert [a.decode() for a in argv] == [
        sys.executable,
        "-u",
        "-m",
        "launch.supervise",
        "slurm",
        config,
    ]
    assert not (tmp_path / "SENTINEL").exists()
    out = capsys.readouterr().out
    assert "4 submitted, at most 2 running at once" in out
    assert f"moe-scaling run {shlex.quote(str(sweep))} --scheduler slurm" in out

    # Again while every job is queued or running: nothing submitted.
    set_states(fake_slurm, {"101": "RUNNING", "102": "RUNNING", "103": "PENDING", "104": "PENDING"})
    main(["run", str(sweep), "--jobs", "2", "--no-wait"])  # the configs say slurm
    assert len(sbatch_calls(fake_slurm)) == 4
    assert (
        "4 with a SLURM job queued or running (not submitted again); 0 submitted"
        in capsys.readouterr().out
    )

    # The third run's job failed, the others go on: only it is submitted again, at the end of
    # a chain still running (104 waits for 102, so 101 and 104 end the chains).
    set_states(fake_slurm, {"101": "RUNNING", "102": "RUNNING", "103": "FAILED", "104": "PENDING"})
    main(["run", str(sweep), "--scheduler", "slurm", "--jobs", "2", "--no-wait"])
    calls = sbatch_calls(fake_slurm)
    assert len(calls) == 5 and calls[4][-1] == scripts[2]
    assert calls[4][1] in ("--dependency=afterany:101", "--dependency=afterany:104")

    # A local run of the same sweep would train into the directories of the queued jobs.
    with pytest.raises(SystemExit) as e:
        main(["run", str(sweep), "--scheduler", "local"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{names[0]} (job 101, RUNNING)" in err and "have a SLURM job queued or running" in err


def test_dry_run_prints_every_job_and_a_refused_config_submits_nothing(sweep, fake_slurm, capsys):
    main(["run", str(sweep), "--scheduler", "slurm", "--jobs", "1", "--dry-run"])
    out = capsys.readouterr().out
    names = names_of(sweep)
    assert out.count("# file ") == 4 and "launch.supervise slurm" in out
    for before in names[:-1]:  # one chain with --jobs 1
        assert shlex.quote(f"--dependency=afterany:<job of {before}>") in out
    assert not sbatch_calls(fake_slurm) and not (sweep / "runs").exists()

    config = sweep / "configs" / f"{names[1]}.yaml"
    d = yaml.safe_load(config.read_text())
    d["train"]["no_such_key"] = 1
    config.write_text(yaml.safe_dump(d))
    with pytest.raises(SystemExit) as e:
        main(["run", str(sweep), "--scheduler", "slurm"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "nothing was submitted" in err and "no_such_key" in err and str(config) in err
    assert not sbatch_calls(fake_slurm) and not (sweep / "runs").exists()

    with pytest.raises(SystemExit) as e:
        main(["run", str(sweep), "--scheduler", "local", "--no-wait"])
    assert e.value.code == 2 and "go with --scheduler slurm" in capsys.readouterr().err


def test_a_job_log_every_run_would_share_is_refused(sweep, fake_slurm, capsys):
    """launch.slurm.output without %j: every run's job would write the same file."""
    for name in names_of(sweep):
        config = sweep / "configs" / f"{name}.yaml"
        d = yaml.safe_load(config.read_text())
        d.setdefault("launch", {}).setdefault("slurm", {})["output"] = "logs/sweep.out"
        config.write_text(yaml.safe_dump(d))
    with pytest.raises(SystemExit) as e:
        main(["run", str(sweep), "--scheduler", "slurm"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "launch.slurm.output" in err and "%j" in err
    assert not sbatch_calls(fake_slurm) and not (sweep / "runs").exists()


def test_chains_give_each_run_to_the_least_loaded_chain():
    runs = [
        slurm_sweep.Member(f"r{i}", Path("c"), Path("d"), f, 10)
        for i, f in enumerate((4.0, 1.0, 1.0, 1.0, 1.0))
    ]
    assert slurm_sweep.chains(runs, [], 2) == [None, None, 1, 2, 3]  # not round robin
    # More chains running than --jobs (an earlier submission's larger bound): the new runs
    # follow the ones with the most compute, which end last.
    assert slurm_sweep.chains(runs[:2], [("7", 5.0), ("8", 1.0), ("9", 2.0)], 2) == ["9", "7"]
    assert slurm_sweep.chains(runs[:3], [], 5) == [None, None, None]


def test_the_wait_reports_the_failed_run_and_counts_the_finished(tmp_path, monkeypatch):
    members = []
    for i, name in enumerate(("done", "broken")):
        run_dir = tmp_path / name
        run_dir.mkdir()
        (run_dir / "slurm_jobs.json").write_text(
            json.dumps(
                [
                    {
                        "job_id": str(7 + i),
                        "submitted": "t",
                        "script": "s",
                        "log": str(run_dir / "logs" / "slurm-%j.out"),
                        "state": None,
                    }
                ]
            )
        )
        members.append(slurm_sweep.Member(name, tmp_path / "c.yaml", run_dir, 10.0 * (i + 1), 5))
    monkeypatch.setattr(
        slurm_sweep,
        "job_states",
        lambda jobs: {
            "7": JobState("7", "COMPLETED", "squeue"),
            "8": JobState("8", "FAILED", "squeue"),
        },
    )
    seen = []
    outcome = slurm_sweep.wait(members, lambda m: m.name == "done", lambda *a: seen.append(a))
    assert [(m.name, j.state) for m, j in outcome.failed] == [("broken", "FAILED")]
    assert outcome.stopped is None
    assert seen[-1] == (10.0, 1, "0 running, 0 queued, 1 failed")
    assert slurm_sweep.log_of(*outcome.failed[0]) == str(
        tmp_path / "broken" / "logs" / "slurm-8.out"
    )
    # The final state is kept in the run's records for `moe-launch status`.
    assert json.loads((tmp_path / "broken" / "slurm_jobs.json").read_text())[0]["state"] == "FAILED"


def test_local_runs_of_a_sweep_planned_for_slurm_train_here(sweep, fake_slurm, monkeypatch, capsys):
    """--scheduler local overrides the configs' launch.scheduler: slurm (moe-launch would
    otherwise submit a job and return at once)."""
    import launch.scaling_run as cli

    commands = []

    class Ended:
        returncode = 1
        pid = 4321  # named in the sweep's lock file

        def __init__(self, cmd, **_):
            commands.append(cmd)

        def poll(self):
            return 1

    monkeypatch.setattr(cli.subprocess, "Popen", Ended)
    with pytest.raises(SystemExit):
        main(["run", str(sweep), "--scheduler", "local", "--jobs", "2"])
    assert len(commands) == 4 and all(c[-2:] == ["--scheduler", "local"] for c in commands)
    assert "4 run(s) failed" in capsys.readouterr().err
    assert not sbatch_calls(fake_slurm)


def test_a_requeued_job_is_waited_for_not_reported(tmp_path, monkeypatch):
    """A preempted job requeues itself and runs again from its checkpoint (the job's own
    business): through REQUEUED and PENDING the wait goes on, and the run counts once finished."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "slurm_jobs.json").write_text(
        json.dumps([{"job_id": "7", "submitted": "t", "script": "s", "log": "l", "state": None}])
    )
    member = slurm_sweep.Member("run", tmp_path / "c.yaml", run_dir, 10.0, 5)
    states = iter(["RUNNING", "REQUEUED", "PENDING", "RUNNING", "COMPLETING", "COMPLETED"])
    polls = []
    monkeypatch.setattr(slurm_sweep, "POLL_S", 0.0)
    monkeypatch.setattr(
        slurm_sweep,
        "job_states",
        lambda jobs: (polls.append(1), {"7": JobState("7", next(states), "squeue")})[1],
    )
    seen = []
    outcome = slurm_sweep.wait([member], lambda m: len(polls) >= 6, lambda *a: seen.append(a))
    assert outcome.failed == [] and len(polls) == 6
    assert seen[1] == (0.0, 0, "0 running, 1 queued") and seen[-1] == (
        10.0,
        1,
        "0 running, 0 queued",
    )


def test_a_refusal_midway_names_the_submitted_jobs_and_a_rerun_completes_the_sweep(
    sweep, fake_slurm, monkeypatch, capsys
):
    monkeypatch.setenv("FAKE_SBATCH_REFUSE", "3")
    with pytest.raises(SystemExit) as e:
        main(["run", str(sweep), "--scheduler", "slurm", "--jobs", "2", "--no-wait"])
    names = names_of(sweep)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{names[2]}: sbatch refused the job" in err
    assert f"jobs already submitted: {names[0]} 101, {names[1]} 102" in err
    assert len(sbatch_calls(fake_slurm)) == 2
    set_states(fake_slurm, {"101": "RUNNING", "102": "PENDING"})
    monkeypatch.delenv("FAKE_SBATCH_REFUSE")
    main(["run", str(sweep), "--scheduler", "slurm", "--jobs", "2", "--no-wait"])
    calls = sbatch_calls(fake_slurm)
    assert [c[-1].split("/runs/")[1] for c in calls[2:]] == [f"{n}/job.sbatch" for n in names[2:]]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["plan", "c.yaml", "--budgets", "nan"],
            "--budgets 'nan': expected positive, finite numbers",
        ),
        (["plan", "c.yaml", "--budgets", "3e13,inf"], "expected positive, finite numbers"),
        (
            ["plan", "c.yaml", "--budgets", "3e13", "--experts", "2.5"],
            "--experts '2.5': expected whole numbers",
        ),
        (["plan", "c.yaml", "--budgets", "3e13", "--experts", "inf"], "positive, finite"),
        (["predict", "sweep", "--budget", "inf"], "argument --budget: 'inf': expected a positive"),
        (["predict", "sweep", "--budget", "0"], "argument --budget: '0': expected a positive"),
        (["predict", "sweep", "--budget", "1e14", "--fit-below", "nan"], "argument --fit-below"),
        (
            ["fit", "sweep", "--bootstrap", "-1"],
            "argument --bootstrap: '-1': expected zero or more",
        ),
    ],
)
def test_numbers_that_are_not_budgets_are_refused_before_anything_runs(
    argv, message, capsys, tmp_path, monkeypatch
):
    """inf, nan, 0 and fractional expert counts once reached the planner (a math domain error,
    a NaN step count) or the predictor (a division by zero): each is now a usage error, exit 2,
    naming the flag, and nothing is written."""
    from launch import scaling as scaling_cli

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        scaling_cli.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
