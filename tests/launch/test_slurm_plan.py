"""The SLURM plan without a cluster: the sbatch script parsed back (no golden files), and the
job's one line (the supervisor) run with srun/scontrol replaced by recorders, so that what
reaches srun's argument list and environment is compared with the literal hostile values, and
the restart policy, the signals and the requeue are checked without a cluster."""

import contextlib
import io
import os
import shlex
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch import supervise
from launch.launch import main
from launch.schedulers import build_plan
from launch.signal_latch import CATCHABLE, HELD_SIGNALS_ENV
from launch.slurm import allocation
from launch.slurm.jobs import requeued_at
from launch.slurm.script import JOB_SCRIPT
from moe.config.launch import slurm_time_seconds
from moe.config.run import RunConfig, dump_config, load_config
from moe.core.config_schema import from_dict
from moe.core.errors import ConfigError
from moe.core.run_dir import RunDir
from moe.training.resilience.preemption import PREEMPTED_EXIT_CODE

ROOT = Path(__file__).resolve().parents[2]
HOSTILE = "a; rm -rf \"$HOME\" $(touch {s}) `touch {s}` 'q' \\ # \n end"


def slurm_config(tmp_path, **slurm) -> RunConfig:
    return from_dict(
        RunConfig,
        {
            "name": "tiny",
            "output_dir": str(tmp_path / "runs"),
            "parallel": {"world_size": 4, "expert_parallel_size": 2},
            "launch": {"scheduler": "slurm", "slurm": slurm},
        },
    )


def supervisor_argv(script: str) -> list[str]:
    """The supervisor's command line in a job script, as the batch shell runs it."""
    line = next(t for t in script.splitlines() if t.startswith(f"{HELD_SIGNALS_ENV}="))
    assert line.endswith(" &")
    return shlex.split(line)[1:-1]


def sbatch_options(script: str) -> dict[str, str | None]:
    """#SBATCH lines as sbatch reads them: shlex-like tokens, quotes removed."""
    out = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            for token in shlex.split(line[len("#SBATCH ") :]):
                key, _, value = token.partition("=")
                out[key] = value if _ else None
    return out


def test_script_holds_requested_resources_and_one_supervisor_line(tmp_path):
    cfg = slurm_config(
        tmp_path,
        nodes=2,
        gpus_per_node=2,
        cpus_per_task=6,
        time="1-02:00:00",
        partition="gpu",
        account="proj-1",
        job_name="moe run",
        extra_sbatch=["--exclusive", "--mem=0"],
        signal_seconds=300,
        socket_ifname="ib0",
    )
    plan = build_plan(cfg)
    script = plan.files[JOB_SCRIPT]
    opts = sbatch_options(script)
    run_dir = tmp_path / "runs" / "tiny"
    assert opts == {
        "--job-name": "moe run",
        "--nodes": "2",
        "--ntasks-per-node": "2",
        "--cpus-per-task": "6",
        "--gpus-per-node": "2",
        "--time": "1-02:00:00",
        "--partition": "gpu",
        "--account": "proj-1",
        "--output": str(run_dir / "logs" / "slurm-%j.out"),
        "--open-mode": "append",
        "--chdir": str(Path.cwd()),
        "--signal": "B:USR1@300",
        "--requeue": None,
        "--exclusive": None,
        "--mem": "0",
    }
    # Directives, then the supervisor under a shell that holds the stop signals for it: the
    # restart policy lives in Python, not in the script.
    assert supervisor_argv(script) == [
        sys.executable,
        "-u",
        "-m",
        "launch.supervise",
        "slurm",
        str(run_dir / "config.yaml"),
    ]
    assert plan.command == ["sbatch", "--parsable", str(run_dir / JOB_SCRIPT)]
    assert (plan.world_size, plan.nodes, plan.submits) == (4, 2, True)


