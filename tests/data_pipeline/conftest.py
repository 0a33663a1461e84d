"""A two-source data set (text files and JSONL), prepared once per session, for mixtures."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from data_pipeline.config import DataConfig, SourceConfig
from data_pipeline.parts import merge_parts, prepare_part, prepare_tokenizer
from data_pipeline.prepare import prepare
from tests.conftest import tiny_data_config, write_corpus


def write_jsonl(corpus: Path, out: Path) -> Path:
    """The corpus's paragraphs, upper-cased (text unlike the files source), as JSON lines: many
    small documents, with a distractor field."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for path in sorted(corpus.iterdir()):
            for i, para in enumerate(path.read_text(encoding="utf-8").split("\n\n")):
                f.write(json.dumps({"id": f"{path.name}:{i}", "body": para.upper()}) + "\n")
    return out


def mixed_config(root: Path) -> DataConfig:
    sources = [
        SourceConfig(name="files", type="text", paths=[str(root / "corpus")]),
        SourceConfig(
            name="paras", type="jsonl", paths=[str(root / "jsonl" / "*.jsonl")], field="body"
        ),
    ]
    return dataclasses.replace(
        tiny_data_config(root), sources=sources, shard_tokens=4096, seq_len=16, seed=3
    )


@pytest.fixture(scope="session")
def mixed_data(tmp_path_factory) -> DataConfig:
    root = tmp_path_factory.mktemp("mixed")
    write_corpus(root / "corpus")
    write_jsonl(root / "corpus", root / "jsonl" / "paras.jsonl")
    cfg = mixed_config(root)
    prepare(cfg, progress=False)
    return cfg


def prepare_in_parts(cfg: DataConfig, count: int) -> None:
    """The steps of a preparation on ``count`` machines, run here: the tokenizer, each part,
    the merge."""
    prepare_tokenizer(cfg, progress=False)
    for i in range(count):
        prepare_part(cfg, i, count, progress=False)
    merge_parts(cfg, progress=False)
