"""The restart loop of local and hostfile launches (launch/restarts.py) with a fake launcher: a
small script that plays both ranks (their step records, their exit records as launch/rank.py
writes them) and follows a per-attempt script of outcomes. The real launch is tested in
tests/integration/test_fault_campaign.py."""

import json
import os
import sys
import time

import pytest

from launch import restarts as restart_policy
from launch.rank import exit_record, exits_file
from launch.restarts import RESTARTS_FILE, Relaunch, run_with_restarts
from moe.core.errors import LaunchError
from tests.launch.test_config_errors import launch_errors

FAKE = r"""
import json, sys, time
from pathlib import Path
from launch.rank import exit_record, exits_file

run_dir, script = Path(sys.argv[1]), json.loads(sys.argv[2])
logs = run_dir / "logs"
counter = logs / "attempts"
n = int(counter.read_text()) if counter.exists() else 0
counter.write_text(str(n + 1))
outcome = script[min(n, len(script) - 1)]
ckpt = run_dir / "checkpoints"
tags = sorted(p.name for p in ckpt.glob("step_*")) if ckpt.exists() else []
start = int(tags[-1].split("_")[1]) if tags else 0
for rank in (0, 1):
    with (logs / f"steps_rank{rank}.jsonl").open("a") as f:
        for step in range(start + 1, outcome["reach"] + 1):
            f.write(json.dumps({"step": step}) + "\n")
if outcome.get("hang"):  # what a hang watchdog writes before it exits with code 70
    with (logs / "hangs_rank0.jsonl").open("a") as f:
        f.write(json.dumps(outcome["hang"]) + "\n")
if outcome.get("final"):  # a rank's word that no restart fixes this (launch/train.py)
    from launch.restarts import record_final
    record_final(logs, 1, "storage", outcome["final"])
for rank, rc in enumerate(outcome["ranks"]):
    if rc is not None:
        with exits_file(logs, rank).open("a") as f:
            f.write(json.dumps(exit_record(rank, 1000 + rank, rc)) + "\n")
    time.sleep(0.01)  # the failing rank's end comes first
if outcome.get("linger"):
    time.sleep(3600)
sys.exit(outcome["launcher"])
"""


def run(
    tmp_path, script, max_restarts=3, checkpoints=(), preempted=lambda rc: rc == 75, replan=None
):
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    for step in checkpoints:  # a complete checkpoint: its directory and its marker
        tag = run_dir / "checkpoints" / f"step_{step:07d}"
        tag.mkdir(parents=True)
        (tag / "checkpoint.json").write_text("{}")
    fake = tmp_path / "fake_launcher.py"
    fake.write_text(FAKE)
    cmd = [sys.executable, str(fake), str(run_dir), json.dumps(script)]
    rc = run_with_restarts(
        cmd, None, run_dir, 2, max_restarts, preempted, replan and (lambda: replan(cmd))
    )
    return rc, run_dir


def attempts(run_dir) -> int:
    return int((run_dir / "logs" / "attempts").read_text())


def restarts(run_dir) -> list[dict]:
    path = run_dir / "logs" / RESTARTS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


KILLED = -9  # subprocess's return code of a process killed by SIGKILL


def test_failures_are_restarted_and_logged_with_rank_cause_and_step(tmp_path, capsys):
    script = [
        {"reach": 4, "ranks": [None, KILLED], "launcher": 137},
        {"reach": 6, "ranks": [70, 143], "launcher": 70},
        {"reach": 8, "ranks": [0, 0], "launcher": 0},
    ]
    rc, run_dir = run(tmp_path, script)
    assert rc == 0 and attempts(run_dir) == 3
    out = capsys.readouterr().out
    assert (
        "restart 1/3: rank 1 exited with signal SIGKILL at step 5; resuming from the start" in out
    )
    assert "restart 2/3: rank 0 exited with code 70 at step 7" in out
    got = restarts(run_dir)
    assert [(r["restart"], r["rank"], r["returncode"], r["signal"], r["step"]) for r in got] == [
        (1, 1, None, "SIGKILL", 5),
        (2, 0, 70, None, 7),
    ]


