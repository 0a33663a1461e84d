"""Training from s3:// shards with the real launcher: two ranks share one node-local cache smaller
than the data, rank 1 is killed with SIGKILL, the same command resumes, and every step's loss
and token ids equal those of the same run read from local disk. The store is a real moto S3
server (tests/helpers/s3.py); the credentials reach the ranks only through the environment."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import yaml

from data_pipeline.shards import read_manifest
from tests.helpers import s3 as helper_s3
from tests.integration.conftest import REFERENCE_STEPS, reference_dict
from tests.integration.launch_checks import finish, kill_rank_after, start_launch, steps

pytestmark = pytest.mark.integration

MAX_STEPS = REFERENCE_STEPS


def write_config(tiny_data, tmp_path: Path, name: str, **data) -> Path:
    d = reference_dict(tiny_data, tmp_path / "runs", name)
    d["data"].update(data)
    d["checkpoint"]["keep_last"] = 2
    # The kill below must end the job so that the same command resumes it by hand (automatic
    # restarts are tested in test_fault_campaign.py).
    d["launch"] = {"max_restarts": 0}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


def test_two_ranks_from_s3_killed_and_resumed_match_the_local_run(
    tiny_data, tmp_path, reference_run
):
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))

    with helper_s3.moto_server(tmp_path / "empty", check_credentials=False) as (
        endpoint,
        key_id,
        secret,
    ):
        boto3 = pytest.importorskip("boto3")
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id=key_id,
            aws_secret_access_key=secret,
        )
        for path in sorted(p for p in Path(tiny_data.dir).rglob("*") if p.is_file()):
            client.put_object(
                Bucket=helper_s3.BUCKET,
                Key=f"tiny/{path.relative_to(tiny_data.dir).as_posix()}",
                Body=path.read_bytes(),
            )
        shards = [s for split in read_manifest(tiny_data.dir).splits.values() for s in split.shards]
        bound = 2 * max(s.bytes for s in shards)  # two shards of the four
        assert bound < sum(s.bytes for s in shards)
        cache = tmp_path / "cache"
        config = write_config(
            tiny_data,
            tmp_path,
            "s3",
            dir=f"s3://{helper_s3.BUCKET}/tiny",
            s3={"endpoint_url": endpoint, "region": "us-east-1"},
            cache_dir=str(cache),
            cache_bytes=bound,
        )
        assert secret not in config.read_text()
        s3_env = dict(
            env,
            AWS_ACCESS_KEY_ID=key_id,
            AWS_SECRET_ACCESS_KEY=secret,
            AWS_EC2_METADATA_DISABLED="true",
            AWS_CONFIG_FILE=str(tmp_path / "none"),
            AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
        )

        run_dir = tmp_path / "runs" / "s3"
        first = kill_rank_after(start_launch(config, s3_env), run_dir, 3)
        assert max(steps(run_dir, 1)) < MAX_STEPS
        second = finish(start_launch(config, s3_env))
        assert "resumed from" in second

    for rank in (0, 1):
        lines = (run_dir / "logs" / f"steps_rank{rank}.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == list(range(1, MAX_STEPS + 1))
        want, got = steps(reference_run, rank), steps(run_dir, rank)
        for step in range(1, MAX_STEPS + 1):
            assert got[step]["loss"] == want[step]["loss"], (rank, step)
            assert got[step]["tokens_sha256"] == want[step]["tokens_sha256"], (rank, step)
    # The shared cache ends within its bound, holding only whole, verified shards.
    names = os.listdir(cache)
    files = [n for n in names if len(n) == 64]
    assert files and not [n for n in names if n.endswith(".tmp")]
    assert all(hashlib.sha256((cache / n).read_bytes()).hexdigest() == n for n in files)
    assert sum((cache / n).stat().st_size for n in files) <= bound
    logs = (
        first
        + second
        + "".join(
            p.read_text(errors="replace")
            for p in run_dir.rglob("*")
            if p.is_file() and p.suffix in (".log", ".jsonl", ".yaml", ".json")
        )
    )
    assert secret not in logs
