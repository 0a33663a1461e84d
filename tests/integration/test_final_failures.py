"""A failure no restart can fix, with the local launcher: a full checkpoint disk (a real
size-limited tmpfs) stops the run at once, though restarts were allowed, and moe-launch's last
line names the cause."""

import time

import pytest

from tests.conftest import tiny_run_dict
from tests.helpers import fault_runs as fr
from tests.moe.training.test_storage_faults import tmpfs

pytestmark = [pytest.mark.integration, pytest.mark.multiprocess]


def test_a_full_disk_is_not_restarted_and_the_last_line_names_it(tiny_data, tmp_path):
    run = tiny_run_dict(tiny_data, tmp_path / "runs", max_steps=4)
    run["checkpoint"] = {"every_n_steps": 2}
    run["logging"] = {"log_every": 1, "tensorboard": False}
    run["launch"] = {"max_restarts": 3}
    config = fr.write_run_config(tmp_path / "tiny.yaml", run)
    run_dir = tmp_path / "runs" / "tiny"
    with tmpfs(run_dir / "checkpoints", 64 * 1024):  # no room for the step-2 checkpoint
        t0 = time.time()
        proc = fr.launch(config)
        took = time.time() - t0
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "not restarted, a restart cannot fix this: storage on rank " in last, proc.stderr
    assert f"the checkpoint storage at {run_dir / 'checkpoints'} is full" in last
    assert "No space left on device" in last
    assert fr.restarts(run_dir) == [] and "launch: restart" not in proc.stdout
    for rank in (0, 1):  # each rank's own log holds the error that stopped it
        log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert "stopped by CheckpointSaveError: saving checkpoint" in log, log[-2000:]
    print(f"stopped after {took:.1f}s, one attempt")
