"""Checks shared by the end-to-end launcher tests: what a finished two-rank run leaves behind."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import yaml


def write_config(path: Path, run: dict) -> Path:
    path.write_text(yaml.safe_dump(run))
    return path


def moe_launch(
    args: list[str], env: dict | None = None, timeout: float = 600, prefix: list[str] = ()
):
    """Run the real launcher in a fresh process, with this checkout importable by every rank;
    ``prefix`` runs it elsewhere (e.g. inside a network namespace)."""
    root = str(Path(__file__).resolve().parents[2])
    base = dict(os.environ if env is None else env)
    base["PYTHONPATH"] = root + (os.pathsep + base["PYTHONPATH"] if base.get("PYTHONPATH") else "")
    return subprocess.run(
        [*prefix, sys.executable, "-m", "launch.launch", *args],
        env=base,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def check_finished_run(
    run_dir: Path, max_steps: int, ranks: int = 2, experts: int = 4, layers: int = 2
) -> None:
    """Every rank ran (its log and its own optimizer-state files), the final checkpoint holds
    every expert, TensorBoard has every step."""
    tag = f"step_{max_steps:07d}"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == tag
    tag_dir = run_dir / "checkpoints" / tag
    names = {p.relative_to(tag_dir).as_posix() for p in tag_dir.rglob("*")}
    for rank in range(ranks):
        assert (run_dir / "logs" / f"rank{rank}.log").exists()
        assert f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" in names, sorted(names)
    for layer in range(layers):
        for expert in range(experts):
            assert f"experts/layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt" in names

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    losses = acc.Scalars("train/loss")
    assert sorted({e.step for e in losses}) == list(range(1, max_steps + 1))
    assert all(math.isfinite(e.value) for e in losses)


def steps(run_dir: Path, rank: int) -> dict[int, dict]:
    """The record of each step (a line being written when a rank was killed is skipped)."""
    path = run_dir / "logs" / f"steps_rank{rank}.jsonl"
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        if line.endswith("}"):
            row = json.loads(line)
            out[row["step"]] = row
    return out


def training_ranks(launcher_pid: int) -> dict[int, psutil.Process]:
    """The training ranks (``launch.train``) among the descendants of moe-launch, by rank (they
    run in a session of their own, launch/interrupts.py)."""
    out = {}
    try:
        descendants = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return out
    for p in descendants:
        try:
            if "launch.train" in p.cmdline():
                out[int(p.environ()["RANK"])] = p
        except (psutil.Error, KeyError, ValueError):
            continue
    return out


def training_rank_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of training rank ``rank`` under the launcher ``launcher_pid``."""
    p = training_ranks(launcher_pid).get(rank)
    return p.pid if p is not None else None


def kill_rank_after(proc, run_dir: Path, after_steps: int, rank: int = 1) -> str:
    """SIGKILL training rank ``rank`` of the launcher ``proc`` once it has logged
    ``after_steps`` steps; the launcher's output once it has exited (non-zero)."""
    victim = None
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if len(steps(run_dir, rank)) >= after_steps:
            victim = training_rank_pid(proc.pid, rank)
            if victim is not None:
                os.kill(victim, signal.SIGKILL)
                break
        time.sleep(0.05)
    assert victim is not None, f"rank {rank} was not found running"
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    return out


def start_launch(config: Path, env: dict | None = None) -> subprocess.Popen:
    """moe-launch CONFIG --no-eval in a session of its own (a test may kill its ranks), its
    output captured."""
    return subprocess.Popen(
        [sys.executable, "-m", "launch.launch", str(config), "--no-eval"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=env,
    )


def finish(proc: subprocess.Popen) -> str:
    """The output of a launch that must succeed."""
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    return out
