"""Prepared data on S3 (a real moto server, tests/helpers/s3.py): prepared into a bucket, read
through the bounded node-local cache exactly as from local disk, the cache shared by processes,
cleaned of a crashed run's leftovers, and a corrupt or missing object named."""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import multiprocessing as mp
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from data_pipeline import storage
from data_pipeline.cache import ObjectCache, _locked
from data_pipeline.config import S3Config, SourceConfig
from data_pipeline.errors import DataError
from data_pipeline.prepare import prepare
from data_pipeline.prepared import PreparedData
from data_pipeline.reader import PackedReader
from data_pipeline.shards import read_manifest
from data_pipeline.token_stream import validation_windows
from tests.conftest import tiny_data_config, write_corpus
from tests.data_pipeline.conftest import write_jsonl
from tests.helpers import s3 as helper_s3

PREFIX = f"s3://{helper_s3.BUCKET}/prepared"
STEPS, ACCUM, MICRO = 6, 2, 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with helper_s3.moto_server(tmp_path_factory.mktemp("empty"), check_credentials=False) as srv:
        yield srv


@pytest.fixture
def creds(server, monkeypatch, tmp_path):
    endpoint, key_id, secret = server
    helper_s3.use_credentials(monkeypatch, tmp_path, key_id, secret)
    return endpoint


@pytest.fixture(scope="module")
def local_data(tmp_path_factory):
    """Small shards (paragraphs as documents: about 70 train shards of 4 KB), on local disk."""
    root = tmp_path_factory.mktemp("local")
    write_corpus(root / "corpus")
    paras = write_jsonl(root / "corpus", root / "paras.jsonl")
    cfg = dataclasses.replace(
        tiny_data_config(root),
        shard_tokens=2048,
        seq_len=16,
        sources=[SourceConfig(name="paras", type="jsonl", paths=[str(paras)], field="body")],
    )
    prepare(cfg, progress=False)
    return cfg


def _put(local: Path, url: str, s3: S3Config) -> None:
    """Uploads through boto3: moto 5.2.1 answers pyarrow's CompleteMultipartUpload with a
    malformed document (getmoto/moto#10055), so pyarrow's own upload cannot run against it."""
    bucket, key = url[len("s3://") :].split("/", 1)
    _boto(s3.endpoint_url).put_object(Bucket=bucket, Key=key, Body=local.read_bytes())


@pytest.fixture
def remote_data(local_data, creds, monkeypatch):
    """The same config prepared into the bucket (once per module: later calls find it)."""
    cfg = dataclasses.replace(
        local_data, dir=PREFIX, s3=S3Config(endpoint_url=creds, region="us-east-1")
    )
    monkeypatch.setattr(storage, "upload", _put)
    prepare(cfg, progress=False)
    return cfg


def _boto(endpoint: str):
    boto3 = pytest.importorskip("boto3")
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


def _read(data, steps=STEPS, rank=0, world=1) -> list[np.ndarray]:
    reader = PackedReader(data, 16, 7, rank, world, MICRO)
    return [b.numpy() for _ in range(steps) for b in reader.micro_batches(ACCUM)], reader


def _data(cfg, cache_dir, cache_bytes=10**9, read_ahead=2) -> PreparedData:
    return PreparedData(cfg.dir, cfg.s3, cache_dir, cache_bytes, read_ahead)


def _shard_bytes(cfg) -> list[int]:
    return [s.bytes for s in read_manifest(cfg.dir).splits["train"].shards]


def test_prepare_into_s3_then_read_is_identical_to_local(local_data, remote_data, creds, tmp_path):
    client = _boto(creds)
    listed = {
        o["Key"]: o["Size"]
        for o in client.list_objects_v2(Bucket=helper_s3.BUCKET, Prefix="prepared/")["Contents"]
    }
    local = Path(local_data.dir)
    files = [p for p in local.rglob("*") if p.is_file()]
    for path in files:
        key = f"prepared/{path.relative_to(local).as_posix()}"
        body = client.get_object(Bucket=helper_s3.BUCKET, Key=key)["Body"]
        assert hashlib.sha256(body.read()).digest() == hashlib.sha256(path.read_bytes()).digest()
    assert len(listed) == len(files) > 20
    again = prepare(remote_data, progress=False)
    assert again.skipped

    want, local_reader = _read(local_data.dir)
    data = _data(remote_data, tmp_path / "cache")
    got, reader = _read(data)
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
    assert reader.state_dict() == local_reader.state_dict()
    assert [w.tolist() for w, _ in validation_windows(data, 16)] == [
        w.tolist() for w, _ in validation_windows(local_data.dir, 16)
    ]
    assert data.tokenizer_file().read_bytes() == PreparedData(local).tokenizer_file().read_bytes()
    # Every cached file is a verified copy named by its SHA-256; nothing else is left.
    names = sorted(os.listdir(tmp_path / "cache"))
    files = [n for n in names if len(n) == 64]
    assert files and all(
        hashlib.sha256((tmp_path / "cache" / n).read_bytes()).hexdigest() == n for n in files
    )
    assert not [n for n in names if n.endswith(".tmp")]


