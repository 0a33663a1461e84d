"""moe-scaling end to end: a tiny sweep (2 budgets x 3 sizes, dense) planned, run through the
real launcher, stopped mid-sweep, resumed, fitted and used for a prediction."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from moe.config.run import load_config
from moe.tools.scaling import WIDTHS
from tests.conftest import tiny_run_dict

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def scaling_cmd(*args, check=True, timeout=900):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "launch.scaling", *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def test_a_tiny_sweep_is_planned_run_stopped_resumed_fitted_and_predicted(tiny_data, tmp_path):
    d = tiny_run_dict(tiny_data, tmp_path / "unused", max_steps=1)
    d["parallel"] = {"world_size": 1, "expert_parallel_size": 1, "zero_stage": 2}
    d["logging"] = {"log_every": 10, "tensorboard": False}
    d["checkpoint"] = {"every_n_steps": 20}
    d["eval"] = {"max_tokens": 2048}
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(d))
    sweep = tmp_path / "sweep"

    # A budget too small for the largest width is refused with the numbers, writing nothing.
    out = scaling_cmd(
        "plan",
        base,
        "--budgets",
        "1e8",
        "--families",
        "dense",
        "--widths",
        "64,96,128",
        "--out",
        sweep,
        check=False,
    )
    assert out.returncode == 2 and "at least 25 steps" in out.stderr and not sweep.exists()

    # --min-steps 25: the default (200) halves these runs' batch of 2 sequences, doubling
    # their steps; the mechanics tested here do not need them.
    scaling_cmd(
        "plan",
        base,
        "--budgets",
        "3e9,6e9",
        "--families",
        "dense",
        "--widths",
        "64,96,128",
        "--out",
        sweep,
        "--allow-repeat",
        "--min-steps",
        "25",
    )
    plan = json.loads((sweep / "sweep.json").read_text())
    assert len(plan["runs"]) == 6
    assert all(abs(r["flops"] / r["budget"] - 1) <= 0.02 for r in plan["runs"])
    out = scaling_cmd("fit", sweep, check=False)
    assert out.returncode == 2 and "no finished run" in out.stderr

    # Run, and stop the sweep with TERM once the first run has finished.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.scaling", "run", str(sweep), "--jobs", "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 600

    def evaluated():  # runs whose final checkpoint was evaluated: finished
        return {p.parents[3].name for p in (sweep / "runs").glob("*/checkpoints/*/eval/eval.json")}

    while not evaluated() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    text = proc.communicate(timeout=300)[0]
    finished_first = evaluated()
    assert proc.returncode == 2 and "stopped by signal" in text, text[-3000:]
    assert 1 <= len(finished_first) < 6
    first_logs = {n: (sweep / "logs" / f"{n}.log").stat().st_size for n in finished_first}

    scaling_cmd("run", sweep, "--jobs", "2")
    assert len(evaluated()) == 6
    for name, size in first_logs.items():  # finished runs were not started again
        assert (sweep / "logs" / f"{name}.log").stat().st_size == size

    out = scaling_cmd("fit", sweep, "--bootstrap", "5")
    assert "dense: 6 runs, 2 budgets with a parabola" in out.stdout and "L = " in out.stdout
    # 6 runs of 2 budgets are too few for the law's 5 constants: said, with what to add
    assert "it needs 3 or more budgets" in out.stdout and "bootstrap dense" in out.stderr
    assert (sweep / "report" / "report.md").is_file()
    assert (sweep / "report" / "scaling.png").stat().st_size > 10_000

    cfg_path = tmp_path / "next.yaml"
    # The tiny corpus would be read more than once (the sweep itself needed --allow-repeat):
    # refused with the numbers, nothing written. The run is the law's pick, so the budget is
    # far enough beyond the sweep (17x) that its run reads the corpus about 3 times; at 2x the
    # pick read it 0.7 to a bit over 1 times depending on the fit.
    out = scaling_cmd(
        "predict",
        sweep,
        "--budget",
        "1e11",
        "--family",
        "dense",
        "--bootstrap",
        "5",
        "--write-config",
        cfg_path,
        check=False,
    )
    assert out.returncode == 2 and "epochs of the prepared corpus" in out.stderr, out.stderr
    assert not cfg_path.exists()
    out = scaling_cmd(
        "predict",
        sweep,
        "--budget",
        "1e11",
        "--family",
        "dense",
        "--bootstrap",
        "5",
        "--write-config",
        cfg_path,
        "--allow-repeat",
    )
    assert "active parameters N" in out.stdout and "95%" in out.stdout
    assert float(re.search(r"tokens \(([\d.]+) epochs\)", out.stdout)[1]) > 1
    assert (
        "the run of the best ladder shape: width" in out.stdout and "predicted loss" in out.stdout
    )
    cfg = load_config(cfg_path)
    assert cfg.model.d_model in WIDTHS and cfg.model.ffn == "dense"
