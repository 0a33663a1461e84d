"""Fixtures shared by the integration tests."""

from pathlib import Path

import pytest

from tests.conftest import tiny_run_dict
from tests.helpers.fault_runs import launch, write_run_config

REFERENCE_STEPS = 6


def reference_dict(tiny_data, out_dir: Path, name: str) -> dict:
    """The tiny config for REFERENCE_STEPS steps on 2 ranks (expert parallelism 2), a
    checkpoint every 2 steps, a step record every step, no TensorBoard. What the tests change
    from it (the data's location, restarts, elastic) leaves every step's loss as it is."""
    d = tiny_run_dict(tiny_data, out_dir, max_steps=REFERENCE_STEPS)
    d.update(
        name=name, checkpoint={"every_n_steps": 2}, logging={"log_every": 1, "tensorboard": False}
    )
    return d


@pytest.fixture(scope="session")
def reference_run(tiny_data, tmp_path_factory) -> Path:
    """The run directory of reference_dict's run, uninterrupted, launched once for the tests
    that compare a disturbed run with it (step records: loss and token hash per rank)."""
    root = tmp_path_factory.mktemp("reference")
    d = reference_dict(tiny_data, root / "runs", "reference")
    d["launch"] = {"max_restarts": 0}
    proc = launch(write_run_config(root / "reference.yaml", d))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root / "runs" / "reference"