def test_a_failure_no_restart_fixes_stops_at_once_naming_its_cause(tmp_path):
    """A full disk recorded by rank 1: no restart (three were allowed), and the one error says
    why, in its last words. A final record of an earlier attempt does not count."""
    cause = "the checkpoint storage at /ckpt is full: 0 bytes free"
    script = [
        {"reach": 4, "ranks": [2, 2], "launcher": 2, "final": cause},
        {"reach": 8, "ranks": [0, 0], "launcher": 0},
    ]
    with pytest.raises(LaunchError) as e:
        run(tmp_path, script)
    assert str(e.value).endswith(
        f"not restarted, a restart cannot fix this: storage on rank 1: {cause}"
    )
    assert attempts(tmp_path / "run") == 1 and restarts(tmp_path / "run") == []
    # The same record from a finished attempt: the next failure is restarted as usual.
    (tmp_path / "run" / "logs" / "attempts").unlink()
    script = [
        {"reach": 2, "ranks": [None, KILLED], "launcher": 137},
        {"reach": 8, "ranks": [0, 0], "launcher": 0},
    ]
    rc, run_dir = run(tmp_path, script)
    assert rc == 0 and attempts(run_dir) == 2 and len(restarts(run_dir)) == 1


def test_the_failing_step_counts_from_the_checkpoint_the_attempt_resumed(tmp_path, capsys):
    """An attempt that dies before completing a step: the step after the resumed checkpoint, not
    the step an earlier attempt had reached, and said to be a failure while starting, not one
    of a step that ran."""
    script = [
        {"reach": 9, "ranks": [1, None], "launcher": 1},
        {"reach": 0, "ranks": [2, None], "launcher": 2},
        {"reach": 9, "ranks": [0, 0], "launcher": 0},
    ]
    run(tmp_path, script, checkpoints=[6])
    out = capsys.readouterr().out
    assert "rank 0 exited with code 1 at step 10" in out
    assert "rank 0 exited with code 2 before completing a step (starting, or in step 7)" in out
    assert "code 1 before completing" not in out


def test_the_same_failure_at_the_same_step_twice_stops_early(tmp_path):
    script = [
        {"reach": 4, "ranks": [None, 3], "launcher": 3},
        {"reach": 4, "ranks": [3, None], "launcher": 3},
    ]  # another rank, same cause
    with pytest.raises(
        LaunchError,
        match=r"failed the same way twice in a row: rank 0 exited "
        r"with code 3 at step 5, as before restart 1/5",
    ):
        run(tmp_path, script, max_restarts=5)
    assert attempts(tmp_path / "run") == 2


def test_restarts_run_out(tmp_path):
    script = [{"reach": s, "ranks": [None, 1], "launcher": 1} for s in (2, 4, 6)]
    with pytest.raises(
        LaunchError,
        match=r"rank 1 exited with code 1 at step 7, after 2 "
        r"restart\(s\) \(launch.max_restarts\)",
    ):
        run(tmp_path, script, max_restarts=2)
    assert attempts(tmp_path / "run") == 3


def test_max_restarts_0_never_restarts(tmp_path):
    with pytest.raises(LaunchError, match=r"launch.max_restarts: 0"):
        run(tmp_path, [{"reach": 2, "ranks": [None, 1], "launcher": 1}], max_restarts=0)
    assert attempts(tmp_path / "run") == 1


def test_a_preemption_is_returned_not_restarted(tmp_path):
    rc, run_dir = run(tmp_path, [{"reach": 2, "ranks": [75, 75], "launcher": 75}])
    assert rc == 75 and attempts(run_dir) == 1 and restarts(run_dir) == []