def _watch(cache_dir: Path, stop: threading.Event, peak: list[int]) -> None:
    probe = ObjectCache.__new__(ObjectCache)
    probe.root = cache_dir
    while not stop.is_set():
        peak[0] = max(peak[0], probe.used_bytes())


def test_cache_bound_holds_with_a_cache_smaller_than_the_data(local_data, remote_data, tmp_path):
    sizes = _shard_bytes(local_data)
    bound = 3 * max(sizes)  # about a tenth of the data
    assert bound < sum(sizes) / 5
    cache_dir = tmp_path / "cache"
    data = _data(remote_data, cache_dir, bound, read_ahead=2)
    data.cache  # noqa: B018  (creates the directory the watcher lists)
    peak, stop = [0], threading.Event()
    watcher = threading.Thread(target=_watch, args=(cache_dir, stop, peak))
    watcher.start()
    try:
        got, reader = _read(data, steps=20)
    finally:
        stop.set()
        watcher.join()
    want, _ = _read(local_data.dir, steps=20)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    assert 0 < peak[0] <= bound
    assert data.cache.used_bytes() <= bound
    # Every shard passed through a cache that holds three: the others were evicted.
    assert data.cache.fetches >= len(sizes)


def test_read_ahead_fetches_the_next_shards_in_the_background(remote_data, tmp_path, monkeypatch):
    import time

    slow = ObjectCache._download

    def download(self, *args):  # slow enough that the foreground is still busy
        time.sleep(0.02)
        return slow(self, *args)

    monkeypatch.setattr(ObjectCache, "_download", download)
    _, reader = _read(_data(remote_data, tmp_path / "ahead", read_ahead=2), steps=1)
    assert reader._read_ahead is not None and reader._read_ahead.fetched > 0
    _, reader = _read(_data(remote_data, tmp_path / "none", read_ahead=0), steps=1)
    assert reader._read_ahead is None


def _worker(cfg_dir, s3, cache_dir, bound, rank, out):
    data = PreparedData(cfg_dir, s3, cache_dir, bound, 1)
    reader = PackedReader(data, 16, 7, rank, 2, MICRO)
    batches = [b.numpy() for _ in range(10) for b in reader.micro_batches(ACCUM)]
    np.save(out, np.stack(batches))


def test_two_processes_share_one_cache(local_data, remote_data, tmp_path):
    cache_dir = tmp_path / "cache"
    bound = 4 * max(_shard_bytes(local_data))
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                remote_data.dir,
                remote_data.s3,
                str(cache_dir),
                bound,
                r,
                str(tmp_path / f"r{r}.npy"),
            ),
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0]
    for r in range(2):
        reader = PackedReader(local_data.dir, 16, 7, r, 2, MICRO)
        want = np.stack([b.numpy() for _ in range(10) for b in reader.micro_batches(ACCUM)])
        assert np.array_equal(np.load(tmp_path / f"r{r}.npy"), want)
    names = os.listdir(cache_dir)
    assert not [n for n in names if n.endswith(".tmp")]
    files = [n for n in names if len(n) == 64]
    assert files and all(
        hashlib.sha256((cache_dir / n).read_bytes()).hexdigest() == n for n in files
    )
    assert sum((cache_dir / n).stat().st_size for n in files) <= bound


