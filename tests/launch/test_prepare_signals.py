"""SIGTERM and Ctrl-C to moe-prepare while its worker pool runs, to the main process or to the
whole process group (timeout, kill -- -PGID, scancel; a terminal's Ctrl-C): the pool is stopped
and the staging removed on the way out, one line and 143 (130), no worker traceback, no hang,
nothing written (docs/launching.md: the same for moe-launch before the ranks start)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import write_corpus

ROOT = Path(__file__).resolve().parents[2]

# The main process signals itself when the first encoded work item comes back from the pool:
# the workers are alive and busy, as when a user stops a long preparation.
SCRIPT = """
import os, signal, sys
from data_pipeline import workers
from launch.prepare import main

# As in a terminal: a test runner's worker may hand its children SIGINT ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)

load, sent = workers.load_spill, []
def load_spill(*args):
    if not sent:  # to this process, or to its whole group as timeout and scancel do
        sig = getattr(signal, sys.argv[1].removesuffix("-group"))
        kill = os.killpg if sys.argv[1].endswith("-group") else os.kill
        sent.append(kill(os.getpgid(0) if kill is os.killpg else os.getpid(), sig))
    return load(*args)

workers.load_spill = load_spill
main(sys.argv[2:])
"""


@pytest.mark.parametrize(
    "sig,code,line",
    [
        ("SIGTERM", 143, "stopped by SIGTERM"),
        ("SIGINT", 130, "interrupted (Ctrl-C)"),
        ("SIGTERM-group", 143, "stopped by SIGTERM"),
        ("SIGINT-group", 130, "interrupted (Ctrl-C)"),
    ],
)
def test_a_signal_during_the_pool_stops_it_without_a_trace(tmp_path, sig, code, line):
    write_corpus(tmp_path / "corpus")
    config = tmp_path / "c.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "name": "x",
                "output_dir": str(tmp_path / "runs"),
                "data": {
                    "dir": str(tmp_path / "data"),
                    "sources": [
                        {"name": "docs", "type": "text", "paths": [str(tmp_path / "corpus")]}
                    ],
                    "tokenizer": {"vocab_size": 512},
                    "prepare_workers": 2,
                },
            }
        )
    )
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, sig, str(config), "--quiet"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,  # a process group of its own, for the group's signal
    )
    assert proc.returncode == code, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == f"moe-prepare: {line}", proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "leaked" not in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "data").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name != "corpus"] == ["c.yaml"]


def test_the_pool_leaves_the_callers_sigint_handler_as_it_was():
    """Workers start with SIGINT ignored; the process that makes the pool (a test runner's
    worker, whose later children would inherit an ignored SIGINT) keeps its own handler."""
    import signal

    from data_pipeline.config import S3Config
    from data_pipeline.workers import init_worker, worker_pool

    before = signal.getsignal(signal.SIGINT)
    init_worker(None)  # what a worker runs first: no signal disposition of its own
    assert signal.getsignal(signal.SIGINT) is before
    with worker_pool(1, None, S3Config()) as pool:
        assert signal.getsignal(signal.SIGINT) is before
        assert pool.apply(signal.getsignal, (signal.SIGINT,)) == signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) is before