def test_srun_starts_one_rank_wrapper_per_task_that_saves_on_usr1_and_term(tmp_path, slurm_job):
    cfg = slurm_config(tmp_path, nodes=2, cpus_per_task=6, socket_ifname="ib0")
    cfg.checkpoint.save_on_signals = ["USR2"]
    calls, _ = slurm_job(cfg, srun_body="exit 0\n")
    srun, env = next(c for c in calls if c[0][0] == "srun")
    run_dir = tmp_path / "runs" / "tiny"
    assert srun[:6] == [
        "srun",
        "--ntasks=4",
        "--ntasks-per-node=2",
        "--cpus-per-task=6",
        "--kill-on-bad-exit=1",
        "--label",
    ]
    assert srun[6:] == [
        sys.executable,
        "-u",
        "-m",
        "launch.rank",
        "--config",
        str(run_dir / "config.yaml"),
        "checkpoint.save_on_signals=[USR2, USR1, TERM]",
    ]
    assert env["GLOO_SOCKET_IFNAME"] == "ib0" and env["PYTHONUNBUFFERED"] == "1"


def test_dry_run_prints_the_script_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("name: dry\noutput_dir: runs\n")
    main([str(cfg_file), "--scheduler", "slurm", "--dry-run", "launch.slurm.nodes=2"])
    out = capsys.readouterr().out
    assert "#SBATCH --nodes=2" in out and "sbatch --parsable" in out
    assert not (tmp_path / "runs").exists()


