"""s3:// inputs against a real S3-protocol server (tests/helpers/s3.py)."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
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
from tests.helpers import s3 as helper_s3

BUCKET = helper_s3.BUCKET


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
    return [
        SourceConfig(name="files", type="text", paths=[f"{base}/corpus"]),
        SourceConfig(
            name="paras",
            type="jsonl",
            field="body",
            paths=[f"{base}/jsonl/*.jsonl", f"{base}/jsonl/**/*.gz"],
        ),
        SourceConfig(name="pq", type="parquet", field="content", paths=[f"{base}/tables"]),
        SourceConfig(name="arrow", type="arrow", field="content", paths=[f"{base}/tables/b.arrow"]),
    ]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    return _write_inputs(tmp_path_factory.mktemp("s3in"))


@pytest.fixture(scope="module")
def s3_server(inputs):
    """Credentials are not checked: moto's signature check disagrees with the signatures of
    pyarrow's SDK on object listings, so the listing tests run here."""
    with helper_s3.moto_server(inputs, check_credentials=False) as (endpoint, key_id, secret):
        yield endpoint, key_id, secret, inputs


@pytest.fixture(scope="module")
def checking_server(inputs):
    with helper_s3.moto_server(inputs, check_credentials=True) as (endpoint, key_id, secret):
        yield endpoint, key_id, secret, inputs


@pytest.fixture
def aws_env(monkeypatch, tmp_path):
    """Returns a function that sets the standard variables (only) to a server's key."""
    return lambda key_id, secret: helper_s3.use_credentials(monkeypatch, tmp_path, key_id, secret)


def _config(root: Path, base: str, endpoint: str) -> DataConfig:
    return dataclasses.replace(
        tiny_data_config(root),
        sources=_sources(base),
        shard_tokens=4096,
        s3=S3Config(endpoint_url=endpoint, region="us-east-1"),
    )


def _digests(data_dir: Path) -> dict[str, str]:
    return {
        str(p.relative_to(data_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(data_dir.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }


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


@pytest.mark.parametrize(
    "path, named",
    [
        ("s3://no-such-bucket/in/corpus", "s3://no-such-bucket/in/corpus"),
        ("s3://no-such-bucket/in/*.txt", "s3://no-such-bucket/in"),
        (f"s3://{BUCKET}/in/corpus/missing.txt", f"s3://{BUCKET}/in/corpus/missing.txt"),
        (f"s3://{BUCKET}/in/nowhere/*.txt", f"s3://{BUCKET}/in/nowhere"),
    ],
)
def test_missing_bucket_or_object_is_named_and_leaves_nothing(
    s3_server, aws_env, tmp_path, path, named
):
    endpoint, key_id, secret, root = s3_server
    aws_env(key_id, secret)
    cfg = dataclasses.replace(
        _config(tmp_path, "", endpoint), sources=[SourceConfig(name="t", type="text", paths=[path])]
    )
    with pytest.raises(DataError, match=named.replace(".", r"\.").replace("*", r"\*")) as err:
        prepare(cfg, progress=False)
    if "no-such-bucket" in path:
        assert "bucket" in str(err.value)
    assert not Path(cfg.dir).exists()
    assert os.listdir(tmp_path) == []  # no staging directory left behind


def test_wrong_secret_is_refused_without_showing_it(checking_server, aws_env, tmp_path, capfd):
    endpoint, key_id, secret, root = checking_server
    obj = f"s3://{BUCKET}/in/corpus/{sorted(os.listdir(root / 'corpus'))[0]}"
    cfg = dataclasses.replace(
        _config(tmp_path, "", endpoint),
        sources=[SourceConfig(name="t", type="text", paths=[obj])],
        valid_fraction=0.5,
    )
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
    bad = dataclasses.replace(
        cfg,
        s3=S3Config(endpoint_url="minio:9000"),
        sources=[SourceConfig(name="hf", type="hf_disk", paths=["s3://b/ds"])],
    )
    problems = bad.problems()
    assert any(p.startswith("s3.endpoint_url") for p in problems)
    assert any("hf_disk" in p and p.startswith("sources[0].paths") for p in problems)
