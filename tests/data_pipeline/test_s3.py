"""s3:// inputs against a real S3-protocol server: moto's standalone server on 127.0.0.1, with
its IAM checks on, so a wrong secret is refused as it would be by a real store."""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import hashlib
import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_pipeline.config import DataConfig, S3Config, SourceConfig
from data_pipeline.errors import DataError
from data_pipeline.prepare import prepare
from data_pipeline.shards import read_manifest
from tests.conftest import tiny_data_config, write_corpus
from tests.data_pipeline.conftest import write_jsonl

BUCKET = "corpora"
SETUP_REQUESTS = 3
"""Requests moto lets through before it checks credentials: create the user, its policy, its key."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_inputs(root: Path) -> Path:
    """A tree with every file-based type: text files, plain and gzip JSONL, Parquet, Arrow."""
    write_corpus(root / "corpus")
    jsonl = write_jsonl(root / "corpus", root / "jsonl" / "paras.jsonl")
    (root / "jsonl" / "more").mkdir()
    with gzip.open(root / "jsonl" / "more" / "paras2.jsonl.gz", "wb") as f:
        for line in jsonl.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            f.write((json.dumps({"body": record["body"].swapcase()}) + "\n").encode())
    texts = [json.loads(line)["body"].lower() for line in jsonl.read_text().splitlines()]
    table = pa.table({"content": texts, "n": list(range(len(texts)))})
    (root / "tables").mkdir()
    pq.write_table(table, root / "tables" / "a.parquet", row_group_size=40)
    (root / "tables" / "README.md").write_text("not data")
    with pa.ipc.new_file(root / "tables" / "b.arrow", table.schema) as w:
        for batch in table.to_batches(max_chunksize=50):
            w.write_batch(batch)
    return root


def _sources(base: str) -> list[SourceConfig]:
    return [SourceConfig(name="files", type="text", paths=[f"{base}/corpus"]),
            SourceConfig(name="paras", type="jsonl", field="body",
                         paths=[f"{base}/jsonl/*.jsonl", f"{base}/jsonl/**/*.gz"]),
            SourceConfig(name="pq", type="parquet", field="content", paths=[f"{base}/tables"]),
            SourceConfig(name="arrow", type="arrow", field="content",
                         paths=[f"{base}/tables/b.arrow"])]


@contextlib.contextmanager
def _moto_server(root: Path, check_credentials: bool):
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
    server = subprocess.Popen(["moto_server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
        setup = dict(endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="setup",
                     aws_secret_access_key="setup")
        iam = boto3.client("iam", **setup)
        iam.create_user(UserName="reader")
        iam.put_user_policy(UserName="reader", PolicyName="s3", PolicyDocument=json.dumps(
            {"Version": "2012-10-17",
             "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        s3 = boto3.client("s3", **{**setup, "aws_access_key_id": key["AccessKeyId"],
                                   "aws_secret_access_key": key["SecretAccessKey"]})
        s3.create_bucket(Bucket=BUCKET)
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            s3.put_object(Bucket=BUCKET, Key=f"in/{path.relative_to(root)}", Body=path.read_bytes())
        yield endpoint, key["AccessKeyId"], key["SecretAccessKey"]
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    return _write_inputs(tmp_path_factory.mktemp("s3in"))


@pytest.fixture(scope="module")
def s3_server(inputs):
    """Credentials are not checked: moto's signature check disagrees with the signatures of
    pyarrow's SDK on object listings, so the listing tests run here."""
    with _moto_server(inputs, check_credentials=False) as (endpoint, key_id, secret):
        yield endpoint, key_id, secret, inputs


@pytest.fixture(scope="module")
def checking_server(inputs):
    with _moto_server(inputs, check_credentials=True) as (endpoint, key_id, secret):
        yield endpoint, key_id, secret, inputs