def recorder(path: Path, log: Path, body: str = "") -> None:
    """An executable that appends its NUL-separated argv and environment to ``log``."""
    path.write_text(
        "#!/bin/bash\n"
        f"{{ printf '%s\\0' \"$0\" \"$@\"; printf '\\n--env\\n'; env -0; "
        f"printf '\\n--end\\n'; }} >> {shlex.quote(str(log))}\n{body}"
    )
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def slurm_job(tmp_path, monkeypatch):
    """Run a job as the allocation does (``python -m launch.supervise slurm CONFIG``), in this
    process for speed, with recording srun and scontrol on PATH and DeepSpeed's op build
    replaced by ``before_srun`` (what happens while the supervisor builds it). Returns
    ``run(cfg, srun_body, ...) -> (calls, output)``; calls are (argv, env) pairs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "calls.log"
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[7-8]")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    saved = {signum: signal.getsignal(signum) for signum in CATCHABLE}  # restored after each

    def run(
        cfg: RunConfig,
        srun_body: str = "",
        scontrol_body: str = "",
        evaluate: bool = True,
        expect_rc: int = 0,
        before_srun=None,
    ):
        log.unlink(missing_ok=True)  # this run's calls only
        recorder(bin_dir / "srun", log, srun_body)
        recorder(
            bin_dir / "scontrol",
            log,
            scontrol_body + 'case "$1 $2" in\n'
            '  "show hostnames") printf "node7\\nnode8\\n";;\n'
            '  "show node") echo "NodeName=$3 Arch=x86_64 NodeAddr=10.9.0.7 '
            'NodeHostName=$3";;\n'
            "esac\n",
        )
        plan = build_plan(cfg, evaluate=evaluate)
        argv = supervisor_argv(plan.files[JOB_SCRIPT])
        assert argv[1:5] == ["-u", "-m", "launch.supervise", "slurm"]
        config = Path(argv[5])
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(dump_config(cfg))
        monkeypatch.setattr(
            allocation, "build_ops", lambda env, tick=None: before_srun() if before_srun else 0
        )
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                rc = supervise.run_slurm_job(config, "--no-eval" not in argv, [])
        finally:
            for signum, handler in saved.items():
                signal.signal(signum, handler)
        assert rc == expect_rc, out.getvalue()
        calls = []
        text = log.read_text() if log.exists() else ""
        for record in text.split("\n--end\n")[:-1]:
            argv_part, env_part = record.split("\n--env\n")
            call = argv_part.split("\0")[:-1]
            call[0] = Path(call[0]).name
            calls.append((call, dict(kv.split("=", 1) for kv in env_part.split("\0") if "=" in kv)))
        return calls, out.getvalue()

    return run


def test_hostile_values_reach_srun_literally_and_execute_nothing(tmp_path, slurm_job):
    sentinel = tmp_path / "SENTINEL"
    hostile = HOSTILE.format(s=sentinel)
    cfg = slurm_config(
        tmp_path,
        nodes=2,
        socket_ifname="eth1",
        srun_args=[f"--comment={hostile}"],
        job_name=hostile.replace("\n", " "),
    )
    cfg.launch.env = {"MOE_VALUE": hostile}
    cfg.output_dir = str(tmp_path / "runs ; $(touch x) `touch y` 'q\"")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "keep").write_text("still here")
    calls, _ = slurm_job(cfg)
    srun_argv, srun_env = next(c for c in calls if c[0][0] == "srun")
    assert f"--comment={hostile}" in srun_argv
    assert srun_argv[-2] == str(Path(cfg.output_dir).absolute() / "tiny" / "config.yaml")
    assert srun_env["MOE_VALUE"] == hostile
    assert (srun_env["MASTER_ADDR"], srun_env["MASTER_PORT"]) == ("10.9.0.7", str(15000 + 1234 * 4))
    assert srun_env["GLOO_SOCKET_IFNAME"] == srun_env["NCCL_SOCKET_IFNAME"] == "eth1"
    assert not sentinel.exists() and not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    assert (tmp_path / "home" / "keep").exists()


def test_script_requeues_after_a_preemption_checkpoint(tmp_path, slurm_job):
    cfg = slurm_config(tmp_path)
    marker = RunDir(tmp_path / "runs" / "tiny").preempted
    marker.parent.mkdir(parents=True)
    marker.write_text("stale: removed before srun starts")
    # Without a marker from this run: no requeue, srun's status is the job's.
    calls, _ = slurm_job(cfg, srun_body="exit 0\n")
    assert not marker.exists()
    assert not any(c[0][:2] == ["scontrol", "requeue"] for c in calls)
    # The ranks saved and left the marker, then exited 75: the script requeues the job.
    saved = '{"step": 17, "signal": "SIGUSR1"}'
    calls, out = slurm_job(cfg, srun_body=f"echo '{saved}' > {shlex.quote(str(marker))}\nexit 75\n")
    assert ["scontrol", "requeue", "1234"] in [c[0] for c in calls]
    # srun's "Exited with exit code 75" is followed by what it means.
    assert out.splitlines()[-2:] == [
        f"preemption signal ({saved}): the exit code 75 above is the planned exit of a "
        "preempted run, not a failure",
        "preempted, requeued, will resume from step 17 (requeueing job 1234)",
    ]
    ends = (tmp_path / "runs" / "tiny" / "slurm_job_ends.txt").read_text().splitlines()
    assert ends[-1] == "1234 75 requeued 17"
    assert requeued_at(tmp_path / "runs" / "tiny", "1234") == 17
    # Signalled before the first step: nothing saved, resumes from the newest complete
    # checkpoint (its directory and its marker).
    (marker.parent / "checkpoints" / "step_0000040").mkdir(parents=True)
    (marker.parent / "checkpoints" / "step_0000040" / "checkpoint.json").write_text("{}")
    calls, out = slurm_job(
        cfg, srun_body=f"echo '{{\"step\": null}}' > {shlex.quote(str(marker))}\nexit 75\n"
    )
    assert "preempted, requeued, will resume from step 40 (requeueing job 1234)" in out


def finish_calls(calls) -> list[list[str]]:
    return [c[0] for c in calls if c[0][0] == "srun" and "launch.finish" in c[0]]


@pytest.mark.parametrize("evaluate", [True, False])
def test_a_finished_run_is_evaluated_on_one_task_a_preempted_one_is_not(
    tmp_path, evaluate, slurm_job
):
    cfg = slurm_config(tmp_path, nodes=2, cpus_per_task=3)
    run_dir = tmp_path / "runs" / "tiny"
    marker = RunDir(run_dir).preempted
    run_dir.mkdir(parents=True)
    plan = build_plan(cfg, evaluate=evaluate)
    assert plan.files[JOB_SCRIPT] != build_plan(cfg, evaluate=not evaluate).files[JOB_SCRIPT]
    # Training finished (the ranks' srun exits 0): one more srun, one task, the finish step.
    calls, out = slurm_job(cfg, srun_body="exit 0\n", evaluate=evaluate)
    (finish,) = finish_calls(calls)
    assert finish[1:4] == ["--ntasks=1", "--nodes=1", "--cpus-per-task=3"]
    assert finish[5:] == [
        "-u",
        "-m",
        "launch.finish",
        str(run_dir),
        *([] if evaluate else ["--no-eval"]),
    ]
    assert ("evaluating the final checkpoint" in out) == evaluate
    # Preempted (marker, exit 75): requeued, no evaluation of a checkpoint that is not final.
    calls, out = slurm_job(
        cfg, srun_body=f"echo '{{}}' > {shlex.quote(str(marker))}\nexit 75\n", evaluate=evaluate
    )
    assert finish_calls(calls) == [] and "requeueing job 1234" in out
    # Training failed (twice the same way): no evaluation, the job fails.
    calls, out = slurm_job(cfg, srun_body="exit 3\n", evaluate=evaluate, expect_rc=1)
    assert finish_calls(calls) == []
    assert out.splitlines()[-1].startswith("error: training failed the same way twice")


# A stand-in for srun that behaves like the ranks under it: on the save signal (USR1) it
# leaves the marker and exits 75; it records which signal arrived.
SAVING_SRUN = (
    "trap 'echo USR1 >> {got}; echo {{}} > {marker}; exit 75' USR1\n"
    "trap 'echo TERM >> {got}; exit 137' TERM\n"
    "touch {started}\n"
    "for i in $(seq 300); do sleep 0.1; done\nexit 0\n"
)


def saving_srun(tmp_path) -> tuple[str, Path, Path]:
    run_dir = tmp_path / "runs" / "tiny"
    run_dir.mkdir(parents=True, exist_ok=True)
    got, started = tmp_path / "srun-got", tmp_path / "srun-started"
    body = SAVING_SRUN.format(
        got=shlex.quote(str(got)),
        started=shlex.quote(str(started)),
        marker=shlex.quote(str(RunDir(run_dir).preempted)),
    )
    return body, got, started


def signal_once(path: Path, signum: int) -> None:
    """Send this process (the supervisor) ``signum`` once ``path`` exists."""
    import threading

    def wait_then_signal():
        deadline = time.time() + 30
        while not path.exists() and time.time() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signum)

    threading.Thread(target=wait_then_signal, daemon=True).start()


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM, signal.SIGUSR2])
def test_a_stop_signal_to_the_supervisor_reaches_the_ranks_as_usr1_and_requeues(
    tmp_path, slurm_job, signum
):
    """``--signal=B:USR1@N``, ``scancel --batch --signal=TERM|USR1|USR2`` signal the batch step:
    the supervisor passes USR1 on to srun (never TERM, which srun turns into SIGKILL of every
    rank), the ranks save, the job requeues, and no restart is attempted."""
    body, got, started = saving_srun(tmp_path)
    signal_once(started, signum)
    t0 = time.time()
    calls, out = slurm_job(slurm_config(tmp_path), body)
    assert time.time() - t0 < 20  # the stand-in srun ended on the signal, not after 30 s
    assert got.read_text().split() == ["USR1"]
    assert ["scontrol", "requeue", "1234"] in [c[0] for c in calls]
    assert len([c for c in calls if c[0][0] == "srun"]) == 1 and "launch: restart" not in out
    assert (
        out.splitlines()[-1] == "preempted, requeued, will resume from step 0 (requeueing job 1234)"
    )


def test_a_job_slurm_will_not_requeue_ends_saying_so(tmp_path, slurm_job):
    """A cancel or the time limit itself (TERM to everything): scontrol requeue is refused; the
    job ends with 75 and its last line and record say it was not requeued."""
    body, got, started = saving_srun(tmp_path)
    signal_once(started, signal.SIGTERM)
    refuse = (
        'if [ "$1" = requeue ]; then echo "Requested operation is presently disabled" >&2; '
        "exit 1; fi\n"
    )
    calls, out = slurm_job(slurm_config(tmp_path), body, scontrol_body=refuse, expect_rc=75)
    assert out.splitlines()[-1] == (
        "not requeued after all: submit the same run again to resume from step 0"
    )
    ends = (tmp_path / "runs" / "tiny" / "slurm_job_ends.txt").read_text().splitlines()
    assert ends[-1] == "1234 75 ended"


@pytest.mark.parametrize("state", ["CANCELLED", "TIMEOUT"])
def test_a_cancel_or_the_time_limit_is_neither_restarted_nor_requeued(tmp_path, slurm_job, state):
    """``scancel JOB`` and the time limit send TERM to everything, srun kills the ranks (137):
    SLURM already calls the job CANCELLED (TIMEOUT), and the supervisor says so, last."""
    body, got, started = saving_srun(tmp_path)
    body = body.replace("; echo {} > ", "; : ").replace("exit 75'", "exit 137'")
    signal_once(started, signal.SIGTERM)
    show_job = f'if [ "$1 $2" = "show job" ]; then echo "JobId=1234 JobState={state}"; fi\n'
    calls, out = slurm_job(slurm_config(tmp_path), body, scontrol_body=show_job, expect_rc=137)
    assert not any(c[0][:2] == ["scontrol", "requeue"] for c in calls)
    assert "launch: restart" not in out
    assert out.splitlines()[-1] == (
        f"job 1234 is {state}: not requeued, not restarted; submit "
        "the same run again to resume from step 0"
    )


def test_without_requeue_a_stop_signal_ends_the_job_cleanly(tmp_path, slurm_job):
    body, got, started = saving_srun(tmp_path)
    signal_once(started, signal.SIGTERM)
    calls, out = slurm_job(slurm_config(tmp_path, requeue=False), body, expect_rc=75)
    assert not any(c[0][:2] == ["scontrol", "requeue"] for c in calls)
    assert out.splitlines()[-1] == (
        "preempted, not requeued (launch.slurm.requeue: false): "
        "submit the same run again to resume from step 0"
    )


@pytest.mark.parametrize("moment", ["building the op", "between build and srun"])
def test_a_signal_before_srun_starts_requeues_without_starting_it(tmp_path, slurm_job, moment):
    """While the supervisor builds DeepSpeed's op, or just after: no rank is started at all."""
    (tmp_path / "runs" / "tiny").mkdir(parents=True)

    def signal_now():
        os.kill(os.getpid(), signal.SIGUSR1)
        return 0

    if moment == "building the op":
        calls, out = slurm_job(slurm_config(tmp_path), srun_body="exit 0\n", before_srun=signal_now)
        assert "USR1 before srun started: no rank ran, nothing to save" in out
    else:
        # The signal lands while srun is being started: it is passed on at once, and the
        # stand-in, which ends on USR1 like the ranks, is not waited for.
        body, got, started = saving_srun(tmp_path)
        calls, out = slurm_job(
            slurm_config(tmp_path),
            srun_body=body,
            before_srun=lambda: (
                signal_once(tmp_path / "runs", signal.SIGUSR1),
                time.sleep(0.2),
                0,
            )[-1],
        )
    assert ["scontrol", "requeue", "1234"] in [c[0] for c in calls]
    assert "requeueing job 1234" in out


