"""The local launcher's signals and exit codes, end to end (moe-launch -> deepspeed launcher ->
2 ranks on the tiny config), and a frozen rank: SIGSTOP on rank 1 is reported by rank 0's hang
watchdog before the collective times out, naming rank 1, and the stopped process is killed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from moe.training.resilience.faults import PLAN_ENV
from moe.training.resilience.watchdog import hang_file, hang_records_file
from tests.conftest import tiny_run_dict
from tests.helpers.fault_runs import ROOT, write_run_config
from tests.integration.launch_checks import steps, training_ranks

pytestmark = pytest.mark.integration

HANG_TIMEOUT_S = 10


def start(config: Path, *overrides: str) -> subprocess.Popen:
    """moe-launch in a session of its own, as a shell starts a foreground job (a terminal's
    Ctrl-C goes to its process group)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "launch.launch", str(config), "--no-eval", *overrides],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


@contextlib.contextmanager
def killed_on_failure(proc: subprocess.Popen):
    """A failed check leaves no training behind (these runs have 10,000 steps)."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(psutil.NoSuchProcess):
            tree = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
            for pid in tree:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        proc.wait()
        raise


def wait_for_steps(proc: subprocess.Popen, run_dir: Path, n: int, rank: int = 0) -> None:
    deadline = time.time() + 300
    while len(steps(run_dir, rank)) < n:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.time() < deadline, f"rank {rank} did not reach step {n}"
        time.sleep(0.05)


def alive(pids) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def config(tiny_data, tmp_path: Path, name: str, **train) -> tuple[Path, Path]:
    d = tiny_run_dict(tiny_data, tmp_path / "runs", **train)
    d.update(
        name=name,
        checkpoint={"every_n_steps": 0},
        launch={"max_restarts": 0},
        logging={"log_every": 1, "tensorboard": False},
    )
    return write_run_config(tmp_path / f"{name}.yaml", d), tmp_path / "runs" / name


def test_a_frozen_rank_is_named_by_the_healthy_one_and_killed(tiny_data, tmp_path):
    cfg, run_dir = config(
        tiny_data, tmp_path, "frozen", max_steps=10_000, hang_timeout_s=HANG_TIMEOUT_S
    )
    proc = start(cfg)
    with killed_on_failure(proc):
        wait_for_steps(proc, run_dir, 3, rank=1)
        frozen = training_ranks(proc.pid)[1]
        frozen.suspend()  # SIGSTOP
        t0 = time.monotonic()
        out, _ = proc.communicate(timeout=300)
    elapsed = time.monotonic() - t0

    # Failed (not preempted), promptly: the watchdog fires after the timeout plus a few polls,
    # and the stopped process is killed at once instead of being waited for.
    assert proc.returncode == 2, out[-3000:]
    assert elapsed < HANG_TIMEOUT_S + 25, (elapsed, out[-3000:])
    assert alive([frozen.pid]) == []
    assert f"launch: killed rank 1 (pid {frozen.pid}): stopped" in out, out[-3000:]
    # The failure line blames rank 1, the frozen one, not rank 0 whose watchdog fired.
    failure = [line for line in out.splitlines() if "training failed" in line]
    assert len(failure) == 1 and "training failed: rank 1 hung at step" in failure[0], out[-3000:]
    assert "stopped responding" in failure[0] and "rank 0 exited" not in out

    logs = run_dir / "logs"
    report = hang_file(logs, 0).read_text()
    assert report.startswith("rank 0: hang: no training step completed for "), report[:500]
    assert "last collective entered: " in report and "still inside it" in report, report[:800]
    assert "rank 1: stopped responding: its heartbeat did not change" in report, report[:800]
    assert 'File "' in report and "Thread 0x" in report  # every thread's stack
    record = json.loads(hang_records_file(logs, 0).read_text().splitlines()[-1])
    assert list(record["missing"]) == ["1"] and record["inside"] and record["collective"]
    assert not hang_file(logs, 1).exists()  # a stopped process writes nothing
    assert "hang: no training step completed" in (logs / "rank0.log").read_text()
    assert (
        json.loads((logs / "exits_rank1.jsonl").read_text().splitlines()[-1])["signal"] == "SIGKILL"
    )


def test_term_and_ctrl_c_save_and_exit_75_a_second_signal_stops_at_once(tiny_data, tmp_path):
    cfg, run_dir = config(tiny_data, tmp_path, "signals", max_steps=10_000)

    def interrupted(send, after_steps: int):
        proc = start(cfg)
        with killed_on_failure(proc):
            wait_for_steps(proc, run_dir, after_steps)
            ranks = training_ranks(proc.pid)
            tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
            assert len(ranks) == 2
            send(proc)
            out, _ = proc.communicate(timeout=300)
        assert alive(tree) == [], out[-3000:]  # no orphan left behind, ranks included
        assert "Traceback" not in out, out[-5000:]
        return proc.returncode, out

    # SIGTERM to moe-launch: every rank saves and stops; moe-launch exits 75, one message.
    rc, out = interrupted(lambda p: p.send_signal(signal.SIGTERM), 3)
    marker = json.loads((run_dir / "preempted.json").read_text())
    saved = marker["step"]
    assert rc == 75, out[-3000:]
    assert out.count("preempted (exit code 75") == 1 and "on SIGTERM to moe-launch" in out
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{saved:07d}"

    # Ctrl-C (SIGINT to moe-launch's process group): the same, resuming from that checkpoint.
    rc, out = interrupted(lambda p: os.killpg(p.pid, signal.SIGINT), saved + 2)
    assert rc == 75, out[-3000:]
    assert out.count("preempted (exit code 75") == 1 and "on SIGINT to moe-launch" in out
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{saved:07d}'}" in out
    second = json.loads((run_dir / "preempted.json").read_text())["step"]
    assert second > saved

    # A second signal does not wait for the save: Ctrl-C then SIGTERM (two of the same kind
    # sent at once would merge into one) stop the ranks at once, exit 128 + 15, nothing saved.
    def twice(p):
        p.send_signal(signal.SIGINT)
        p.send_signal(signal.SIGTERM)

    rc, out = interrupted(twice, second + 2)
    assert rc == 143, out[-3000:]
    assert out.count("stopped by SIGTERM without saving (exit code 143)") == 1, out[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{second:07d}"


@pytest.mark.parametrize("target", ["moe-launch", "its process group"])
def test_a_killed_moe_launch_takes_the_runner_and_every_rank_with_it(tiny_data, tmp_path, target):
    """SIGKILL cannot be caught: nothing is saved, but nothing trains on either. The runner
    (DeepSpeed's, in a session of its own) gets its parent-death signal, each rank sees through
    its pidfd that moe-launch is gone and stops (launch/launcher_watch.py)."""
    cfg, run_dir = config(tiny_data, tmp_path, "killed", max_steps=10_000)
    proc = start(cfg)
    with killed_on_failure(proc):
        wait_for_steps(proc, run_dir, 2, rank=1)
        tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        assert len(training_ranks(proc.pid)) == 2
        if target == "moe-launch":
            proc.send_signal(signal.SIGKILL)
        else:  # moe-launch leads its group (started in a session of its own, as by a shell)
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    t0 = time.monotonic()
    deadline = t0 + 10
    while alive(tree) and time.monotonic() < deadline:
        time.sleep(0.05)
    print(f"{target} killed: its {len(tree)} descendants gone in {time.monotonic() - t0:.2f} s")
    left = {}
    for pid in alive(tree):  # the check has failed: leave nothing training behind
        with contextlib.suppress(psutil.Error):
            left[pid] = psutil.Process(pid).cmdline()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert left == {}, left
    out = proc.stdout.read()
    assert (
        f"moe-launch (pid {proc.pid}) is gone: stopping rank pid"
        in (run_dir / "logs" / "rank0.log").read_text()
    ), out[-3000:]


def test_two_ctrl_c_0_3_s_apart_say_both_and_stop_at_once(tiny_data, tmp_path):
    """Ctrl-C twice, 0.3 s apart, while rank 0 is inside a long step (the test-only fault plan
    holds it 60 s, so that no save can end the run between the two): the first is announced
    as it arrives, the second stops the ranks at once without waiting for the save: exit 130,
    each signal said once, in order."""
    cfg, run_dir = config(tiny_data, tmp_path, "twice", max_steps=10_000)
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
                        "step": 4,
                        "phase": "forward",
                        "seconds": 60,
                    }
                ],
            }
        )
    )
    proc = start(cfg, f"launch.env={{{PLAN_ENV}: {plan}}}")
    with killed_on_failure(proc):
        while not (plan.parent / "fault_0").exists():
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            time.sleep(0.05)
        tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=300)
    assert time.monotonic() - t0 < 30, out[-3000:]  # not the end of the 60 s step
    assert proc.returncode == 130, out[-3000:]
    assert alive(tree) == [], out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("launch: ")]
    said = [
        "launch: SIGINT: every rank saves at the end of its step and stops",
        "launch: SIGINT, a second signal: stopping every rank now, without waiting for the save",
        "launch: stopped by SIGINT without saving (exit code 130)",
    ]
    found = [[i for i, line in enumerate(lines) if line.startswith(s)] for s in said]
    assert [len(f) for f in found] == [1, 1, 1] and found == sorted(found), lines
    assert "Traceback" not in out, out[-5000:]
    assert max(steps(run_dir, 0)) == 3 and not (run_dir / "checkpoints" / "latest").exists()
