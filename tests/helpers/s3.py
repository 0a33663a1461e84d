"""A real S3-protocol server for tests: moto's standalone server on 127.0.0.1, with its IAM
checks on when asked, so a wrong secret is refused as it would be by a real store."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from moe.training.ports import free_port

BUCKET = "corpora"
SETUP_REQUESTS = 3
"""Requests moto lets through before it checks credentials: create the user, its policy, its key."""


def _free_port() -> int:
    return free_port()


@contextlib.contextmanager
def moto_server(root: Path, check_credentials: bool):
    """A moto server on 127.0.0.1 holding the files under ``root`` in bucket ``corpora`` (under
    ``in/``); yields (endpoint, key id, secret). With ``check_credentials``, moto verifies every
    request's key and signature, after letting the setup requests through."""
    if shutil.which("moto_server") is None:
        pytest.skip('moto\'s server is not installed (pip install "moto[server]")')
    boto3 = pytest.importorskip("boto3", reason='boto3 comes with "moto[server]"')
    port = _free_port()
    env = dict(os.environ)
    if check_credentials:
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(SETUP_REQUESTS)
    server = subprocess.Popen(
        ["moto_server", "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    pytest.skip(f"moto_server did not start on 127.0.0.1:{port}")
                time.sleep(0.1)
        endpoint = f"http://127.0.0.1:{port}"
        setup = dict(
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="setup",
            aws_secret_access_key="setup",
        )
        iam = boto3.client("iam", **setup)
        iam.create_user(UserName="reader")
        iam.put_user_policy(
            UserName="reader",
            PolicyName="s3",
            PolicyDocument=json.dumps(
                {
                    "Version": "2012-10-17",
                    "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
                }
            ),
        )
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        s3 = boto3.client(
            "s3",
            **{
                **setup,
                "aws_access_key_id": key["AccessKeyId"],
                "aws_secret_access_key": key["SecretAccessKey"],
            },
        )
        s3.create_bucket(Bucket=BUCKET)
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            s3.put_object(Bucket=BUCKET, Key=f"in/{path.relative_to(root)}", Body=path.read_bytes())
        yield endpoint, key["AccessKeyId"], key["SecretAccessKey"]
    finally:
        server.terminate()
        server.wait(timeout=10)


def use_credentials(monkeypatch, tmp_path: Path, key_id: str, secret: str) -> None:
    """Credentials in the standard variables only: no config files, no instance metadata."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)


def put_object(local: Path, url: str, s3) -> None:
    """Upload through boto3, in place of ``data_pipeline.storage.upload``: moto 5.2.1 answers
    pyarrow's CompleteMultipartUpload with a malformed document (getmoto/moto#10055), so
    pyarrow's own upload cannot run against it."""
    import boto3

    bucket, key = url[len("s3://") :].split("/", 1)
    boto3.client("s3", endpoint_url=s3.endpoint_url, region_name="us-east-1").put_object(
        Bucket=bucket, Key=key, Body=local.read_bytes()
    )
