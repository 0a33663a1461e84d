"""The reader's state through real checkpoints: a run resumed with another micro-batch size
continues the global sample cursor exactly (the order itself is checked in
tests/data_pipeline/test_reader.py)."""

import subprocess
import sys

import pytest
import torch
import yaml

from tests.conftest import tiny_run_dict

pytestmark = pytest.mark.integration


def launch(config, *overrides):
    proc = subprocess.run([sys.executable, "-m", "launch.launch", str(config), *overrides,
                           "--no-eval"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def data_state(run_dir, step):
    path = run_dir / "checkpoints" / f"step_{step:07d}" / "mp_rank_00_model_states.pt"
    return torch.load(path, map_location="cpu", weights_only=True)["data"]


def test_resume_with_another_micro_batch_continues_the_cursor(tiny_data, tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_run_dict(tiny_data, tmp_path / "runs", max_steps=2)))
    run_dir = tmp_path / "runs" / "tiny"
    launch(config)
    first = data_state(run_dir, 2)
    assert first["consumed_samples"] == 2 * 2 * 2  # steps x ranks x micro-batch
    proc = launch(config, "train.max_steps=3", "train.micro_batch_size=1")
    assert "resumed from" in proc.stdout + proc.stderr
    second = data_state(run_dir, 3)
    assert second["consumed_samples"] == 8 + 1 * 2 * 1
    assert second["fingerprint"] == first["fingerprint"]
    assert second["sources"]["docs"]["samples"] == 10
