"""A full, over-quota or read-only disk under moe-prepare: one line naming the file and the cause,
exit 2, nothing of the failed preparation left behind, and the data prepared before it whole.

The failures are injected (the tests also run as root, whom a read-only mode does not stop): an
OSError from a write function of the main process, and workers whose spill files are /dev/full,
which refuses every write as a full disk does. The workers are forked so that they start with
the test's patches; the error still crosses the pool's pipe as it does from spawned ones."""

from __future__ import annotations

import builtins
import contextlib
import errno
import multiprocessing as mp
import os
import shutil
import stat
from pathlib import Path

import pytest
import yaml

from data_pipeline import generations, parts, shards, workers
from data_pipeline.prepared import PreparedData
from data_pipeline.verify import verify
from data_pipeline.write_errors import write_error
from launch import prepare as prepare_cli
from tests.conftest import tiny_run_dict


@pytest.fixture
def config(tiny_data, tmp_path) -> Path:
    """The tiny data's run config, into tmp_path/data, with the tiny data's tokenizer."""
    run = tiny_run_dict(tiny_data, tmp_path / "runs")
    run["data"].update(dir=str(tmp_path / "data"), prepare_workers=2)
    run["data"]["tokenizer"] = {"model_file": str(PreparedData(tiny_data.dir).tokenizer_file())}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run))
    return path


