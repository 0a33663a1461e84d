"""What moe-launch does with its own signals (launch/interrupts.py), without ranks: which signal
starts a save, which one stops at once, and when a process is ready to be sent the save signal.
The real launch is tested in tests/integration/test_launcher_signals.py."""

import signal
import subprocess
import sys
import time

import psutil
import pytest

from launch.interrupts import LauncherSignals, catches, stop_session
from launch.launch import run_to_end
from launch.run_plan import Plan
from moe.errors import LaunchError
from moe.run_dir import RunDir
from moe.training.resilience.preemption import PREEMPTED_EXIT_CODE


def test_the_first_signal_saves_a_second_stopping_one_stops_at_once():
    with LauncherSignals(signal.SIGUSR1) as s:
        signal.raise_signal(signal.SIGUSR1)
        assert (s.received, s.forced) == (signal.SIGUSR1, None)
        signal.raise_signal(signal.SIGUSR1)  # asking again to save changes nothing
        assert s.forced is None
        signal.raise_signal(signal.SIGINT)  # Ctrl-C: no KeyboardInterrupt, a stop
        assert (s.received, s.forced, s.name) == (signal.SIGUSR1, signal.SIGINT, "SIGINT")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back


def test_an_ignored_signal_stays_ignored():
    """Under nohup, a hang-up must not stop the run."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with LauncherSignals(signal.SIGUSR1) as s:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            signal.raise_signal(signal.SIGHUP)
            assert s.received is None
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_without_a_save_signal_the_first_signal_stops():
    with LauncherSignals(None) as s:
        signal.raise_signal(signal.SIGTERM)
        assert s.forced == signal.SIGTERM


def test_a_process_is_sent_the_save_signal_only_once_it_handles_it():
    child = subprocess.Popen([sys.executable, "-c",
                              "import signal, sys, time; sys.stdin.readline(); "
                              "signal.signal(signal.SIGUSR1, lambda *a: None); time.sleep(60)"],
                             stdin=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)
        assert not catches(child.pid, signal.SIGUSR1)  # still starting: USR1 would kill it
        child.stdin.write("\n")
        child.stdin.flush()
        deadline = time.time() + 30
        while not catches(child.pid, signal.SIGUSR1):
            assert time.time() < deadline
            time.sleep(0.05)
        assert not catches(child.pid, signal.SIGUSR2)
    finally:
        child.kill()
        child.wait()


def test_stopping_a_session_kills_what_ignores_sigterm_and_keeps_the_exit_status():
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)']); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.monotonic() + 60  # a loaded machine starts Python slowly
    while not (grandchildren := psutil.Process(proc.pid).children(recursive=True)):
        assert time.monotonic() < deadline, "the grandchild never started"
        time.sleep(0.1)
    time.sleep(0.5)  # past its signal.signal() call, so that it ignores SIGTERM
    assert len(grandchildren) == 1
    t0 = time.monotonic()
    stop_session(proc)
    assert proc.returncode == -signal.SIGKILL  # not 0: it was reaped here, not by psutil
    assert time.monotonic() - t0 < 15
    for p in grandchildren:  # killed too (a zombie until its new parent reaps it)
        try:
            assert p.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            pass


def _run(tmp_path, code: str, *args):
    """run_to_end with "ranks" that are one small process running ``code``."""
    plan = Plan(scheduler="local", command=[sys.executable, "-c", code, *map(str, args)],
                run_dir=str(tmp_path), world_size=1)
    run_to_end(plan, tmp_path, evaluate=False, max_restarts=0)


def test_a_preemption_ends_moe_launch_with_75_and_a_failure_with_an_error(tmp_path, capsys):
    saved = ("import json, sys; open(sys.argv[1], 'w').write(json.dumps({'step': 3, "
             "'signal': 'SIGUSR1'})); sys.exit(75)")
    with pytest.raises(SystemExit) as e:
        _run(tmp_path, saved, RunDir(tmp_path).preempted)
    assert e.value.code == PREEMPTED_EXIT_CODE
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one message
    assert ("launch: preempted (exit code 75, not a failure): training stopped on a preemption "
            "signal and saved a checkpoint at step 3") in err
    with pytest.raises(LaunchError, match="training failed: a rank"):  # moe-launch: exit 2
        _run(tmp_path, "import sys; sys.exit(1)")