def test_stale_cache_is_cleaned_at_start_up(local_data, remote_data, tmp_path):
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    shards = read_manifest(local_data.dir).splits["train"].shards
    a, b, c = shards[0].sha256, shards[1].sha256, shards[2].sha256
    (cache_dir / f"{a}.999.0.tmp").write_bytes(b"half a download")
    (cache_dir / f"{b}.lock").write_bytes(b"")
    (cache_dir / b).write_bytes((Path(local_data.dir) / shards[1].file).read_bytes()[:-10])
    # A download in flight elsewhere: its temporary file is kept while its lock is held.
    (cache_dir / f"{c}.998.0.tmp").write_bytes(b"in flight")
    holder = mp.get_context("spawn").Process(
        target=_hold_lock, args=(str(cache_dir / f"{c}.lock"),)
    )
    ready = cache_dir / f"{c}.lock"
    holder.start()
    try:
        for _ in range(200):
            if ready.exists() and _held(ready):
                break
            threading.Event().wait(0.05)
        data = _data(remote_data, cache_dir)
        data.cache  # noqa: B018  (first use: the clean-up runs)
        names = set(os.listdir(cache_dir))
        assert f"{a}.999.0.tmp" not in names and f"{b}.lock" not in names and b not in names
        assert {f"{c}.998.0.tmp", f"{c}.lock"} <= names
    finally:
        holder.terminate()
        holder.join()
    # The truncated shard is fetched again, whole.
    with data.shard(shards[1]) as tokens:
        assert len(tokens) == shards[1].tokens
    assert hashlib.sha256((cache_dir / b).read_bytes()).hexdigest() == b


def _hold_lock(path):
    with _locked(Path(path), fcntl.LOCK_EX):
        threading.Event().wait(60)


def _held(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def test_corrupt_or_missing_object_is_named_and_nothing_is_left(
    local_data, remote_data, creds, tmp_path
):
    client = _boto(creds)
    shards = read_manifest(local_data.dir).splits["train"].shards
    victim = shards[3]
    key = f"prepared/{victim.file}"
    good = (Path(local_data.dir) / victim.file).read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    client.put_object(Bucket=helper_s3.BUCKET, Key=key, Body=bytes(bad))
    cache_dir = tmp_path / "cache"
    try:
        with pytest.raises(DataError, match="corrupt") as err:
            _read(_data(remote_data, cache_dir), steps=3)
        assert str(err.value).startswith(
            f"{PREFIX}/{victim.file}: corrupt object: its SHA-256 is "
            f"{hashlib.sha256(bad).hexdigest()}, the manifest's is "
            f"{victim.sha256}"
        )
        assert not [
            n
            for n in os.listdir(cache_dir)
            if n.startswith(victim.sha256) and not n.endswith(".lock")
        ]
        client.delete_object(Bucket=helper_s3.BUCKET, Key=key)
        with pytest.raises(DataError, match="no such object") as err:
            _read(_data(remote_data, tmp_path / "cache2"), steps=3)
        assert str(err.value).startswith(f"{PREFIX}/{victim.file}")
    finally:
        client.put_object(Bucket=helper_s3.BUCKET, Key=key, Body=good)
    with pytest.raises(DataError, match="no manifest") as err:
        PreparedData(f"s3://{helper_s3.BUCKET}/nothing-here", remote_data.s3, tmp_path)
    assert f"s3://{helper_s3.BUCKET}/nothing-here/manifest.json" in str(err.value)


def test_cache_settings_are_validated(tmp_path):
    cfg = dataclasses.replace(tiny_data_config(tmp_path), cache_bytes=0, read_ahead=-1, dir="s3://")
    problems = cfg.problems()
    for key in ("cache_bytes", "read_ahead", "dir"):
        assert any(p.startswith(key) for p in problems), (key, problems)


def test_stopping_read_ahead_waits_for_its_fetch_and_fetches_nothing_more():
    """The race behind a reader error: the thread has taken an object off its list and is
    fetching it (here: blocked in fetch) when the reader fails. ``stop`` returns only after that
    fetch has ended, so its temporary file is gone; the rest of the list is never fetched."""
    from data_pipeline.cache import ReadAhead

    entered, release, fetched = threading.Event(), threading.Event(), []

    class SlowCache:
        root = Path("/nonexistent")

        def fetch(self, url, sha, nbytes, wait=True):
            entered.set()
            release.wait(30)
            fetched.append(url)

    ahead = ReadAhead(SlowCache())
    ahead.want([("a", "0" * 64, 1), ("b", "1" * 64, 1)])
    assert entered.wait(30)
    stopper = threading.Thread(target=ahead.stop)
    stopper.start()
    stopper.join(0.3)
    assert stopper.is_alive()  # waiting for the fetch under way
    release.set()
    stopper.join(30)
    assert not stopper.is_alive() and fetched == ["a"]
    entered.clear()
    ahead.want([("c", "2" * 64, 1)])  # a later want starts again
    assert entered.wait(30)
    ahead.stop()
    assert fetched == ["a", "c"]


def test_a_cache_full_of_open_shards_times_out_naming_the_setting(tmp_path):
    """Room for a new shard only comes from evicting shards nobody has open: when every cached
    shard is held open (by other ranks of the node) past the wait, the fetch fails with the
    cache, its bound and the key to raise, and leaves no temporary file. A shard that is not
    held is evicted instead."""
    cache = ObjectCache(tmp_path / "cache", max_bytes=1000, s3=S3Config(), room_wait_s=0.5)
    held = cache.root / ("a" * 64)
    held.write_bytes(b"x" * 800)
    fd = os.open(held, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)  # another rank reading it
    try:
        with pytest.raises(
            DataError,
            match=r"s3://b/new: no room in the shard cache .*"
            r"1,000 bytes, data.cache_bytes\) after 0s.*"
            r"raise data.cache_bytes",
        ):
            cache.fetch("s3://b/new", "b" * 64, nbytes=400)
    finally:
        os.close(fd)
    assert sorted(os.listdir(cache.root)) == ["a" * 64, "b" * 64 + ".lock", "cache.lock"]
    # Not held any more: evicted to make room (the download itself is not reached here).
    assert cache._make_room(400) and not held.exists()


def test_verify_checks_every_object_of_an_s3_prefix(
    local_data, remote_data, creds, tmp_path, capsys
):
    import yaml

    from launch import prepare as prepare_cli
    from tests.conftest import tiny_run_dict

    run = tiny_run_dict(remote_data, tmp_path / "runs")
    run["data"].update(dir=PREFIX, s3={"endpoint_url": creds, "region": "us-east-1"})
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(run))
    fingerprint = read_manifest(local_data.dir).fingerprint
    prepare_cli.main([str(config), "--verify", "--quiet"])  # the config's data.dir and data.s3
    assert capsys.readouterr().out.startswith(f"{PREFIX}: ok; ")
    prepare_cli.main([str(config), "--verify", PREFIX + "/", "--quiet"])  # a prefix named
    out = capsys.readouterr().out
    assert out.startswith(f"{PREFIX}/: ok; ") and fingerprint in out

    client = _boto(creds)
    victim = read_manifest(local_data.dir).splits["valid"].shards[0]
    good = (Path(local_data.dir) / victim.file).read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x01  # in the token data: the structure stays valid
    client.put_object(Bucket=helper_s3.BUCKET, Key=f"prepared/{victim.file}", Body=bytes(bad))
    try:
        with pytest.raises(SystemExit) as exc:
            prepare_cli.main([str(config), "--verify", "--quiet"])
    finally:
        client.put_object(Bucket=helper_s3.BUCKET, Key=f"prepared/{victim.file}", Body=good)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err
    assert (
        f"{PREFIX}/{victim.file}: corrupt shard: its SHA-256 is "
        f"{hashlib.sha256(bad).hexdigest()}, the manifest's is {victim.sha256}"
    ) in err
    assert not list(tmp_path.glob("moe-verify-*"))


