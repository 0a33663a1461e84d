"""What moe-launch does with its own signals (launch/interrupts.py), without ranks: which signal
starts a save, which one stops at once, and when a process is ready to be sent the save signal.
The real launch is tested in tests/integration/test_launcher_signals.py."""

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from launch.interrupts import LauncherSignals, catches, stop_session
from launch.launch import run_to_end
from launch.restarts import Attempt, run_attempt
from launch.run_plan import Plan
from moe.core.errors import LaunchError
from moe.core.run_dir import RunDir
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
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, sys, time; sys.stdin.readline(); "
            "signal.signal(signal.SIGUSR1, lambda *a: None); time.sleep(60)",
        ],
        stdin=subprocess.PIPE,
        text=True,
    )
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
    code = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)']); time.sleep(60)"
    )
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
    plan = Plan(
        scheduler="local",
        command=[sys.executable, "-c", code, *map(str, args)],
        run_dir=str(tmp_path),
        world_size=1,
    )
    run_to_end(plan, tmp_path, evaluate=False, max_restarts=0)


def test_a_preemption_ends_moe_launch_with_75_and_a_failure_with_an_error(tmp_path, capsys):
    saved = (
        "import json, sys; open(sys.argv[1], 'w').write(json.dumps({'step': 3, "
        "'signal': 'SIGUSR1'})); sys.exit(75)"
    )
    with pytest.raises(SystemExit) as e:
        _run(tmp_path, saved, RunDir(tmp_path).preempted)
    assert e.value.code == PREEMPTED_EXIT_CODE
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one message
    assert (
        "launch: preempted (exit code 75, not a failure): training stopped on a preemption "
        "signal and saved a checkpoint at step 3"
    ) in err
    with pytest.raises(LaunchError, match="training failed: a rank"):  # moe-launch: exit 2
        _run(tmp_path, "import sys; sys.exit(1)")


# A "launcher" whose one "rank" (its command line holds launch.train, as a real rank's does)
# records each USR1 and TERM it gets, with the time; TERM ends it, as it ends a rank.
RANK = (
    "import os, signal, sys, time\n"
    "def got(n, f):\n"
    "    with open(sys.argv[1], 'a') as out: out.write(f'{n} {time.time()}\\n')\n"
    "    if n == signal.SIGTERM: os._exit(143)\n"
    "signal.signal(signal.SIGUSR1, got)\n"
    "signal.signal(signal.SIGTERM, got)\n"
    "time.sleep(120)\n"
)
LAUNCHER = (
    "import subprocess, sys; "
    "subprocess.run([sys.executable, '-c', sys.argv[1], sys.argv[2], 'launch.train'])"
)


def test_two_ctrl_c_0_3_s_apart_each_act_at_once(tmp_path, capsys):
    """The first Ctrl-C is announced and passed on to the ranks the moment it arrives, not at
    the supervisor's next poll; the second, 0.3 s later, stops them at once. The signals are
    sent from another thread: the kernel may give a process's signal to any of its threads,
    and the supervisor must wake up all the same. Three times over: with a poll every 0.5 s,
    the first reaches the rank within 0.15 s in three cases in ten."""
    for i in range(3):
        got = tmp_path / f"signals_{i}.txt"
        sent: dict[int, float] = {}

        def interrupt(sent=sent):
            deadline = time.monotonic() + 60
            while not (
                ranks := [
                    p
                    for p in psutil.Process().children(recursive=True)
                    if "launch.train" in p.cmdline()
                ]
            ) or not catches(ranks[0].pid, signal.SIGTERM):
                assert time.monotonic() < deadline
                time.sleep(0.02)
            sent[signal.SIGUSR1] = time.time()
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.3)
            sent[signal.SIGTERM] = time.time()
            os.kill(os.getpid(), signal.SIGINT)

        sender = threading.Thread(target=interrupt)
        with LauncherSignals(signal.SIGUSR1) as signals:
            sender.start()
            rc = run_attempt(
                [sys.executable, "-c", LAUNCHER, RANK, str(got)],
                None,
                Attempt(tmp_path, 1),
                signals,
            )
            sender.join()
        out = capsys.readouterr().out
        assert signals.forced == signal.SIGINT and rc != 0
        notice = "launch: SIGINT: every rank saves at the end of its step and stops"
        assert out.count(notice) == 1, out
        assert out.index(notice) < out.index(
            "launch: SIGINT, a second signal: stopping every rank now, without waiting for the save"
        ), out
        # The rank had the save signal (the first Ctrl-C) and SIGTERM (the second) each within
        # 0.15 s of the Ctrl-C: at once, not at the supervisor's next poll.
        received = [line.split() for line in got.read_text().splitlines()]
        assert [int(n) for n, _ in received] == [signal.SIGUSR1, signal.SIGTERM], received
        for n, t in received:
            assert float(t) - sent[int(n)] < 0.15, (received, sent)
