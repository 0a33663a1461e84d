"""What the SLURM supervisor does before any rank starts (launch/slurm/allocation.py): the op
build's children survive the job's stop signals, and a build lock a dead build left is found and
removed, one a live build holds is not."""

import os
import subprocess
import time

from launch.slurm.allocation import (
    STALE_LOCK_S,
    build_lock_problems,
    clear_stale_build_locks,
    ignore_stop_signals,
)


def test_the_build_and_the_programs_it_starts_outlive_the_jobs_stop_signals():
    """What a signal to the whole step does to a compiler: nothing (an ignored signal stays
    ignored across exec)."""
    proc = subprocess.run(["sh", "-c", "kill -USR1 $$; kill -USR2 $$; kill -TERM $$; echo alive"],
                          capture_output=True, text=True, timeout=30,
                          preexec_fn=ignore_stop_signals)
    assert (proc.returncode, proc.stdout) == (0, "alive\n")
    unprotected = subprocess.run(["sh", "-c", "kill -USR1 $$; echo alive"], capture_output=True,
                                 text=True, timeout=30)
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