def test_a_signal_the_ranks_could_not_act_on_requeues_from_the_newest_checkpoint(
    tmp_path, slurm_job
):
    """``scancel --full --signal=TERM`` also reaches srun, which kills every rank (137): nothing
    new was saved, and that is no training failure either: no restart, a requeue from the
    newest complete checkpoint."""
    run_dir = tmp_path / "runs" / "tiny"
    tag = run_dir / "checkpoints" / "step_0000010"
    tag.mkdir(parents=True)
    (tag / "checkpoint.json").write_text("{}")
    body, got, started = saving_srun(tmp_path)
    body = body.replace("; echo {} > ", "; : ").replace("exit 75'", "exit 137'")
    signal_once(started, signal.SIGTERM)
    calls, out = slurm_job(slurm_config(tmp_path), body)
    assert "stopped by SIGTERM before the ranks could save (srun exited with status 137)" in out
    assert "launch: restart" not in out
    assert out.splitlines()[-1] == (
        "preempted, requeued, will resume from step 10 (requeueing job 1234)"
    )


@pytest.mark.parametrize(
    "slurm, key",
    [
        ({"partition": "gpu; touch /tmp/x"}, "launch.slurm.partition"),
        ({"account": "$(id)"}, "launch.slurm.account"),
        ({"time": "2h"}, "launch.slurm.time"),
        ({"extra_sbatch": ["--mem=0\nrm -rf /"]}, "launch.slurm.extra_sbatch[0]"),
        ({"job_name": "a\nb"}, "launch.slurm.job_name"),
        ({"socket_ifname": "eth0 eth1"}, "launch.slurm.socket_ifname"),
        ({"nodes": 3}, "parallel.world_size"),
        (
            {"extra_sbatch": ["--signal=B:USR1@60"]},
            "launch.slurm.extra_sbatch[0]: '--signal=B:USR1",
        ),
        (
            {"time": "4:00", "signal_seconds": 180},
            "a limit of 240 s leaves no time to train before the preemption signal at signal_seconds "
            "(180 s) before it; it must exceed 240 s",
        ),
    ],
)
def test_values_no_quoting_can_carry_are_refused_with_their_key(tmp_path, slurm, key):
    with pytest.raises(ConfigError) as e:
        build_plan(slurm_config(tmp_path, **slurm))
    assert key in str(e.value)


