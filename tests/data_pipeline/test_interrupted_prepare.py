"""A preparation killed (SIGKILL, no cleanup) at any point never damages the data it replaces,
on local disk and on an S3-protocol server (moto): after each kill the earlier data verifies
and reads the same tokens, and the next preparation completes.

The earlier data ("old") and the replacement ("new", moe-prepare --force) differ in tokenizer
and split, and their shards have the same names: a preparation that wrote into the live names
would corrupt the old data (what a killed --force to s3:// did before generations).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data_pipeline import storage
from data_pipeline.config import S3Config
from data_pipeline.errors import DataError
from data_pipeline.prepare import prepare
from data_pipeline.prepared import PreparedData
from data_pipeline.reader import PackedReader
from data_pipeline.shards import read_manifest
from data_pipeline.token_stream import TokenStream
from data_pipeline.verify import verify
from tests.conftest import tiny_data_config, write_corpus
from tests.helpers import s3 as helper_s3

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("interrupted")
    write_corpus(root / "corpus")
    return root


def _configs(root: Path, data_dir: str, s3: S3Config | None = None):
    old = dataclasses.replace(
        tiny_data_config(root),
        dir=data_dir,
        prepare_workers=1,
        shard_tokens=12000,
        s3=s3 or S3Config(),
    )
    new = dataclasses.replace(
        old,
        valid_fraction=0.3,
        tokenizer=dataclasses.replace(old.tokenizer, vocab_size=400, sample_sentences=4000),
    )
    return old, new


def _content(data: PreparedData) -> dict:
    """Everything a run reads: both splits' token streams (through the shard cache on S3,
    which checks every object's SHA-256), the first packed batches and the tokenizer."""
    out = {split: TokenStream(data, split) for split in ("train", "valid")}
    out = {split: s.read(0, len(s)) for split, s in out.items()}
    reader = PackedReader(data, 16, 7, 0, 1, 2)
    out["batches"] = np.stack([b.numpy() for b in reader.micro_batches(4)])
    out["tokenizer"] = data.tokenizer_file().read_bytes()
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k] == b[k] if isinstance(a[k], bytes) else np.array_equal(a[k], b[k]) for k in a
    )


def _read(cfg, cache: Path) -> dict:
    if not storage.is_s3(cfg.dir):
        verify(cfg.dir, progress=False)
    return _content(PreparedData(cfg.dir, cfg.s3, cache, 10**9))


def _killed(cfg, point: str, count: int, tmp: Path) -> bool:
    """Run a --force preparation of ``cfg`` that kills itself at ``point`` (count); True if it
    was killed, False if it completed first."""
    config = tmp / "config.pickle"
    config.write_bytes(pickle.dumps(cfg))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.prepare_kill", point, str(count), str(config)],
        cwd=ROOT,
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(timeout=300)
    try:  # the pool's workers lose their parent with it; end any that is still there
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if proc.returncode == -signal.SIGKILL:
        return True
    assert proc.returncode == 0 and "completed" in out, err
    return False


def _kill_points(new_local, tmp: Path, remote: bool) -> list[tuple[str, int]]:
    """Every point of a --force preparation of ``new``: the tokenizer, each shard written (or
    each object uploaded, the manifest last), just before the manifest, and the removal of the
    earlier data after the switch."""
    shards = sum(len(s.shards) for s in prepare(new_local, progress=False).manifest.splits.values())
    writes = (
        [("upload", i) for i in range(1, shards + 2)]
        if remote
        else [("shard", i) for i in range(1, shards + 1)]
    )
    return [("tokenizer", 1), *writes, ("manifest", 1), ("remove", 1), ("remove", 2)]


def _sweep(old, new, points, tmp: Path) -> None:
    prepare(old, progress=False)
    want_old = _read(old, tmp / "cache-old")
    want_new = _read(dataclasses.replace(new, dir=str(tmp / "reference")), tmp / "cache-ref")
    assert not _same(want_old, want_new)
    switched = False
    for n, (point, count) in enumerate(points):
        assert _killed(new, point, count, tmp), f"{point} {count}: the preparation completed"
        switched = switched or point == "remove"
        got = _read(old, tmp / f"cache-{n}")  # a fresh cache: every object fetched and checked
        assert _same(got, want_new if switched else want_old), f"killed at {point} {count}"
        if switched:  # the new data is whole: a plain moe-prepare finds it prepared
            assert prepare(new, progress=False).skipped
    assert not _killed(new, "shard", 10**6, tmp)  # the next preparation completes
    assert _same(_read(new, tmp / "cache-last"), want_new)


