"""Sources: compressed files, Hugging Face datasets on disk, Parquet directories, globs and
filters, each read into the same documents as their plain equivalent."""

import dataclasses
import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from data_pipeline.config import DataConfig, FilterConfig, SourceConfig
from data_pipeline.errors import DataError
from data_pipeline.prepare import prepare
from data_pipeline.prepared import PreparedData
from data_pipeline.shards import read_manifest
from data_pipeline.sources import read_item, work_items
from data_pipeline.token_stream import TokenStream
from data_pipeline.tokenizer import Tokenizer
from moe.core.config_schema import from_dict
from moe.core.errors import ConfigError
from tests.data_pipeline.test_prepare import _texts_of


def documents(source: SourceConfig) -> list[str]:
    return [text for item in work_items(source) for _, text in read_item(source, item).docs]


def zstd_frames(data: bytes, frames: int) -> bytes:
    """``data`` as several concatenated zstd frames (what `zstd` writes when files are
    appended, and what a parallel compressor writes)."""
    step = len(data) // frames + 1
    return b"".join(
        zstandard.ZstdCompressor(level=3).compress(data[i : i + step])
        for i in range(0, len(data), step)
    )


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
    ids = [i.split("@")[1] for i, _ in read_item(zst, item).docs]
    assert ids == [
        i.split("@")[1] for it in work_items(plain) for i, _ in read_item(plain, it).docs
    ]

    text = "\n\n".join(TEXTS)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "plain.txt").write_text(text)
    (corpus / "b.txt.gz").write_bytes(gzip.compress(text.encode()))
    (corpus / "c.txt.zst").write_bytes(zstd_frames(text.encode(), 2))
    (corpus / "d.txt").write_bytes(gzip.compress(text.encode()))  # a .txt that is really gzip
    assert documents(SourceConfig(name="t", type="text", paths=[str(corpus)])) == [text] * 4


def test_prepare_reads_compressed_sources_and_filtered_datasets(tiny_data, tmp_path):
    save_to_disk(tmp_path / "hf", "by_hand")
    raw = jsonl_bytes(TEXTS)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "b.jsonl.zst").write_bytes(zstd_frames(raw, 2))
    cfg = dataclasses.replace(
        tiny_data,
        dir=str(tmp_path / "data"),
        valid_fraction=0.1,
        prepare_workers=1,
        tokenizer=dataclasses.replace(
            tiny_data.tokenizer, model_file=str(PreparedData(tiny_data.dir).tokenizer_file())
        ),
        sources=[
            SourceConfig(
                name="gz", type="jsonl", paths=[str(tmp_path / "a.jsonl.gz")], field="body"
            ),
            SourceConfig(
                name="zst", type="jsonl", paths=[str(tmp_path / "b.jsonl.zst")], field="body"
            ),
            SourceConfig(
                name="en",
                type="hf_disk",
                paths=[str(tmp_path / "hf")],
                filter=FilterConfig(column="lang", value="en"),
            ),
        ],
    )
    prepare(cfg, progress=False)
    tok = Tokenizer(PreparedData(cfg.dir).tokenizer_file())
    for name, want in (("gz", TEXTS), ("zst", TEXTS), ("en", ENGLISH)):
        got = [
            t
            for split in ("train", "valid")
            for t in _texts_of(tok, TokenStream(cfg.dir, split, name))
        ]
        assert sorted(got) == sorted(want)
    stats = {s["name"]: s for s in read_manifest(cfg.dir).sources}
    assert stats["en"]["filtered_documents"] == len(TEXTS) - len(ENGLISH)
    assert stats["en"]["filter"] == {"column": "lang", "value": "en"}


LANGS = ["en", "de", "en", "fr"]
ROWS = {
    "text": TEXTS,
    "lang": [LANGS[i % 4] for i in range(len(TEXTS))],
    "n": list(range(len(TEXTS))),
}
ENGLISH = [t for t, lang in zip(ROWS["text"], ROWS["lang"]) if lang == "en"]