def test_percent_in_the_run_directory_is_refused_for_the_job_log(tmp_path):
    cfg = slurm_config(tmp_path)
    cfg.output_dir = str(tmp_path / "runs%j")
    with pytest.raises(ConfigError, match="output_dir.*'%'"):
        build_plan(cfg)


@pytest.mark.parametrize(
    "time_limit, seconds",
    [
        ("30", 1800),
        ("45:30", 2730),
        ("12:00:00", 43200),
        ("48:00:00", 172800),
        ("2-12", 216000),
        ("2-12:30", 217800),
        ("2-12:30:15", 217815),
        ("UNLIMITED", None),
        ("infinite", None),
        ("0", None),
        ("0:30", 30),
    ],
)
def test_every_slurm_time_format_is_accepted(time_limit, seconds):
    assert slurm_time_seconds(time_limit) == seconds


@pytest.mark.parametrize(
    "time_limit, why",
    [
        ("99:99:99", "minutes 99 out of range 0-59"),
        ("10:60", "seconds 60 out of range 0-59"),
        ("1-24:00", "hours 24 out of range 0-23"),
        ("1:2:3:4", "not a SLURM time"),
        ("2h", "not a SLURM time"),
        ("-5", "not a SLURM time"),
    ],
)
def test_invalid_times_are_refused_with_the_reason(tmp_path, time_limit, why):
    with pytest.raises(
        ConfigError, match=f"launch.slurm.time: '{time_limit}' is not a SLURM time \\({why}\\)"
    ):
        build_plan(slurm_config(tmp_path, time=time_limit))