def test_instruction_data_on_s3_reads_its_loss_mask_as_local(creds, tmp_path, monkeypatch):
    """Masked shards through the bounded cache: the same tokens and targets as from local disk
    (the tokenizer trained on the conversations as the template writes them)."""
    from tests.data_pipeline.test_instruction import conversations
    from tests.data_pipeline.test_instruction import write_jsonl as write_records

    write_corpus(tmp_path / "corpus")
    chat = write_records(tmp_path / "chat.jsonl", conversations(tmp_path / "corpus"))
    local = dataclasses.replace(
        tiny_data_config(tmp_path),
        shard_tokens=2048,
        seq_len=16,
        sources=[SourceConfig(name="chat", type="instruction", paths=[str(chat)])],
    )
    prepare(local, progress=False)
    remote = dataclasses.replace(
        local, dir=f"{PREFIX}-chat", s3=S3Config(endpoint_url=creds, region="us-east-1")
    )
    monkeypatch.setattr(storage, "upload", _put)
    prepare(remote, progress=False)
    assert read_manifest(local.dir).loss_mask and len(_shard_bytes(local)) > 3

    def batches(data):
        reader = PackedReader(data, 16, 7, 0, 1, MICRO)
        return [(b.tokens_BS, b.targets_BS) for _ in range(STEPS) for b in reader.next_step(ACCUM)]

    got = batches(_data(remote, tmp_path / "cache", read_ahead=1))
    want = batches(local.dir)
    assert all(a.equal(c) and b.equal(d) for (a, b), (c, d) in zip(got, want))
    assert any((b == -100).any() and (b >= 0).any() for _, b in got)
    remote_windows = validation_windows(_data(remote, tmp_path / "cache"), 16)
    assert [t.tolist() for _, t in remote_windows] == [
        t.tolist() for _, t in validation_windows(local.dir, 16)
    ]