def _stored(cfg) -> list[str]:
    if storage.is_s3(cfg.dir):
        return sorted(i.path.split("/", 2)[2] for i in storage.list_s3(cfg.dir, cfg.s3))
    return sorted(
        p.relative_to(cfg.dir).as_posix() for p in Path(cfg.dir).rglob("*") if p.is_file()
    )


def _objects(cfg) -> list[str]:
    """Every key under an s3:// data.dir, the empty "directory" objects included (which
    pyarrow's listing shows as directories, not files)."""
    boto3 = pytest.importorskip("boto3")
    client = boto3.client("s3", endpoint_url=cfg.s3.endpoint_url, region_name="us-east-1")
    bucket, prefix = cfg.dir[len("s3://") :].split("/", 1)
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/")
    return sorted(o["Key"][len(prefix) + 1 :] for page in pages for o in page.get("Contents", []))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with helper_s3.moto_server(tmp_path_factory.mktemp("empty"), check_credentials=False) as srv:
        yield srv


@pytest.fixture
def bucket(server, monkeypatch, tmp_path) -> S3Config:
    endpoint, key_id, secret = server
    helper_s3.use_credentials(monkeypatch, tmp_path, key_id, secret)
    monkeypatch.setattr(storage, "upload", helper_s3.put_object)
    return S3Config(endpoint_url=endpoint, region="us-east-1")


def test_killed_force_to_s3_after_shard_uploads_keeps_the_old_data(corpus, bucket, tmp_path):
    """What a user hit: --force to s3:// killed after six uploads; the old manifest then
    pointed at overwritten shards."""
    old, new = _configs(corpus, f"s3://{helper_s3.BUCKET}/six", bucket)
    prepare(old, progress=False)
    cache = tmp_path / "cache"  # one node's cache, kept across both generations
    want = _read(old, cache)
    assert _killed(new, "upload", 6, tmp_path)
    assert _same(_read(old, tmp_path / "fresh-cache"), want)
    assert _same(_read(old, cache), want)
    prepare(new, force=True, progress=False)
    got = _read(new, cache)  # nothing of the old generation is served for the new one
    assert _same(got, _read(new, tmp_path / "new-cache")) and got["tokenizer"] != want["tokenizer"]
    # Only the new generation and its manifest are left.
    assert {name.split("/")[0] for name in _stored(new)} == {"gen-3", "manifest.json"}


def test_retired_generations_leave_no_object_on_s3(corpus, bucket, tmp_path):
    """pyarrow keeps the "directory" of the last object it deletes under a prefix as an empty
    object (``gen-1/``): every retired generation, a killed one's too, leaves nothing behind."""
    old, new = _configs(corpus, f"s3://{helper_s3.BUCKET}/gens", bucket)
    prepare(old, progress=False)
    prepare(new, force=True, progress=False)
    assert _killed(old, "upload", 3, tmp_path)  # gen-3: a few objects, no manifest names them
    assert any(name.startswith("gen-3/") for name in _stored(old))
    prepare(old, force=True, progress=False)
    live = [name for name in _stored(old) if name != "manifest.json"]
    assert live and {name.split("/")[0] for name in live} == {"gen-4"}
    # data.dir's own marker (""): pyarrow writes it when it removes the last generation marker
    assert set(_objects(old)) - {""} == {*live, "manifest.json"}


def test_failed_upload_leaves_the_prefix_as_it_was(corpus, bucket, tmp_path, monkeypatch):
    old, new = _configs(corpus, f"s3://{helper_s3.BUCKET}/failed", bucket)
    prepare(old, progress=False)
    before, want = _stored(old), _read(old, tmp_path / "cache")
    calls = []

    def failing(local, url, s3):
        calls.append(url)
        if len(calls) == 3:
            raise storage.s3_error(url, OSError("AWS Error NETWORK_CONNECTION during PutObject"))
        helper_s3.put_object(local, url, s3)

    monkeypatch.setattr(storage, "upload", failing)
    with pytest.raises(DataError, match="NETWORK_CONNECTION"):
        prepare(new, force=True, progress=False)
    assert _stored(old) == before and "/gen-2/" in calls[0]
    assert not [name for name in _objects(old) if name.startswith("gen-2")]
    assert _same(_read(old, tmp_path / "fresh-cache"), want)