@pytest.mark.parametrize(
    "yaml_text, directive, seconds",
    [
        ("30", "30", 1800),  # a number is minutes, as sbatch reads --time=30
        ("0", "0", None),  # no limit, as sbatch reads --time=0
        ("0:30", "0:30", 30),  # YAML 1.1 would read the number 30 (base 60): 30 minutes
        ("24:00:00", "24:00:00", 86400),
        ("'90'", "90", 5400),
    ],
)
def test_time_is_read_from_yaml_as_sbatch_reads_it(tmp_path, yaml_text, directive, seconds):
    config = tmp_path / "run.yaml"
    config.write_text(
        f"name: tiny\noutput_dir: {tmp_path / 'runs'}\n"
        f"parallel: {{world_size: 4, expert_parallel_size: 2}}\n"
        f"launch:\n  scheduler: slurm\n  slurm:\n    signal_seconds: 0\n"
        f"    time: {yaml_text}\n"
    )
    cfg = load_config(config)
    assert str(cfg.launch.slurm.time) == directive
    assert slurm_time_seconds(str(cfg.launch.slurm.time)) == seconds
    assert sbatch_options(build_plan(cfg).files[JOB_SCRIPT])["--time"] == directive
    # The same on the command line (key=value overrides are YAML too).
    again = load_config(config, [f"launch.slurm.time={yaml_text}"])
    assert str(again.launch.slurm.time) == directive


