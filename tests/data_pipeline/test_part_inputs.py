"""Parts (moe-prepare --part i/N) record what they were made from, and --merge checks it: an input
changed since a part (or the tokenizer) read it, or a part's file deleted or truncated, is
refused with the file named, what is wrong and the command that redoes it (exit 2)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import yaml
import zstandard

from data_pipeline.config import SourceConfig
from data_pipeline.prepare import parts_dir
from data_pipeline.prepared import PreparedData
from data_pipeline.shards import read_manifest
from launch import prepare as prepare_cli
from tests.conftest import tiny_run_dict, write_corpus
from tests.data_pipeline.conftest import write_jsonl


def _zst_inputs(root: Path) -> Path:
    """The corpus's paragraphs as two .jsonl.zst files."""
    lines = write_jsonl(root / "corpus", root / "all.jsonl").read_bytes().splitlines(keepends=True)
    out = root / "in"
    out.mkdir()
    half = len(lines) // 2
    for name, chunk in (("a", lines[:half]), ("b", lines[half:])):
        (out / f"{name}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b"".join(chunk)))
    return out


def _setup(tiny_data, tmp_path: Path, trained: bool):
    write_corpus(tmp_path / "corpus")
    inputs = _zst_inputs(tmp_path)
    tokenizer = dataclasses.replace(
        tiny_data.tokenizer, sample_sentences=3000,
        model_file=None if trained else str(PreparedData(tiny_data.dir).tokenizer_file()))
    cfg = dataclasses.replace(
        tiny_data, dir=str(tmp_path / "data"), prepare_workers=1, tokenizer=tokenizer,
        sources=[SourceConfig(name="paras", type="jsonl", paths=[str(inputs / "*.jsonl.zst")],
                              field="body")])
    run = tiny_run_dict(cfg, tmp_path / "runs")
    run["data"] = {**dataclasses.asdict(cfg), "dir": cfg.dir}
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(run))
    return cfg, str(config), inputs


def _fails(argv: list[str], capsys) -> str:
    """moe-prepare's error message, after checking it exits 2 without a traceback."""
    with pytest.raises(SystemExit) as e:
        prepare_cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    return err


def _rewrite_fewer(path: Path) -> None:
    """Rewrite a .zst with about half its documents (a later mtime, as any rewrite has)."""
    lines = zstandard.ZstdDecompressor().decompressobj().decompress(path.read_bytes()).splitlines(True)
    before = path.stat().st_mtime_ns
    path.write_bytes(zstandard.ZstdCompressor().compress(b"".join(lines[:len(lines) // 2])))
    os.utime(path, ns=(before + 10**9, before + 10**9))


def test_merge_refuses_parts_of_a_rewritten_input(tiny_data, tmp_path, capsys):
    cfg, config, inputs = _setup(tiny_data, tmp_path, trained=False)
    prepare_cli.main([config, "--tokenizer-only", "--quiet"])
    for i in (0, 1):
        prepare_cli.main([config, "--part", f"{i}/2", "--quiet"])
    marker = json.loads((parts_dir(cfg) / "part-00001-of-00002" / "part.json").read_text())
    b = str(inputs / "b.jsonl.zst")
    assert marker["inputs"] == {b: [os.stat(b).st_size, os.stat(b).st_mtime_ns]}
    assert len(marker["read_sha256"]["paras/1"]) == 64
    _rewrite_fewer(inputs / "b.jsonl.zst")
    err = _fails([config, "--merge", "--quiet"], capsys)
    assert f"{b} changed after part-00001-of-00002 read it" in err
    assert "run moe-prepare CONFIG --part 1/2 again" in err
    assert not Path(cfg.dir).exists()
    prepare_cli.main([config, "--part", "1/2", "--quiet"])  # the command the error names
    prepare_cli.main([config, "--merge", "--quiet"])
    assert read_manifest(cfg.dir).sources[0]["documents"]["train"] > 0


def test_merge_refuses_a_tokenizer_trained_on_a_rewritten_input(tiny_data, tmp_path, capsys):
    cfg, config, inputs = _setup(tiny_data, tmp_path, trained=True)
    prepare_cli.main([config, "--tokenizer-only", "--quiet"])
    prepare_cli.main([config, "--part", "0/1", "--quiet"])
    _rewrite_fewer(inputs / "a.jsonl.zst")
    err = _fails([config, "--merge", "--quiet"], capsys)
    assert f"{inputs / 'a.jsonl.zst'} changed after" in err and "tokenizer.model was trained" in err
    assert "--tokenizer-only again" in err
    err = _fails([config, "--part", "0/1", "--quiet"], capsys)  # refused before any work
    assert "--tokenizer-only again" in err


def test_merge_names_a_damaged_part_file_and_the_command_that_redoes_it(tiny_data, tmp_path,
                                                                        capsys):
    cfg, config, _ = _setup(tiny_data, tmp_path, trained=False)
    prepare_cli.main([config, "--tokenizer-only", "--quiet"])
    for i in (0, 1):
        prepare_cli.main([config, "--part", f"{i}/2", "--quiet"])
    for part, damage in ((0, "delete"), (1, "truncate")):
        victim = parts_dir(cfg) / f"part-0000{part}-of-00002" / f"paras-{part}.bin"
        size = victim.stat().st_size
        if damage == "delete":
            victim.unlink()
        else:
            os.truncate(victim, size - 100)
        err = _fails([config, "--merge", "--quiet"], capsys)
        assert str(victim) in err and f"run moe-prepare CONFIG --part {part}/2 again" in err
        assert ("missing from its part" if damage == "delete" else
                f"damaged part file, {size - 100:,} bytes where {size:,} were written") in err
        assert not Path(cfg.dir).exists()
        prepare_cli.main([config, "--part", f"{part}/2", "--quiet"])
    prepare_cli.main([config, "--merge", "--quiet"])