def test_killed_force_on_local_disk_keeps_the_old_data(corpus, tmp_path):
    old, new = _configs(corpus, str(tmp_path / "data"))
    prepare(old, progress=False)
    want = _read(old, tmp_path / "cache")
    assert _killed(new, "shard", 2, tmp_path)
    assert _same(_read(old, tmp_path / "cache"), want)
    prepare(new, force=True, progress=False)
    assert {name.split("/")[0] for name in _stored(new)} == {"gen-3", "manifest.json"}


def test_old_layout_is_read_and_replaced(corpus, tmp_path):
    """Data prepared before generations (files at the top of data.dir) still reads, and a
    --force replaces it whole."""
    old, new = _configs(corpus, str(tmp_path / "data"))
    prepare(old, progress=False)
    fingerprint = read_manifest(old.dir).fingerprint
    data_dir = Path(old.dir)
    raw = (data_dir / "manifest.json").read_text().replace("gen-1/", "")
    for path in sorted((data_dir / "gen-1").iterdir()):
        path.rename(data_dir / path.name)
    (data_dir / "gen-1").rmdir()
    (data_dir / "manifest.json").write_text(raw)
    assert read_manifest(old.dir).fingerprint == fingerprint
    _read(old, tmp_path / "cache")
    # Killed after the switch, while removing the old files; the next --force removes the rest.
    assert _killed(new, "remove", 1, tmp_path)
    assert prepare(new, progress=False).skipped
    assert any(not name.startswith(("gen-", "manifest")) for name in _stored(new))
    prepare(new, force=True, progress=False)
    assert {name.split("/")[0] for name in _stored(new)} == {"gen-2", "manifest.json"}


@pytest.mark.integration
def test_kill_at_every_point_on_local_disk(corpus, tmp_path):
    old, new = _configs(corpus, str(tmp_path / "data"))
    points = _kill_points(
        dataclasses.replace(new, dir=str(tmp_path / "reference")), tmp_path, remote=False
    )
    _sweep(old, new, points, tmp_path)


@pytest.mark.integration
def test_kill_at_every_point_on_s3(corpus, bucket, tmp_path):
    old, new = _configs(corpus, f"s3://{helper_s3.BUCKET}/every", bucket)
    points = _kill_points(
        dataclasses.replace(new, dir=str(tmp_path / "reference"), s3=S3Config()),
        tmp_path,
        remote=True,
    )
    _sweep(old, new, points, tmp_path)


def _train_worker(rank, world, cfg_dict, out):
    import json

    from moe.config.run import RunConfig
    from moe.core.config_schema import from_dict
    from moe.training.trainer import DistEnv, train

    summary = train(from_dict(RunConfig, cfg_dict), DistEnv(rank, world, rank, world))
    Path(out).write_text(json.dumps([h["loss"] for h in summary["history"]]))


def _losses(data, run_dir: Path) -> list[float]:
    import json

    from tests.conftest import tiny_run_dict
    from tests.helpers.distributed import run_distributed

    cfg = tiny_run_dict(data, run_dir, max_steps=3)
    cfg["data"]["shard_tokens"] = data.shard_tokens
    cfg["parallel"] = {"world_size": 1, "expert_parallel_size": 1, "zero_stage": 2}
    cfg["checkpoint"] = {"every_n_steps": 100}
    run_distributed(_train_worker, 1, cfg, str(run_dir / "losses.json"))
    return json.loads((run_dir / "losses.json").read_text())


@pytest.mark.integration
def test_training_after_a_killed_force_gives_the_same_losses(corpus, tmp_path):
    old, new = _configs(corpus, str(tmp_path / "data"))
    prepare(old, progress=False)
    before = _losses(old, tmp_path / "before")
    assert _killed(new, "shard", 3, tmp_path)
    assert _losses(old, tmp_path / "after") == before and len(before) == 3
