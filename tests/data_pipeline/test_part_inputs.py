"""Parts (moe-prepare --part i/N) record what they were made from, and --merge checks it: an input
changed since a part (or the tokenizer) read it, or a part's file deleted or truncated, is
refused with the file named, what is wrong and the command that redoes it (exit 2)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import pytest
import yaml
import zstandard

from data_pipeline.config import SourceConfig
from data_pipeline.parts import parts_dir
from data_pipeline.prepared import PreparedData
from data_pipeline.shards import read_manifest
from data_pipeline.tokenizer import Tokenizer
from data_pipeline.verify import verify
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
        (out / f"{name}.jsonl.zst").write_bytes(
            zstandard.ZstdCompressor().compress(b"".join(chunk))
        )
    return out


def _setup(tiny_data, tmp_path: Path, trained: bool):
    write_corpus(tmp_path / "corpus")
    inputs = _zst_inputs(tmp_path)
    tokenizer = dataclasses.replace(
        tiny_data.tokenizer,
        sample_sentences=3000,
        model_file=None if trained else str(PreparedData(tiny_data.dir).tokenizer_file()),
    )
    cfg = dataclasses.replace(
        tiny_data,
        dir=str(tmp_path / "data"),
        prepare_workers=1,
        tokenizer=tokenizer,
        sources=[
            SourceConfig(
                name="paras", type="jsonl", paths=[str(inputs / "*.jsonl.zst")], field="body"
            )
        ],
    )
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
    lines = (
        zstandard.ZstdDecompressor().decompressobj().decompress(path.read_bytes()).splitlines(True)
    )
    before = path.stat().st_mtime_ns
    path.write_bytes(zstandard.ZstdCompressor().compress(b"".join(lines[: len(lines) // 2])))
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


def test_merge_names_a_damaged_part_file_and_the_command_that_redoes_it(
    tiny_data, tmp_path, capsys
):
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
        assert (
            "missing from its part"
            if damage == "delete"
            else f"damaged part file, {size - 100:,} bytes where {size:,} were written"
        ) in err
        assert not Path(cfg.dir).exists()
        prepare_cli.main([config, "--part", f"{part}/2", "--quiet"])
    prepare_cli.main([config, "--merge", "--quiet"])


def _invert_middle(path: Path, count: int = 16) -> None:
    """Flip every bit of ``count`` bytes in the middle of a file: damage that keeps its size."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + count] = bytes(b ^ 0xFF for b in data[middle : middle + count])
    path.write_bytes(bytes(data))


def test_merge_refuses_a_part_file_damaged_without_a_change_of_size(tiny_data, tmp_path, capsys):
    """Sixteen bytes inverted in a part's token file: the size is the same, the content hash
    recorded when the part was written is not; the merge refuses it before the switch, and
    the data live in data.dir stays as it was."""
    cfg, config, _ = _setup(tiny_data, tmp_path, trained=False)
    prepare_cli.main([config, "--quiet"])  # the live data a --merge --force would replace
    live = {p: p.read_bytes() for p in sorted(Path(cfg.dir).rglob("*")) if p.is_file()}
    prepare_cli.main([config, "--tokenizer-only", "--quiet"])
    for i in (0, 1):
        prepare_cli.main([config, "--part", f"{i}/2", "--quiet"])
    part = parts_dir(cfg) / "part-00001-of-00002"
    victim = part / "paras-1.bin"
    marker = json.loads((part / "part.json").read_text())
    assert marker["sha256"]["paras/1"] == hashlib.sha256(victim.read_bytes()).hexdigest()
    size = victim.stat().st_size
    _invert_middle(victim)
    assert victim.stat().st_size == size
    err = _fails([config, "--merge", "--force", "--quiet"], capsys)
    assert f"{victim}: damaged part file: its SHA-256 is " in err
    assert "run moe-prepare CONFIG --part 1/2 again" in err
    assert {p: p.read_bytes() for p in sorted(Path(cfg.dir).rglob("*")) if p.is_file()} == live
    assert parts_dir(cfg).is_dir()
    prepare_cli.main([config, "--part", "1/2", "--quiet"])  # the command the error names
    prepare_cli.main([config, "--merge", "--force", "--quiet"])
    verify(cfg.dir, progress=False)


def test_merge_checks_token_ids_counts_and_hashes_recorded(tiny_data, tmp_path, capsys):
    """What a matching content hash leaves to other checks: a part file as its part wrote it
    but with a token id the tokenizer does not have, counts in part.json that do not fit the
    file, or no hashes recorded (a part of an earlier moe-prepare): each is refused."""
    cfg, config, _ = _setup(tiny_data, tmp_path, trained=False)
    prepare_cli.main([config, "--tokenizer-only", "--quiet"])
    vocab = Tokenizer(parts_dir(cfg) / "tokenizer.model").vocab_size
    part = parts_dir(cfg) / "part-00000-of-00002"
    redo = "run moe-prepare CONFIG --part 0/2 again"

    def damage(change) -> str:
        prepare_cli.main([config, "--part", "0/2", "--quiet"])
        marker = json.loads((part / "part.json").read_text())
        change(marker)
        (part / "part.json").write_text(json.dumps(marker))
        err = _fails([config, "--merge", "--quiet"], capsys)
        assert redo in err and not Path(cfg.dir).exists()
        return err

    def token_out_of_range(marker):  # the fourth token of the train split: id = vocab_size
        name, (train_docs, _), *_ = marker["items"]["paras/0"]
        data = bytearray((part / name).read_bytes())
        data[8 * train_docs + 12 : 8 * train_docs + 16] = vocab.to_bytes(4, "little")
        (part / name).write_bytes(bytes(data))
        marker["sha256"]["paras/0"] = hashlib.sha256(data).hexdigest()

    def counts_off_by_one(marker):
        marker["items"]["paras/0"][1][0] += 1

    prepare_cli.main([config, "--part", "1/2", "--quiet"])
    err = damage(token_out_of_range)
    assert (
        f"{part / 'paras-0.bin'}: damaged part file: token id {vocab} out of range for "
        f"the tokenizer's vocabulary of {vocab}"
    ) in err
    err = damage(counts_off_by_one)
    assert "its document counts in part.json do not fit the file" in err
    err = damage(lambda marker: marker.pop("sha256"))
    assert "records no content hashes of its files (made by an earlier moe-prepare)" in err
    prepare_cli.main([config, "--part", "0/2", "--quiet"])
    prepare_cli.main([config, "--merge", "--quiet"])
    verify(cfg.dir, progress=False)