def save_to_disk(directory: Path, how: str) -> None:
    """ROWS as a dataset written by ``datasets.save_to_disk`` (2 files), or the same layout
    written by hand: Arrow IPC *stream* files of 50-row batches, state.json, dataset_info.json."""
    if how == "datasets":
        datasets = pytest.importorskip("datasets")
        datasets.Dataset.from_dict(ROWS).save_to_disk(str(directory), num_shards=2)
        return
    directory.mkdir(parents=True)
    table = pa.table(ROWS)
    names = [f"data-0000{i}-of-00002.arrow" for i in range(2)]
    for name, part in zip(names, (table.slice(0, 100), table.slice(100))):
        with pa.ipc.new_stream(str(directory / name), table.schema) as w:
            for batch in part.to_batches(max_chunksize=50):
                w.write_batch(batch)
    (directory / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": n} for n in names], "_split": None})
    )
    (directory / "dataset_info.json").write_text("{}")


@pytest.mark.parametrize("how", ["datasets", "by_hand"])
def test_hf_disk_source_reads_save_to_disk_with_a_filter(tmp_path, how):
    save_to_disk(tmp_path / "hf", how)
    source = SourceConfig(name="hf", type="hf_disk", paths=[str(tmp_path / "hf")])
    assert documents(source) == TEXTS
    english = dataclasses.replace(source, filter=FilterConfig(column="lang", value="en"))
    docs = [read_item(english, item) for item in work_items(english)]
    assert [t for d in docs for _, t in d.docs] == ENGLISH
    assert sum(d.filtered for d in docs) == len(TEXTS) - len(ENGLISH)
    # Row ids do not depend on the filter: the split of a kept row stays where it was.
    all_ids = {t: i for item in work_items(source) for i, t in read_item(source, item).docs}
    assert all(all_ids[t] == i for d in docs for i, t in d.docs)
    small = dataclasses.replace(source, filter=FilterConfig(column="n", value=3))
    assert documents(small) == [TEXTS[3]]


def test_hf_disk_refuses_a_dataset_dict_and_unsafe_state(tmp_path):
    save_to_disk(tmp_path / "dd" / "train", "by_hand")
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    with pytest.raises(DataError, match="DatasetDict.*train"):
        work_items(SourceConfig(name="hf", type="hf_disk", paths=[str(tmp_path / "dd")]))
    hf = tmp_path / "dd" / "train"
    (hf / "state.json").write_text(json.dumps({"_data_files": [{"filename": "../../etc/passwd"}]}))
    with pytest.raises(DataError, match="state.json.*not a file name"):
        work_items(SourceConfig(name="hf", type="hf_disk", paths=[str(hf)]))


def test_parquet_directory_from_the_hub_globs_and_filters(tmp_path):
    hub = tmp_path / "hub"
    (hub / "data").mkdir(parents=True)
    (hub / ".cache").mkdir()
    table = pa.table(ROWS)
    pq.write_table(
        table.slice(0, 120), hub / "data" / "train-00000-of-00002.parquet", row_group_size=50
    )
    pq.write_table(table.slice(120), hub / "data" / "train-00001-of-00002.parquet")
    (hub / "README.md").write_text("---\nlicense: mit\n---\n")
    (hub / ".gitattributes").write_text("*.parquet filter=lfs\n")
    (hub / ".cache" / "stale.parquet").write_bytes(b"not parquet")
    source = SourceConfig(name="hub", type="parquet", paths=[str(hub)])
    assert documents(source) == TEXTS
    globbed = dataclasses.replace(
        source,
        paths=[str(hub / "**" / "train-*.parquet")],
        filter=FilterConfig(column="lang", value="en"),
    )
    assert documents(globbed) == ENGLISH
    assert [i.name for i in work_items(globbed)][0] == "data/train-00000-of-00002.parquet"


def test_globs_reach_compressed_files_in_subdirectories(tmp_path):
    for i, chunk in enumerate((TEXTS[:70], TEXTS[70:150], TEXTS[150:])):
        path = tmp_path / "corpus" / f"part{i}" / f"x{i}.jsonl.gz"
        path.parent.mkdir(parents=True)
        path.write_bytes(gzip.compress(jsonl_bytes(chunk)))
    (tmp_path / "corpus" / "part0" / "notes.txt").write_text("not matched")
    source = SourceConfig(
        name="j", type="jsonl", field="body", paths=[str(tmp_path / "corpus" / "**" / "*.jsonl.gz")]
    )
    assert documents(source) == TEXTS