def test_resubmit_comment_is_shell_quoted(tmp_path):
    cfg = slurm_config(tmp_path)
    cfg.output_dir = str(tmp_path / "my runs; $(touch x)")
    comment = build_plan(cfg).files[JOB_SCRIPT].splitlines()[1]
    command = comment.split("resubmit with: ", 1)[1]
    assert shlex.split(command) == ["sbatch", str(Path(cfg.output_dir) / "tiny" / JOB_SCRIPT)]


def training_calls(calls) -> list[list[str]]:
    return [c[0] for c in calls if c[0][0] == "srun" and "launch.rank" in c[0]]


def test_a_failed_srun_step_is_started_again_in_the_allocation(tmp_path, slurm_job):
    """launch.max_restarts, the policy of every scheduler (launch/supervise.py): srun fails
    (the ranks reached step 3), the supervisor starts the step again with another master port;
    it fails again at the same step with the same status and the supervisor stops there;
    max_restarts 0 never restarts."""
    run_dir = tmp_path / "runs" / "tiny"
    (run_dir / "logs").mkdir(parents=True)
    counter = tmp_path / "attempts"
    steps = " ".join(shlex.quote(str(run_dir / "logs" / f"steps_rank{r}.jsonl")) for r in range(4))
    # Attempt 1 fails with status 9 in step 3, attempt 2 finishes.
    body = (
        f"n=$(cat {counter} 2>/dev/null || echo 0); echo $((n + 1)) > {counter}\n"
        f'case "$*" in *launch.rank*) for f in {steps}; do printf \'{{"step": 1}}\\n'
        f'{{"step": 2}}\\n\' >> "$f"; done;; *) exit 0;; esac\n'
        'if [ "$n" -eq 0 ]; then exit 9; fi\nexit ${SECOND_STATUS:-0}\n'
    )
    calls, out = slurm_job(slurm_config(tmp_path), srun_body=body)
    trains = training_calls(calls)
    assert len(trains) == 2 and len(finish_calls(calls)) == 1
    assert (
        "launch: restart 1/3: a rank (the launcher did not say which) exited with code 9 at "
        "step 3; resuming from the start (no complete checkpoint yet)\n"
        "launch: job 1234 (restart 0, attempt 2): 4 ranks, master 10.9.0.7:"
    ) in out
    ports = [env["MASTER_PORT"] for argv, env in calls if argv in trains]
    assert ports == [str(15000 + 1234 * 4), str(15000 + 1234 * 4 + 1)]

    counter.unlink()
    body = body.replace("exit ${SECOND_STATUS:-0}", "exit 9")
    calls, out = slurm_job(slurm_config(tmp_path), srun_body=body, expect_rc=1)
    assert len(training_calls(calls)) == 2 and finish_calls(calls) == []
    assert out.splitlines()[-1].startswith(
        "error: training failed the same way twice in a row: a rank (the launcher did not say "
        "which) exited with code 9 at step 3"
    )

    counter.unlink()
    cfg = slurm_config(tmp_path)
    cfg.launch.max_restarts = 0
    calls, out = slurm_job(cfg, srun_body=body, expect_rc=1)
    assert len(training_calls(calls)) == 1
    assert "(launch.max_restarts: 0)" in out.splitlines()[-1]
    assert (run_dir / "slurm_job_ends.txt").read_text().splitlines()[-1] == "1234 1 ended"