def test_a_launcher_that_outlives_a_failed_rank_is_stopped(tmp_path, monkeypatch):
    """Ranks on other nodes are not DeepSpeed's per-node launcher's to stop: once a rank's end
    is recorded and the launcher still runs after the grace period, its tree is terminated."""
    monkeypatch.setattr(restart_policy, "GRACE_S", 1.0)
    script = [
        {"reach": 3, "ranks": [None, KILLED], "launcher": 1, "linger": True},
        {"reach": 5, "ranks": [0, 0], "launcher": 0},
    ]
    t0 = time.monotonic()
    rc, run_dir = run(tmp_path, script)
    assert rc == 0 and time.monotonic() - t0 < 30
    assert restarts(run_dir)[0]["signal"] == "SIGKILL"


def test_exit_records_name_a_signal_or_a_code(tmp_path):
    assert exit_record(1, 5, -15)["signal"] == "SIGTERM"
    assert exit_record(1, 5, 70)["returncode"] == 70
    assert exits_file(tmp_path, 3).name == "exits_rank3.jsonl"


def test_max_restarts_is_validated_by_name(tmp_path, capsys):
    problems = launch_errors(tmp_path, capsys, "launch.max_restarts=-1", "launch.max_restart=2")
    assert "launch.max_restarts: must be >= 0, got -1" in problems
    assert any(p.startswith("launch.max_restart: unknown key") for p in problems)


def test_a_replanned_restart_runs_the_new_command_and_logs_why(tmp_path, capsys):
    """launch.elastic's hook (launch/elastic.py): the restart runs the command and world size
    it returns, prints its note and adds its record."""
    failing = [{"reach": 2, "ranks": [None, KILLED], "launcher": 137}]

    def replan(cmd):
        # The first command would fail forever; the replanned one finishes.
        return Relaunch(
            cmd[:-1] + [json.dumps([{"reach": 4, "ranks": [0], "launcher": 0}])],
            1,
            "elastic: host b unreachable",
            {"elastic": {"world_size": 1}},
        )

    rc, run_dir = run(tmp_path, failing, replan=replan)
    assert rc == 0 and attempts(run_dir) == 2
    assert "launch: elastic: host b unreachable" in capsys.readouterr().out
    assert restarts(run_dir)[0]["elastic"] == {"world_size": 1}


def test_a_replan_that_finds_no_layout_stops_without_restarting(tmp_path):
    def replan(cmd):
        raise LaunchError("elastic: 0 usable slot(s) of 2")

    with pytest.raises(
        LaunchError,
        match=r"training failed: rank 1 exited with code 1 at step 3; "
        r"not restarted: elastic: 0 usable slot\(s\) of 2",
    ):
        run(tmp_path, [{"reach": 2, "ranks": [None, 1], "launcher": 1}], replan=replan)
    assert attempts(tmp_path / "run") == 1


def test_a_hang_names_the_rank_that_did_not_arrive_not_the_one_that_reported_it(tmp_path, capsys):
    """Rank 0's watchdog exits with 70 first; its report names rank 1 (frozen), which the
    failure line blames."""
    hang = {
        "rank": 0,
        "step": 4,
        "collective": "all_reduce",
        "call": 57,
        "inside": True,
        "missing": {"1": "stopped responding: its heartbeat did not change in 1.8s"},
        "time": time.time(),
    }
    script = [
        {"reach": 3, "ranks": [70, KILLED], "launcher": 70, "hang": hang},
        {"reach": 5, "ranks": [0, 0], "launcher": 0},
    ]
    rc, run_dir = run(tmp_path, script)
    assert rc == 0
    out = capsys.readouterr().out
    assert (
        "restart 1/3: rank 1 hung at step 4: stopped responding: its heartbeat did not "
        "change in 1.8s; it did not reach all_reduce (collective call 57), reported by the "
        "hang watchdog of rank(s) 0"
    ) in out, out
    assert "rank 0 exited" not in out
    assert restarts(run_dir)[0]["rank"] == 1 and restarts(run_dir)[0]["hang"]


