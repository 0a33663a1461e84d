"""Sources: compressed files, Hugging Face datasets on disk, Parquet directories, globs and
filters, each read into the same documents as their plain equivalent."""

import dataclasses
import gzip
import json
from pathlib import Path

import zstandard

from data_pipeline.config import SourceConfig
from data_pipeline.prepare import TOKENIZER_FILE, prepare
from data_pipeline.reader import TokenStream
from data_pipeline.sources import read_item, work_items
from data_pipeline.tokenizer import Tokenizer
from tests.data_pipeline.test_prepare import _texts_of


def documents(source: SourceConfig) -> list[str]:
    return [text for item in work_items(source)
            for _, text in read_item(source.type, source.field, item).docs]


def zstd_frames(data: bytes, frames: int) -> bytes:
    """``data`` as several concatenated zstd frames (what `zstd` writes when files are
    appended, and what a parallel compressor writes)."""
    step = len(data) // frames + 1
    return b"".join(zstandard.ZstdCompressor(level=3).compress(data[i:i + step])
                    for i in range(0, len(data), step))


def jsonl_bytes(texts: list[str]) -> bytes:
    return "".join(json.dumps({"body": t}) + "\n" for t in texts).encode()


TEXTS = [f"document {i}: " + "some words, é and 漢字. " * (i % 5 + 1) for i in range(200)]


def test_compressed_jsonl_and_text_read_like_plain_files(tmp_path):
    raw = jsonl_bytes(TEXTS)
    (tmp_path / "a.jsonl").write_bytes(raw)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "a.jsonl.zst").write_bytes(zstd_frames(raw, 3))
    (tmp_path / "really_gzip.jsonl").write_bytes(gzip.compress(raw))  # no suffix: magic bytes
    for name in ("a.jsonl", "a.jsonl.gz", "a.jsonl.zst", "really_gzip.jsonl"):
        source = SourceConfig(name="j", type="jsonl", paths=[str(tmp_path / name)], field="body")
        assert documents(source) == TEXTS, name
    # A compressed file is one work item; the ids are offsets in the decompressed bytes, so
    # they agree with those of the plain file.
    plain = SourceConfig(name="j", type="jsonl", paths=[str(tmp_path / "a.jsonl")], field="body")
    zst = dataclasses.replace(plain, paths=[str(tmp_path / "a.jsonl.zst")])
    (item,) = work_items(zst)
    assert item.part is None
    ids = [i.split("@")[1] for i, _ in read_item("jsonl", "body", item).docs]
    assert ids == [i.split("@")[1] for it in work_items(plain)
                   for i, _ in read_item("jsonl", "body", it).docs]

    text = "\n\n".join(TEXTS)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "plain.txt").write_text(text)
    (corpus / "b.txt.gz").write_bytes(gzip.compress(text.encode()))
    (corpus / "c.txt.zst").write_bytes(zstd_frames(text.encode(), 2))
    (corpus / "d.txt").write_bytes(gzip.compress(text.encode()))  # a .txt that is really gzip
    assert documents(SourceConfig(name="t", type="text", paths=[str(corpus)])) == [text] * 4


def test_prepare_reads_compressed_sources(tiny_data, tmp_path):
    raw = jsonl_bytes(TEXTS)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "b.jsonl.zst").write_bytes(zstd_frames(raw, 2))
    cfg = dataclasses.replace(
        tiny_data, dir=str(tmp_path / "data"), valid_fraction=0.1, prepare_workers=1,
        tokenizer=dataclasses.replace(tiny_data.tokenizer,
                                      model_file=str(Path(tiny_data.dir) / TOKENIZER_FILE)),
        sources=[SourceConfig(name="gz", type="jsonl", paths=[str(tmp_path / "a.jsonl.gz")],
                              field="body"),
                 SourceConfig(name="zst", type="jsonl", paths=[str(tmp_path / "b.jsonl.zst")],
                              field="body")])
    prepare(cfg, progress=False)
    tok = Tokenizer(Path(cfg.dir) / TOKENIZER_FILE)
    for name in ("gz", "zst"):
        got = [t for split in ("train", "valid") for t in _texts_of(tok, TokenStream(cfg.dir, split, name))]
        assert sorted(got) == sorted(TEXTS)
