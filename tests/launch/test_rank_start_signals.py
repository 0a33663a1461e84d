"""A preemption signal that reaches a rank's training process before its first instruction.

An srun step signals every process of the step at once (``scancel --signal=TERM JOB``), so a
TERM can reach ``python -m launch.train`` while its interpreter is still starting, before
launch/signal_latch.py holds it. launch/rank.py therefore starts it with the preemption signals
blocked and the latch unblocks them once installed: the signal waits, pending, instead of
killing the rank with the default action (exit 143, which the supervisor took for a failure
and restarted instead of requeueing)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import launch.rank as rank
from launch.signal_latch import CATCHABLE

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = (
    "import signal; print(sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])))"
)


def test_the_training_process_starts_with_the_preemption_signals_blocked(monkeypatch):
    real_popen = subprocess.Popen
    probe = {}

    def popen(cmd, **kwargs):
        assert cmd[1:4] == ["-u", "-m", "launch.train"], cmd
        probe["proc"] = real_popen(
            [sys.executable, "-c", BLOCKED], stdout=subprocess.PIPE, text=True, **kwargs
        )
        return probe["proc"]

    monkeypatch.setattr(rank.subprocess, "Popen", popen)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    rank.start_training(["--config", "x.yaml"])
    out, _ = probe["proc"].communicate(timeout=30)
    assert {int(s) for s in CATCHABLE} <= set(json.loads(out)), out
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before  # ours is restored


def test_the_latch_takes_a_signal_that_was_pending_while_blocked():
    code = (
        "import os, signal; signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM]); "
        "os.kill(os.getpid(), signal.SIGTERM); "
        "from launch.signal_latch import LATCH; LATCH.install(); print(LATCH.first)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.strip() == str(int(signal.SIGTERM)), proc


def test_term_to_the_whole_step_as_the_rank_starts_does_not_kill_it(tmp_path):
    """Like srun's step: TERM to every process of the rank's group the moment rank.py has
    started its child. The child holds it, reaches its config check and exits 2 (the config
    does not exist); before the fix it died of the signal (143)."""
    config = tmp_path / "missing.yaml"
    for _ in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-m", "launch.rank", "--config", str(config)],
            cwd=ROOT,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        deadline = time.time() + 30
        while time.time() < deadline and not children.read_text().split():
            pass
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, err[-2000:]
    ends = [
        json.loads(line)
        for line in (tmp_path / "logs" / "exits_rank0.jsonl").read_text().splitlines()
    ]
    assert [(e["returncode"], e["signal"]) for e in ends] == [(2, None)] * 3