def tree(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under ``root``."""
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


def fails(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        prepare_cli.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err  # one line, no traceback
    return err


@contextlib.contextmanager
def fork_pool(n: int, tokenizer_path: str | None, s3):
    with mp.get_context("fork").Pool(
        n, initializer=workers.init_worker, initargs=(tokenizer_path, s3)
    ) as pool:
        yield pool


def spills_to_dev_full(file, mode="r", *args, **kw):
    """open(), with the workers' spill files (*.bin) on a disk that is always full."""
    if "w" in mode and str(file).endswith(".bin"):
        file = "/dev/full"
    return builtins.open(file, mode, *args, **kw)


@pytest.mark.parametrize("step", ["prepare", "part"])
def test_a_full_disk_under_the_workers_is_one_line_and_keeps_the_data(
    tiny_data, config, tmp_path, monkeypatch, capsys, step
):
    if not os.path.exists("/dev/full") or not stat.S_ISCHR(os.stat("/dev/full").st_mode):
        # Where it is missing, the workers' writes would make /dev/full a file of their data.
        pytest.skip("this machine has no /dev/full device (a disk that is always full)")
    data, parts_dir = tmp_path / "data", tmp_path / "data.parts"
    shutil.copytree(tiny_data.dir, data)
    if step == "part":
        prepare_cli.main([str(config), "--tokenizer-only", "--quiet"])
    before = {"data": tree(data), "parts": tree(parts_dir) if parts_dir.exists() else None}
    monkeypatch.setattr(workers, "worker_pool", fork_pool)
    monkeypatch.setattr(workers, "open", spills_to_dev_full, raising=False)
    argv = ["--force"] if step == "prepare" else ["--part", "0/2"]
    err = fails([str(config), *argv, "--quiet"], capsys)
    spill = (
        data / "gen-2" / ".spill" if step == "prepare" else parts_dir / ".part-00000-of-00002.tmp"
    )
    assert err.startswith(f"error: cannot write {spill}/") and ".bin: " in err, err
    assert "the disk holding it is full (" in err and "bytes free)" in err
    assert tree(data) == before["data"]
    if step == "part":
        assert tree(parts_dir) == before["parts"]  # no half-written part
    monkeypatch.undo()
    verify(data, progress=False)


def full_write(path: Path, data) -> None:
    """write_atomic on a disk that fills up halfway through the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_name(f".{path.name}.tmp1").write_bytes(bytes(data)[:10])
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("failure", ["shard", "manifest", "read-only", "tokenizer"])
def test_a_write_failure_of_the_main_process_undoes_the_preparation(
    tiny_data, config, tmp_path, monkeypatch, capsys, failure
):
    data = tmp_path / "data"
    shutil.copytree(tiny_data.dir, data)
    before = tree(data)
    gen = data / "gen-2"
    if failure == "shard":
        monkeypatch.setattr(shards, "write_atomic", full_write)
        expected = f"cannot write {gen}: the disk holding it is full ("
    elif failure == "manifest":

        def over_quota(data_dir, manifest):
            (data_dir / ".manifest.json.tmp1").write_text('{"half": ')
            raise OSError(errno.EDQUOT, "Disk quota exceeded")

        monkeypatch.setattr(generations, "write_manifest", over_quota)
        expected = f"cannot write {data / 'manifest.json'}: this user's disk quota"
    elif failure == "read-only":
        mkdir = Path.mkdir

        def read_only(self, *args, **kw):
            if self == gen:
                raise OSError(errno.EROFS, "Read-only file system", str(self))
            return mkdir(self, *args, **kw)

        monkeypatch.setattr(Path, "mkdir", read_only)
        expected = f"cannot write {gen}: the disk holding it is read-only"
    else:  # the copy of tokenizer.model_file into the generation

        def denied(src, dst, **kw):
            raise PermissionError(errno.EACCES, "Permission denied", str(dst))

        monkeypatch.setattr(shutil, "copyfile", denied)
        expected = f"cannot write {gen / 'tokenizer.model'}: this user may not write there"
    err = fails([str(config), "--force", "--quiet"], capsys)
    assert expected in err, err
    assert tree(data) == before  # no generation, no temporary manifest: the data as it was
    monkeypatch.undo()
    verify(data, progress=False)


def test_a_failed_first_preparation_leaves_no_folder_behind(config, tmp_path, monkeypatch, capsys):
    nested = tmp_path / "new" / "a" / "data"
    monkeypatch.setattr(shards, "write_atomic", full_write)
    err = fails([str(config), f"data.dir={nested}", "--quiet"], capsys)
    assert f"cannot write {nested / 'gen-1'}: the disk holding it is full" in err
    assert not (tmp_path / "new").exists()


def test_a_failed_tokenizer_step_keeps_the_earlier_tokenizer(config, tmp_path, monkeypatch, capsys):
    prepare_cli.main([str(config), "--tokenizer-only", "--quiet"])
    parts_dir = tmp_path / "data.parts"
    before = tree(parts_dir)
    real = parts.write_atomic

    def json_on_full_disk(path, data):
        (full_write if path.name == "tokenizer.json" else real)(path, data)

    monkeypatch.setattr(parts, "write_atomic", json_on_full_disk)
    err = fails([str(config), "--tokenizer-only", "data.valid_fraction=0.5", "--quiet"], capsys)
    assert f"cannot write {parts_dir}: the disk holding it is full" in err
    assert tree(parts_dir) == before


def test_only_failures_to_write_the_output_are_reported_as_the_disk(tmp_path):
    out = tmp_path / "data"
    assert write_error(OSError(errno.EIO, "Input/output error"), out) is None
    denied_input = PermissionError(errno.EACCES, "Permission denied", "/corpus/a.txt")
    assert write_error(denied_input, out) is None  # an input, not the output
    denied_parent = PermissionError(errno.EACCES, "Permission denied", str(tmp_path))
    assert "this user may not write there" in str(write_error(denied_parent, out / "gen-1"))
    copy = OSError(errno.ENOSPC, "No space left on device", "/corpus/t.model", None, str(out))
    assert str(write_error(copy, out)).startswith(
        f"cannot write {out}: the disk holding it is full"
    )


def test_a_failed_atomic_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    """write_atomic (checkpoints' and the data's small files): a write that fails leaves neither
    the file nor its temporary copy, and an earlier file stays whole."""
    import errno
    import os

    from moe.core.fileio import write_atomic

    target = tmp_path / "manifest.json"
    target.write_text("earlier")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        write_atomic(target, "newer")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]
    assert target.read_text() == "earlier"