def test_bad_columns_and_filters_name_the_file(tmp_path):
    pq.write_table(pa.table(ROWS), tmp_path / "t.parquet")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1" + b"\x00" * 100)
    base = SourceConfig(name="p", type="parquet", paths=[str(tmp_path / "t.parquet")])
    cases = [
        (dataclasses.replace(base, field="body"), "no column 'body' \\(the source's text"),
        (
            dataclasses.replace(base, filter=FilterConfig(column="language", value="en")),
            "no column 'language' \\(the source's filter",
        ),
        (
            dataclasses.replace(base, filter=FilterConfig(column="n", value="en")),
            "column 'n' is int64, which cannot be compared",
        ),
    ]
    for source, message in cases:
        with pytest.raises(DataError, match=f"t.parquet.*{message}"):
            documents(source)
    with pytest.raises(DataError, match="broken.parquet: not a readable Parquet file"):
        documents(dataclasses.replace(base, paths=[str(tmp_path / "broken.parquet")]))
    (tmp_path / "a.jsonl").write_text('{"text": "x", "lang": "en"}\n{"text": "y"}\n')
    with pytest.raises(DataError, match=r"a.jsonl: line 2 \(byte 28\) has no field 'lang'"):
        documents(
            SourceConfig(
                name="j",
                type="jsonl",
                paths=[str(tmp_path / "a.jsonl")],
                filter=FilterConfig(column="lang", value="en"),
            )
        )


def test_filter_config_is_validated():
    with pytest.raises(ConfigError) as e:
        from_dict(
            DataConfig,
            {
                "sources": [
                    {
                        "name": "t",
                        "type": "text",
                        "paths": ["x"],
                        "filter": {"column": "lang", "value": "en"},
                    },
                    {"name": "p", "type": "parquet", "paths": ["y"], "filter": {"value": "en"}},
                    {"name": "r", "type": "parquet", "paths": ["y"], "filter": {"column": "lang"}},
                    {
                        "name": "q",
                        "type": "parquet",
                        "paths": ["z"],
                        "filter": {"column": "a", "valu": 1},
                    },
                ]
            },
        )
    msg = str(e.value)
    assert "sources[0].filter: a 'text' source has no columns to filter on" in msg
    assert "sources[1].filter.column: name the column to filter on" in msg
    assert "sources[2].filter.value: give the value of 'lang'" in msg
    assert "did you mean 'sources[3].filter.value'" in msg
    cfg = from_dict(
        DataConfig,
        {
            "sources": [
                {
                    "name": "p",
                    "type": "hf_disk",
                    "paths": ["y"],
                    "filter": {"column": "ok", "value": True},
                }
            ]
        },
    )
    assert cfg.sources[0].filter == FilterConfig(column="ok", value=True)


def test_python_source_reads_docstrings_and_comments_of_py_files_only(tmp_path):
    """``type: python``: each ``.py`` file under a directory gives its docstrings and comments
    in source order (code left out); other files are skipped; a file that does not parse
    gives an empty document (counted) rather than its code."""
    pkg = tmp_path / "pkg" / "sub"
    pkg.mkdir(parents=True)
    (pkg / "mod.py").write_text(
        '"""Module doc."""\n# first comment\nx = 1  # trailing\n'
        'def f():\n    """Function doc."""\n    return "not text"\n'
    )
    (pkg / "notes.txt").write_text("not python")
    (tmp_path / "pkg" / "broken.py").write_text("def (:\n    # lost\n")
    source = SourceConfig(name="code", type="python", paths=[str(tmp_path / "pkg")])
    items = work_items(source)
    assert [i.name for i in items] == ["broken.py", "sub/mod.py"]
    broken, mod = (read_item(source, i) for i in items)
    assert mod.docs == [("sub/mod.py", "Module doc.\nfirst comment\ntrailing\nFunction doc.")]
    assert (broken.docs, broken.empty) == ([], 1)  # counted as an empty document
    with pytest.raises(ConfigError, match="paths"):
        from_dict(DataConfig, {"sources": [{"name": "code", "type": "python"}]})
