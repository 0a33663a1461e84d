"""moe-prepare --verify reports its progress: a log line off a terminal, nothing when quiet."""

from pathlib import Path

from data_pipeline.shards import read_manifest
from data_pipeline.verify import verify


def test_verify_reports_progress_unless_quiet(tiny_data, capsys):
    manifest = read_manifest(tiny_data.dir)
    files = [s.file for split in manifest.splits.values() for s in split.shards]
    total = sum((Path(tiny_data.dir) / f).stat().st_size for f in files)
    verify(tiny_data.dir, progress=True)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"verify {tiny_data.dir}: ")
    assert f"of {total / 1e6:,.1f} MB (100%)" in err[0] and err[0].endswith("(done)")
    tokens = sum(s.tokens for split in manifest.splits.values() for s in split.shards)
    assert f"{tokens:,} tokens" in err[0]
    verify(tiny_data.dir, progress=False)
    assert capsys.readouterr().err == ""
