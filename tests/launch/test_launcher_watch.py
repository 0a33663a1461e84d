"""Ranks end with the moe-launch that started them (launch/launcher_watch.py), with small
processes standing in for moe-launch, its launcher and a rank. The real launch is tested in
tests/integration/test_launcher_signals.py."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from launch.launcher_watch import ENV, alive, end_with_launcher, identity, watched_pid
from launch.rank import STOP_WITHIN_S, end_child

ROOT = Path(__file__).resolve().parents[2]

# Stands in for moe-launch: names itself to its child (ENV), starts it in a session of its own
# (as moe-launch starts the launcher) and prints its pid. The child runs ``CHILD`` with
# ``preexec``: "watch" (a rank) or "pdeathsig" (the launcher).
MOE_LAUNCH = """
import os, subprocess, sys, time
from launch.launcher_watch import ENV, die_with_parent, identity
how, child_code = sys.argv[1], sys.argv[2]
child = subprocess.Popen([sys.executable, "-c", child_code, *sys.argv[3:]],
                         env={**os.environ, ENV: identity()}, start_new_session=True,
                         preexec_fn=die_with_parent() if how == "pdeathsig" else None)
print(child.pid, flush=True)
time.sleep(120)
"""
RANK = """
import os, sys, time
from launch.launcher_watch import end_with_launcher
def gone(pid):
    with open(sys.argv[1], "w") as f:
        f.write(str(pid))
    os._exit(9)
end_with_launcher(gone)
time.sleep(120)
"""
LAUNCHER = "import time; time.sleep(120)"


def killed_parent_takes(how: str, child_code: str, *args: str) -> tuple[int, float]:
    """Start the stand-in moe-launch, SIGKILL it once its child runs; (the moe-launch pid, the
    seconds its child took to end)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", MOE_LAUNCH, how, child_code, *args],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    child = psutil.Process(int(proc.stdout.readline()))
    try:
        time.sleep(0.5)  # past the child's start-up
        assert child.is_running()
        proc.kill()
        proc.wait()
        t0 = time.monotonic()
        child.wait(timeout=10)  # psutil: gone, or a zombie reaped by its new parent
        return proc.pid, time.monotonic() - t0
    finally:
        if child.is_running():
            child.kill()


def test_a_rank_stops_the_moment_moe_launch_is_killed(tmp_path):
    said = tmp_path / "gone.txt"
    pid, took = killed_parent_takes("watch", RANK, str(said))
    assert said.read_text() == str(pid)
    assert took < 5


def test_the_launcher_gets_its_parent_death_signal():
    _, took = killed_parent_takes("pdeathsig", LAUNCHER)
    assert took < 5


def test_a_launcher_already_gone_is_seen_at_once(tmp_path):
    dead = subprocess.Popen(["true"])
    value = identity(dead.pid)
    dead.wait()
    assert not alive(value)
    gone = []
    thread = end_with_launcher(gone.append, {ENV: value})
    thread.join(timeout=10)
    assert gone == [dead.pid]


def test_only_a_process_of_this_machine_and_pid_namespace_is_watched():
    me = identity()
    assert watched_pid(me) == os.getpid() and alive(me)
    machine, pid, ticks = me.rsplit(":", 2)
    # Another host (boot id), or another container on this one (pid namespace): a rank there
    # cannot see the launcher, and must not take its absence for its death.
    boot, pidns = machine.split("/", 1)
    assert watched_pid(f"another-boot-id/{pidns}:{pid}:{ticks}") is None
    assert watched_pid(f"{boot}/pid:[1]:{pid}:{ticks}") is None
    assert watched_pid(None) is None and watched_pid("garbage") is None
    assert end_with_launcher(lambda pid: None, {}) is None
    # The same pid started at another time is another process (a reused pid).
    assert not alive(f"{machine}:{pid}:{int(ticks) + 1}")


def test_the_rank_wrapper_waits_for_the_rank_to_stop_itself_then_kills_it():
    """The training process writes why to its log and stops itself; the wrapper kills it only
    if it has not within STOP_WITHIN_S (a rank stuck in C code)."""
    for code, killed in (
        ("import time; time.sleep(0.3)", False),
        ("import time; time.sleep(60)", True),
    ):
        child = subprocess.Popen([sys.executable, "-c", code])
        reaper = threading.Thread(target=child.wait)  # the wrapper's main thread
        reaper.start()
        t0 = time.monotonic()
        end_child(child)
        reaper.join(timeout=10)
        took = time.monotonic() - t0
        assert (child.returncode == -signal.SIGKILL) == killed, child.returncode
        assert took >= STOP_WITHIN_S if killed else took < STOP_WITHIN_S
