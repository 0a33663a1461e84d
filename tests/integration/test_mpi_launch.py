"""moe-launch --scheduler mpi: mpiexec -n 2 (MPICH from PyPI) trains the tiny config with
expert parallelism 2 to completion; ranks come from the MPI launcher's environment."""

import shutil
import time

import pytest

from tests.conftest import tiny_run_dict
from tests.helpers import fault_runs as fr
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


def test_a_rank_killed_under_mpiexec_is_named_and_the_run_resumes(tiny_data, tmp_path):
    """mpiexec reports one exit code for the job: the rank wrapper each MPI rank runs
    (launch/rank.py) records how its training process ended, so moe-launch's restart line names
    the rank a SIGKILL ended, and the step, and the run resumes from its checkpoint to the end."""
    if shutil.which("mpiexec") is None:
        pytest.skip("mpiexec not installed (pip install mpich)")
    run = tiny_run_dict(tiny_data, tmp_path / "runs", max_steps=6)
    run["launch"] = {"max_restarts": 1}
    config = write_config(tmp_path / "tiny.yaml", run)
    kill = {"id": 0, "kind": "kill", "rank": 1, "step": 3, "phase": "backward"}
    plan = {"fired_dir": str(tmp_path / "fired"), "faults": [kill]}
    proc = fr.launch(config, ["--scheduler", "mpi"], plan=plan)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    run_dir = tmp_path / "runs" / "tiny"
    resumed = run_dir / "checkpoints" / "step_0000002"
    assert (
        f"launch: restart 1/1: rank 1 exited with signal SIGKILL at step 3; resuming from {resumed}"
    ) in out, out[-4000:]
    assert [(r["rank"], r["signal"], r["step"]) for r in fr.restarts(run_dir)] == [
        (1, "SIGKILL", 3)
    ]
    check_finished_run(run_dir, max_steps=6)