@pytest.fixture
def aws_env(monkeypatch, tmp_path):
    """Credentials in the standard variables only; no config files, no instance metadata.
    Returns a function that sets the standard variables to a server's key."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))

    def use(key_id: str, secret: str) -> None:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    return use


def _config(root: Path, base: str, endpoint: str) -> DataConfig:
    return dataclasses.replace(tiny_data_config(root), sources=_sources(base), shard_tokens=4096,
                               s3=S3Config(endpoint_url=endpoint, region="us-east-1"))


def _digests(data_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(data_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(data_dir.rglob("*")) if p.is_file() and p.name != "manifest.json"}


def test_prepare_from_s3_is_byte_identical_to_local(s3_server, aws_env, tmp_path):
    endpoint, key_id, secret, root = s3_server
    aws_env(key_id, secret)
    local = _config(tmp_path / "local", str(root), endpoint)
    remote = _config(tmp_path / "remote", f"s3://{BUCKET}/in", endpoint)
    prepare(local, progress=False)
    prepare(remote, progress=False)
    want, got = _digests(Path(local.dir)), _digests(Path(remote.dir))
    assert len([n for n in want if n.endswith(".arrow")]) >= 8
    assert got == want
    m_local, m_remote = read_manifest(Path(local.dir)), read_manifest(Path(remote.dir))
    assert m_remote.fingerprint == m_local.fingerprint
    counts = {s["name"]: s["documents"] for s in m_remote.sources}
    assert counts == {s["name"]: s["documents"] for s in m_local.sources}
    assert all(sum(c.values()) > 0 for c in counts.values())


@pytest.mark.parametrize("path, named", [
    ("s3://no-such-bucket/in/corpus", "s3://no-such-bucket/in/corpus"),
    ("s3://no-such-bucket/in/*.txt", "s3://no-such-bucket/in"),
    (f"s3://{BUCKET}/in/corpus/missing.txt", f"s3://{BUCKET}/in/corpus/missing.txt"),
    (f"s3://{BUCKET}/in/nowhere/*.txt", f"s3://{BUCKET}/in/nowhere"),
])
def test_missing_bucket_or_object_is_named_and_leaves_nothing(s3_server, aws_env, tmp_path,
                                                              path, named):
    endpoint, key_id, secret, root = s3_server
    aws_env(key_id, secret)
    cfg = dataclasses.replace(_config(tmp_path, "", endpoint),
                              sources=[SourceConfig(name="t", type="text", paths=[path])])
    with pytest.raises(DataError, match=named.replace(".", r"\.").replace("*", r"\*")) as err:
        prepare(cfg, progress=False)
    if "no-such-bucket" in path:
        assert "bucket" in str(err.value)
    assert not Path(cfg.dir).exists()
    assert os.listdir(tmp_path) == []  # no staging directory left behind


def test_wrong_secret_is_refused_without_showing_it(checking_server, aws_env, tmp_path, capfd):
    endpoint, key_id, secret, root = checking_server
    obj = f"s3://{BUCKET}/in/corpus/{sorted(os.listdir(root / 'corpus'))[0]}"
    cfg = dataclasses.replace(_config(tmp_path, "", endpoint),
                              sources=[SourceConfig(name="t", type="text", paths=[obj])],
                              valid_fraction=0.5)
    aws_env(key_id, secret)  # the right key is let in: the refusal below is the secret's doing
    with pytest.raises(DataError, match="too few documents|validation split"):
        prepare(cfg, progress=False)
    wrong = "wrong-secret-Zq81xVv0"
    aws_env(key_id, wrong)
    with pytest.raises(DataError, match="access denied") as err:
        prepare(cfg, progress=True)
    message = str(err.value)
    assert message.startswith(obj) and "AWS_SECRET_ACCESS_KEY" in message
    out, errout = capfd.readouterr()
    for text in (message, repr(err.value.__cause__), out, errout):
        assert wrong not in text and secret not in text
    assert os.listdir(tmp_path) == []


def test_s3_settings_are_validated_and_not_in_the_data_hash(tmp_path):
    from data_pipeline.prepare import config_hash
    cfg = tiny_data_config(tmp_path)
    other = dataclasses.replace(cfg, s3=S3Config(endpoint_url="http://minio:9000", region="x"))
    assert config_hash(other) == config_hash(cfg)
    bad = dataclasses.replace(cfg, s3=S3Config(endpoint_url="minio:9000"), sources=[
        SourceConfig(name="hf", type="hf_disk", paths=["s3://b/ds"])])
    problems = bad.problems()
    assert any(p.startswith("s3.endpoint_url") for p in problems)
    assert any("hf_disk" in p and p.startswith("sources[0].paths") for p in problems)
