"""moe-launch --scheduler hostfile for real, through DeepSpeed's runner: a one-host hostfile
with a spare slot left out by --include, 2 ranks, expert parallelism 2. (Several hosts need
passwordless ssh and pdsh; the plan for them is checked in tests/launch/test_plans.py.)"""

import pytest

from moe.training.ports import free_port
from tests.conftest import tiny_run_dict
from tests.integration.launch_checks import check_finished_run, moe_launch, write_config

pytestmark = pytest.mark.integration


def test_hostfile_runner_trains_two_ranks_ep2(tiny_data, tmp_path):
    hosts = tmp_path / "hostfile"
    hosts.write_text("# this machine; slot 2 is not used\nlocalhost slots=3\n")
    run = tiny_run_dict(tiny_data, tmp_path / "runs")
    run["launch"] = {
        "scheduler": "hostfile",
        "env": {"MOE_TEST_VALUE": "a b"},
        "hostfile": {
            "path": str(hosts),
            "include": "localhost:0,1",
            "master_addr": "127.0.0.1",
            "master_port": free_port(),  # not the default 29500: other launches may run beside
            "ssh_check": False,
        },
    }
    config = write_config(tmp_path / "tiny.yaml", run)
    proc = moe_launch([str(config), "--no-eval"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "tiny"
    assert (run_dir / ".deepspeed_env").read_text() == "PYTHONUNBUFFERED=1\nMOE_TEST_VALUE=a b\n"
    check_finished_run(run_dir, max_steps=4)