def test_steps_written_in_an_attempt_count_even_when_the_file_clock_lags(tmp_path):
    """A file's mtime comes from a coarse clock: a step written a moment after the attempt
    started can carry an mtime before it. The attempt counts the steps its ranks wrote (the
    file changed since it started), and none of an earlier attempt's."""
    logs = tmp_path / "logs"
    logs.mkdir()
    old = logs / "steps_rank1.jsonl"
    old.write_text('{"step": 7}\n')  # an earlier attempt's, untouched in this one
    attempt = restart_policy.Attempt(tmp_path, 2, resumed_step=2)
    path = logs / "steps_rank0.jsonl"
    path.write_text('{"step": 3}\n{"step": 4}\n')
    lagging = attempt.started - 0.004
    os.utime(path, (lagging, lagging))
    assert attempt.last_step(0) == 4
    assert attempt.last_step(1) == 2  # nothing written by rank 1 in this attempt: the resumed step
    assert attempt.last_step(None) == 2
    with old.open("a") as f:
        f.write('{"step": 3}\n')
    assert attempt.last_step(1) == 7 and attempt.last_step(None) == 4


def _complete(ckpt_dir, tag, files):
    """A checkpoint directory with a completion marker recording ``files`` (name: size)."""
    tag_dir = ckpt_dir / tag
    tag_dir.mkdir(parents=True)
    for name, size in files.items():
        (tag_dir / name).write_bytes(b"x" * size)
    marker = {"format": 1, "files": files, "num_moe_layers": 0, "num_experts": 0}
    (tag_dir / "checkpoint.json").write_text(json.dumps(marker))
    return tag_dir


def test_a_damaged_or_mismatched_checkpoint_is_not_restarted(tmp_path):
    """A restart would load the same checkpoint again: a damaged newest checkpoint is final, with
    how to resume from the one before it; a checkpoint of another model is final too."""
    from launch.train import final_cause
    from moe.checkpoint.files import verify_files
    from moe.core.errors import CheckpointError

    ckpt = tmp_path / "checkpoints"
    _complete(ckpt, "step_0000050", {"a.pt": 8})
    newest = _complete(ckpt, "step_0000100", {"a.pt": 8})
    (newest / "a.pt").write_bytes(b"x" * 3)  # truncated
    with pytest.raises(CheckpointError) as e:
        verify_files(newest)
    kind, cause = final_cause(e.value, ckpt)
    assert kind == "checkpoint" and "truncated or altered: 3 bytes" in cause
    assert cause.endswith(
        f"to resume from step_0000050, the complete checkpoint before it, move {newest} out of "
        f"{ckpt} and run the same command again"
    )
    (newest / "checkpoint.json").write_text("{not json")
    assert (
        "move" in final_cause(pytest.raises(CheckpointError, verify_files, newest).value, ckpt)[1]
    )
    mismatch = CheckpointError(f"checkpoint {newest} does not match this run: model.d_model")
    assert final_cause(mismatch, ckpt) == ("checkpoint", str(mismatch))  # no hint: not damage


def test_resume_takes_a_run_or_checkpoints_directory_as_its_newest_checkpoint(tmp_path):
    """moe-train --resume accepts what every other command accepts: a checkpoint, the run
    directory or its checkpoints directory (the newest complete checkpoint); an interrupted save
    is still named as one, and a directory with no checkpoint says so."""
    from moe.core.errors import CheckpointError
    from moe.training.checkpoint import resolve_resume

    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    _complete(ckpt, "step_0000050", {"a.pt": 8})
    newest = _complete(ckpt, "step_0000100", {"a.pt": 8})
    (ckpt / "step_0000150").mkdir()  # an interrupted save: no marker
    for given in (run_dir, ckpt, newest):
        assert resolve_resume(str(given), ckpt) == newest
    with pytest.raises(CheckpointError, match="neither a checkpoint"):
        resolve_resume(str(run_dir / "checkpoints" / "step_0000150"), ckpt)
    (run_dir / "logs").mkdir()
    with pytest.raises(CheckpointError, match="neither a checkpoint"):
        resolve_resume(str(run_dir / "logs"), ckpt)
