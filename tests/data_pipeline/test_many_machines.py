"""Preparation on many machines: --tokenizer-only, --part i/N on each, --merge; byte for byte
the data one machine prepares from the same config."""

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import yaml

from data_pipeline.errors import DataError
from data_pipeline.parts import merge_parts, parts_dir, prepare_part
from data_pipeline.prepared import PreparedData
from data_pipeline.shards import MANIFEST, read_manifest
from launch import prepare as prepare_cli
from tests.conftest import tiny_run_dict


def digests(data_dir: Path) -> dict[str, str]:
    return {
        p.relative_to(data_dir).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(data_dir).rglob("*"))
        if p.is_file()
    }


def test_parts_merged_equal_one_machine_byte_for_byte(mixed_data, tmp_path, capsys):
    # The one-machine data is mixed_data (two sources, several shards each, a trained tokenizer).
    single = Path(mixed_data.dir)
    assert len(read_manifest(single).splits["train"].shards) > 2
    run = tiny_run_dict(mixed_data, tmp_path / "runs")
    run["data"] = {
        **run["data"],
        **{k: v for k, v in dataclasses.asdict(mixed_data).items() if k != "dir"},
        "dir": str(tmp_path / "data"),
    }
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(run))
    cfg = dataclasses.replace(mixed_data, dir=str(tmp_path / "data"))

    with pytest.raises(SystemExit):  # parts before the tokenizer: a clear refusal
        prepare_cli.main([str(config), "--part", "0/3", "--quiet"])
    assert "--tokenizer-only first" in capsys.readouterr().err
    prepare_cli.main([str(config), "--tokenizer-only", "--quiet"])
    for i in (2, 0):
        prepare_cli.main([str(config), "--part", f"{i}/3", "--quiet"])
    with pytest.raises(DataError, match="part-00001-of-00003: missing"):
        merge_parts(cfg, progress=False)
    assert not Path(cfg.dir).exists()
    prepare_part(cfg, 1, 3, progress=False)
    prepare_cli.main([str(config), "--merge", "--quiet"])
    assert "prepared in" in capsys.readouterr().out

    assert digests(cfg.dir) == digests(single)  # every shard, the tokenizer and the manifest
    assert (Path(cfg.dir) / MANIFEST).read_bytes() == (single / MANIFEST).read_bytes()
    assert not parts_dir(cfg).exists()


def test_parts_of_other_inputs_are_refused(mixed_data, tmp_path):
    corpus = tmp_path / "corpus"
    shutil.copytree(mixed_data.sources[0].paths[0], corpus)
    sources = [
        dataclasses.replace(mixed_data.sources[0], paths=[str(corpus)]),
        mixed_data.sources[1],
    ]
    cfg = dataclasses.replace(mixed_data, dir=str(tmp_path / "data"), sources=sources)
    parts = parts_dir(cfg)
    parts.mkdir()
    shutil.copyfile(PreparedData(mixed_data.dir).tokenizer_file(), parts / "tokenizer.model")
    from data_pipeline.prepare import config_hash

    (parts / "tokenizer.json").write_text(f'{{"config_hash": "{config_hash(cfg)}"}}')
    prepare_part(cfg, 0, 2, progress=False)
    (corpus / "new.txt").write_text("a file that appeared after part 0 listed its inputs\n")
    prepare_part(cfg, 1, 2, progress=False)
    with pytest.raises(DataError, match="part-00000-of-00002 saw other input files"):
        merge_parts(cfg, progress=False)
    marker = parts / "part-00000-of-00002" / "part.json"
    raw = json.loads(marker.read_text())
    del raw["split_rule"]  # a part made before the split followed the documents
    marker.write_text(json.dumps(raw))
    with pytest.raises(DataError, match="part-00000-of-00002 was split by an earlier rule"):
        merge_parts(cfg, progress=False)
    with pytest.raises(DataError, match="made for another data config"):
        prepare_part(dataclasses.replace(cfg, valid_fraction=0.5), 0, 2, progress=False)
