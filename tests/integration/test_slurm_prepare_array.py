"""moe-prepare --slurm-parts 2 against a real single-node SLURM cluster started by the test: the
tokenizer job, an array job of two parts and the merge job run in order and leave data byte for
byte equal to a one-machine preparation of the same config. The data directory is a hostile
string that must arrive literally."""

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import tiny_run_dict
from tests.helpers.slurm_cluster import single_node_cluster
from tests.integration.launch_checks import moe_launch, write_config

pytestmark = [pytest.mark.integration, pytest.mark.slurm]

HOSTILE = "d; rm -rf \"$HOME\" $(touch {s}) `touch {s}` 'q' #"


def digests(data_dir: Path) -> dict[str, str]:
    return {
        p.relative_to(data_dir).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(data_dir).rglob("*"))
        if p.is_file()
    }


def test_array_job_prepares_what_one_machine_prepares(tiny_data, tmp_path):
    sentinel = tmp_path / "SENTINEL"
    data_dir = tmp_path / f"data {HOSTILE.format(s=sentinel)}"
    run = tiny_run_dict(tiny_data, tmp_path / "runs")
    run["data"]["dir"] = str(data_dir)
    run["launch"] = {"slurm": {"time": "10:00"}}
    config = write_config(tmp_path / "run.yaml", run)
    root = str(Path(__file__).resolve().parents[2])

    with single_node_cluster(tmp_path / "cluster") as cluster:
        env = {
            **cluster.env,
            "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
        }
        t0 = time.time()
        proc = subprocess.run(
            [sys.executable, "-m", "launch.prepare", str(config), "--slurm-parts", "2"],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        ids = proc.stdout.split("submitted SLURM jobs: ")[1].splitlines()[0]
        tokenizer, parts, merge = (
            ids.split(f"{step} ")[1].split()[0].rstrip(",")
            for step in ("tokenizer", "parts", "merge")
        )
        state = cluster.wait_job(merge, 400)
        seconds = time.time() - t0
        job_dir = Path(str(data_dir) + ".slurm")
        logs = "\n".join(
            f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((job_dir / "logs").iterdir())
        )
        assert state == "COMPLETED", logs + cluster.logs()
        # Chained: each step started once the one before had ended (ISO times compare as text).
        for before, after in ((tokenizer, parts), (parts, merge)):
            assert cluster.job_field(before, "EndTime") <= cluster.job_field(after, "StartTime")
        # Each array task prepared its own part: one log per task, each naming its part.
        part_logs = sorted((job_dir / "logs").glob(f"part-{parts}_*.out"))
        assert [p.name for p in part_logs] == [f"part-{parts}_0.out", f"part-{parts}_1.out"]
        assert [f"part {i}/2: " in p.read_text() for i, p in enumerate(part_logs)] == [True, True]
        status = moe_launch(["status", str(job_dir)], env=cluster.env)
        assert (
            f"jobs of the run {tokenizer} (COMPLETED), {parts} (COMPLETED), {merge} (COMPLETED)"
        ) in status.stdout, status.stdout + status.stderr

    assert digests(data_dir) == digests(tiny_data.dir)  # every shard, tokenizer and manifest
    assert not Path(str(data_dir) + ".parts").exists()  # the merge removed the parts
    assert not sentinel.exists()
    print(f"\nSLURM array preparation (tokenizer, 2 parts, merge): {seconds:.1f}s")
