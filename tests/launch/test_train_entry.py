"""moe-train's entry point: after DeepSpeed's start-up every rank removes its shared-memory file
name (after a barrier); it tears the process group down on every rank before the interpreter
exits, after a finished and after a preempted run, and leaves it alone after an error."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
import yaml

import launch.train as train_entry
from moe.core.errors import MoEError
from moe.core.run_dir import RunDir
from moe.training.ports import free_port
from moe.training.resilience.preemption import PREEMPTED_EXIT_CODE, Preempted
from tests.conftest import tiny_run_dict


@pytest.fixture
def calls(monkeypatch, tiny_config_file):
    """Run ``main`` with the distributed calls and ``train`` replaced by recorders."""
    seen: list[str] = []
    import deepspeed

    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: seen.append("init"))
    monkeypatch.setattr(dist, "is_initialized", lambda: "init" in seen and "destroy" not in seen)
    monkeypatch.setattr(dist, "barrier", lambda *a, **kw: seen.append("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **kw: seen.append("destroy"))
    # main's process-wide settings stay out of this test process
    monkeypatch.setattr(train_entry, "setup_logging", lambda *a, **kw: None)
    monkeypatch.setattr(train_entry, "keep_freed_memory", lambda: True)
    monkeypatch.setattr(train_entry.torch, "set_num_threads", lambda n: None)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)

    def run(outcome):
        def fake_train(cfg, env, resume, faults):
            assert faults is None  # no test-only fault plan in the environment
            seen.append("train")
            if outcome is not None:
                raise outcome

        monkeypatch.setattr(train_entry, "train", fake_train)
        return train_entry.main(["--config", str(tiny_config_file)])

    return seen, run


def test_finished_run_destroys_the_process_group(calls):
    seen, run = calls
    run(None)
    assert seen == ["init", "barrier", "train", "barrier", "destroy"]


def test_preempted_run_destroys_the_group_and_keeps_its_exit_code(calls):
    seen, run = calls
    with pytest.raises(SystemExit) as info:
        run(Preempted(3))
    assert info.value.code == PREEMPTED_EXIT_CODE
    assert seen == ["init", "barrier", "train", "barrier", "destroy"]


@pytest.mark.parametrize("error", [MoEError("bad shard"), RuntimeError("boom")])
def test_failed_run_leaves_the_group_alone(calls, error):
    seen, run = calls
    with pytest.raises((SystemExit, RuntimeError)):
        run(error)
    assert seen == ["init", "barrier", "train"]


def test_a_failure_after_a_preemption_signal_exits_as_preempted(
    calls, monkeypatch, tiny_config_file
):
    """SLURM's stop signal reaches every process of the step: a child the rank runs at that
    moment (DeepSpeed's ``ninja --version`` while it loads an op) dies, and the rank, which held
    the signal, fails with the child's error. That is the stop, not a failure to restart."""
    from moe.training.resilience import preemption

    monkeypatch.setattr(preemption, "_RECEIVED", [signal.SIGUSR1])
    seen, run = calls
    with pytest.raises(SystemExit) as info:
        run(RuntimeError("Ninja is required to load C++ extensions"))
    assert info.value.code == PREEMPTED_EXIT_CODE
    marker = RunDir(tiny_config_file.parent / "runs" / "tiny").preempted
    assert json.loads(marker.read_text()) == {"step": None, "signal": "SIGUSR1"}
    assert not list(marker.parent.glob(f".{marker.name}.*"))  # written whole, no temp left


def test_a_failure_after_a_signal_keeps_a_marker_the_ranks_already_left(
    calls, monkeypatch, tiny_config_file
):
    from moe.training.resilience import preemption

    monkeypatch.setattr(preemption, "_RECEIVED", [signal.SIGTERM])
    marker = RunDir(tiny_config_file.parent / "runs" / "tiny").preempted
    marker.parent.mkdir(parents=True)
    marker.write_text(json.dumps({"step": 2, "signal": "SIGUSR1"}))
    seen, run = calls
    with pytest.raises(SystemExit) as info:
        run(RuntimeError("a reader process died"))
    assert info.value.code == PREEMPTED_EXIT_CODE
    assert json.loads(marker.read_text())["step"] == 2


def test_a_failure_no_restart_can_fix_stays_a_failure_after_a_signal(
    calls, monkeypatch, tiny_config_file
):
    from moe.core.errors import ConfigError
    from moe.training.resilience import preemption

    monkeypatch.setattr(preemption, "_RECEIVED", [signal.SIGUSR1])
    seen, run = calls
    with pytest.raises(SystemExit) as info:
        run(ConfigError("model.d_model: must be positive"))
    assert info.value.code == 2
    assert not (RunDir(tiny_config_file.parent / "runs" / "tiny").preempted).exists()


def test_a_failure_without_a_signal_is_a_failure(calls, monkeypatch, tiny_config_file):
    from moe.training.resilience import preemption

    monkeypatch.setattr(preemption, "_RECEIVED", [])
    seen, run = calls
    with pytest.raises(RuntimeError, match="Ninja"):
        run(RuntimeError("Ninja is required to load C++ extensions"))
    assert not (RunDir(tiny_config_file.parent / "runs" / "tiny").preempted).exists()


def test_every_caught_preemption_signal_is_remembered(monkeypatch):
    from moe.training.resilience import preemption

    monkeypatch.setattr(preemption, "_RECEIVED", [])
    assert preemption.received_signal() is None
    held = preemption.HeldSignal()
    held._on_signal(signal.SIGUSR1, None)
    assert held.take() == signal.SIGUSR1
    assert preemption.received_signal() == signal.SIGUSR1  # taken by a guard, still remembered


@pytest.mark.parametrize("when", ["during imports", "during start-up"])
def test_a_signal_before_the_first_step_exits_75_without_a_checkpoint(tiny_data, tmp_path, when):
    """A real one-rank moe-train process: SIGUSR1 while Python imports torch, or once logging
    started (DeepSpeed, engine, data start-up), ends it with the preempted exit code and the
    marker, not with the default action (death by signal, a FAILED job)."""
    run = tiny_run_dict(tiny_data, tmp_path / "runs", max_steps=50)
    run["parallel"] = {"world_size": 1, "expert_parallel_size": 1, "zero_stage": 2}
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(run))
    run_dir = tmp_path / "runs" / "tiny"
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.train", "--config", str(config)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    rank0 = run_dir / "logs" / "rank0.log"
    if when == "during imports":
        time.sleep(0.3)
    else:
        deadline = time.time() + 120
        while not (rank0.exists() and "device:" in rank0.read_text()):
            assert time.time() < deadline and proc.poll() is None, proc.communicate()[0]
            time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == PREEMPTED_EXIT_CODE, out[-3000:]
    assert json.loads(RunDir(run_dir).preempted.read_text()) == {"step": None, "signal": "SIGUSR1"}
    assert "SIGUSR1 before the first step: nothing to save" in rank0.read_text()
    assert not list((run_dir / "checkpoints").glob("step_*"))