@pytest.mark.parametrize("srun_status", [137, 0])
def test_a_cancel_while_the_ranks_start_is_recorded_before_slurm_kills_the_supervisor(
    tmp_path, slurm_job, srun_status
):
    """``moe-launch cancel`` (``scancel JOB``) while the ranks start up: they hold the TERM until
    their first step, longer than SLURM's KillWait, after which SLURM kills everything, the
    supervisor included. Its last line and the job's record in slurm_job_ends.txt are written
    as soon as it knows SLURM is ending the job, not once srun has ended: the stand-in srun
    (ranks still starting) waits for the record before it ends. srun may also exit 0 once
    SLURM gave up waiting for its step: the job is not taken for finished (no evaluation)."""
    run_dir = tmp_path / "runs" / "tiny"
    (run_dir / "logs").mkdir(parents=True)
    ends, seen, started = (
        run_dir / "slurm_job_ends.txt",
        tmp_path / "seen",
        tmp_path / "srun-started",
    )
    q = shlex.quote
    body = (
        f"trap : USR1\ntouch {q(str(started))}\n"
        f"for i in $(seq 200); do [ -s {q(str(ends))} ] && {{ touch {q(str(seen))}; "
        f"exit {srun_status}; }}; sleep 0.05; done\nexit {srun_status}\n"
    )
    signal_once(started, signal.SIGTERM)
    show_job = 'if [ "$1 $2" = "show job" ]; then echo "JobId=1234 JobState=CANCELLED"; fi\n'
    calls, out = slurm_job(
        slurm_config(tmp_path),
        body,
        scontrol_body=show_job,
        expect_rc=srun_status or PREEMPTED_EXIT_CODE,
    )
    assert seen.exists(), out  # recorded while srun still ran
    assert finish_calls(calls) == [] and "training finished" not in out
    assert ends.read_text().splitlines() == ["1234 143 ended"]  # one record for the run
    early = (
        "job 1234 is CANCELLED: not requeued, not restarted; submit the same run again to "
        "resume from step 0 (the ranks save if SLURM's KillWait leaves them time)"
    )
    # Said before srun ended, and again once it has, where SLURM lets the supervisor see it.
    lines = out.splitlines()
    assert lines.index(early) < lines.index(
        f"stopped by SIGTERM before the ranks could save "
        f"(srun exited with status {srun_status}): not a "
        f"training failure, not restarted"
    ), out
    assert lines[-1] == early.split(" (the ranks")[0], out
    assert not any(c[0][:2] == ["scontrol", "requeue"] for c in calls)


@pytest.mark.parametrize("after_s", [0.02, 0.05, 0.3])
def test_a_stop_signal_as_the_job_starts_is_held_for_the_supervisor(tmp_path, after_s):
    """USR1 to the batch shell (``--signal=B:USR1``, ``scancel --batch``) the moment the job
    starts, while the shell starts the supervisor and Python starts (a tenth of a second or
    more): the job script holds it and hands it over, and the job requeues without starting a
    rank, instead of ending FAILED by the signal's default action. The whole job script runs,
    with srun and scontrol replaced by recorders."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    recorder(bin_dir / "srun", log)
    recorder(bin_dir / "scontrol", log)
    ext = tmp_path / "ext"  # DeepSpeed's op "built": the supervisor skips the build
    (ext / allocation.OP_NAME).mkdir(parents=True)
    (ext / allocation.OP_NAME / f"{allocation.OP_NAME}.so").write_bytes(b"")
    cfg = slurm_config(tmp_path)
    cfg.launch.env = {"TORCH_EXTENSIONS_DIR": str(ext)}
    plan = build_plan(cfg)
    plan.write_run_dir(dump_config(cfg))
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "1234",
        "SLURM_JOB_NODELIST": "node7",
        "PYTHONPATH": str(ROOT),
        "TMPDIR": str(tmp_path),
    }
    job = subprocess.Popen(
        ["bash", str(Path(plan.run_dir) / JOB_SCRIPT)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    time.sleep(after_s)
    job.send_signal(signal.SIGUSR1)
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 0, out  # requeued (the requeue's own stop ends the job)
    assert "USR1 before srun started: no rank ran, nothing to save" in out, out
    assert "requeueing job 1234" in out
    calls = log.read_text()
    assert "requeue\x001234" in calls and "launch.rank" not in calls
    assert list(tmp_path.glob("moe_held_signals.*")) == []  # the shell's record is removed
