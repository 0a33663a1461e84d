"""moe-launch --scheduler mpi: mpiexec -n 2 (MPICH from PyPI) trains the tiny config with
expert parallelism 2 to completion; ranks come from the MPI launcher's environment."""

import shutil
import time

import pytest

from tests.conftest import tiny_run_dict
from tests.integration.launch_checks import check_finished_run, moe_launch, write_config

pytestmark = pytest.mark.integration


def test_mpiexec_two_ranks_ep2_to_completion(tiny_data, tmp_path):
    if shutil.which("mpiexec") is None:
        pytest.skip("mpiexec not installed (pip install mpich)")
    run = tiny_run_dict(tiny_data, tmp_path / "runs")
    config = write_config(tmp_path / "tiny.yaml", run)
    t0 = time.time()
    proc = moe_launch([str(config), "--scheduler", "mpi", "--no-eval"])
    seconds = time.time() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "mpiexec -n 2 -genv MASTER_ADDR 127.0.0.1" in proc.stdout
    assert "terminate called" not in proc.stderr  # no rank aborted at interpreter exit
    check_finished_run(tmp_path / "runs" / "tiny", max_steps=4)
    print(f"\nMPI launch (mpiexec -n 2, 4 steps): {seconds:.1f}s")
