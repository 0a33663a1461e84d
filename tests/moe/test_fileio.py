"""moe/core/fileio.py: a write is complete or absent, and its failure names the file."""

import errno

import pytest

from moe.core import fileio


def test_a_write_that_fails_names_its_file_and_leaves_nothing(tmp_path, monkeypatch):
    """A full disk fails the flush of a buffered write, an OSError with no file name: the
    messages built from it read "a file: could not write"."""
    target = tmp_path / "out" / "report.png"
    target.parent.mkdir()
    target.write_bytes(b"the last good plot")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fileio.os, "fsync", full)
    with pytest.raises(OSError) as e:
        fileio.write_atomic(target, b"a new plot")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(target)
    assert target.read_bytes() == b"the last good plot"
    assert [p.name for p in target.parent.iterdir()] == ["report.png"]
