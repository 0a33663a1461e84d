"""moe-launch --scheduler slurm on two SLURM hosts built on this machine (network namespaces
joined by a veth pair, each with its own address and hostname): one rank per node, expert
parallelism 2. The job script takes the master address from the allocation (node1's NodeAddr)
and names the interface for gloo; the submitting host's own name is not reachable from node2."""

import time

import pytest

from tests.conftest import tiny_run_dict
from tests.helpers.slurm_cluster import two_node_cluster
from tests.integration.launch_checks import check_finished_run, moe_launch, write_config

pytestmark = [pytest.mark.integration, pytest.mark.slurm]


def test_slurm_two_nodes_one_rank_each_ep2(tiny_data, tmp_path):
    run = tiny_run_dict(tiny_data, tmp_path / "runs")
    run["launch"] = {
        "scheduler": "slurm",
        "slurm": {"nodes": 2, "cpus_per_task": 1, "socket_ifname": "eth1"},
    }
    config = write_config(tmp_path / "tiny.yaml", run)
    run_dir = tmp_path / "runs" / "tiny"
    with two_node_cluster(tmp_path / "cluster", ifname="eth1") as cluster:
        t0 = time.time()
        proc = moe_launch([str(config)], env=cluster.env, prefix=cluster.client_prefix)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        job_id = proc.stdout.split("submitted SLURM job ")[1].split()[0]
        state = cluster.wait_job(job_id, 400)
        seconds = time.time() - t0
        out = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
        assert state == "COMPLETED", cluster.logs() + out[-4000:]
        assert cluster.job_field(job_id, "NodeList") == "node[1-2]"
    addr = cluster.conf.read_text().split("NodeAddr=")[1].split()[0]
    assert f"master {addr}:" in out
    check_finished_run(run_dir, max_steps=4)
    print(f"\ntwo-node SLURM job (submit to finish): {seconds:.1f}s")
