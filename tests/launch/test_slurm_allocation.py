"""What the SLURM supervisor does before any rank starts (launch/slurm/allocation.py): the op
build's children survive the job's stop signals, and a build lock a dead build left is found and
removed, one a live build holds is not."""

import os
import subprocess
import time

from launch.slurm import allocation
from launch.slurm.allocation import (
    OP_NAME,
    STALE_LOCK_S,
    build_lock_problems,
    build_ops,
    clear_stale_build_locks,
    ignore_stop_signals,
)


def test_the_build_and_the_programs_it_starts_outlive_the_jobs_stop_signals():
    """What a signal to the whole step does to a compiler: nothing (an ignored signal stays
    ignored across exec)."""
    proc = subprocess.run(
        ["sh", "-c", "kill -USR1 $$; kill -USR2 $$; kill -TERM $$; echo alive"],
        capture_output=True,
        text=True,
        timeout=30,
        preexec_fn=ignore_stop_signals,
    )
    assert (proc.returncode, proc.stdout) == (0, "alive\n")
    unprotected = subprocess.run(
        ["sh", "-c", "kill -USR1 $$; echo alive"], capture_output=True, text=True, timeout=30
    )
    assert unprotected.returncode != 0 and unprotected.stdout == ""


def lock(root, name: str, age_s: float):
    path = root / "py311_cpu" / name / "lock"
    path.parent.mkdir(parents=True)
    path.write_text("")
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_only_an_old_lock_with_no_build_running_is_stale_and_cleared(tmp_path, capsys):
    dead = lock(tmp_path, "dead_op", STALE_LOCK_S + 60)
    fresh = lock(tmp_path, "fresh_op", 5)
    live = lock(tmp_path, "live_op", STALE_LOCK_S + 60)
    # A build under way there: a compiler runs in the op's directory.
    builder = subprocess.Popen(["sleep", "60"], cwd=live.parent)
    try:
        assert build_lock_problems(tmp_path) == [dead]
        assert clear_stale_build_locks(tmp_path) == [dead]
    finally:
        builder.kill()
        builder.wait()
    assert not dead.exists() and fresh.exists() and live.exists()
    out = capsys.readouterr().out
    assert f"removing a stale torch-extensions build lock {dead}" in out
    assert clear_stale_build_locks(tmp_path / "missing") == []


def test_the_lock_is_looked_for_where_the_ranks_build_launch_env_s_directory(
    tmp_path, monkeypatch, capsys
):
    """``launch.env: {TORCH_EXTENSIONS_DIR: ...}`` reaches the ranks, not the supervisor's own
    environment: a stale lock there is named and removed, and the op built there is found,
    so nothing is built; a young lock with no build on this node is named, not removed."""
    own, ranks = tmp_path / "own", tmp_path / "ranks"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(own))
    op = ranks / OP_NAME
    op.mkdir(parents=True)
    (op / f"{OP_NAME}.so").write_bytes(b"")
    stale = op / "lock"
    stale.write_text("")
    then = time.time() - STALE_LOCK_S - 60
    os.utime(stale, (then, then))
    young = ranks / "other_op" / "lock"
    young.parent.mkdir()
    young.write_text("")
    builds = []
    monkeypatch.setattr(allocation.subprocess, "Popen", lambda *a, **k: builds.append(a))
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ranks)}
    assert build_ops(env) == 0
    assert builds == [] and not stale.exists() and young.exists()
    out = capsys.readouterr().out
    assert f"removing a stale torch-extensions build lock {stale}" in out, out
    assert (
        f"a torch-extensions build lock {young} (0 s old) has no build running on this "
        f"node: the ranks wait until it is gone"
    ) in out, out
