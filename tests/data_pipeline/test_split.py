"""The validation split follows the documents' text: the same documents in any container,
compression, sharding or order, with any worker count, --part split or byte-range cuts, get the
same split; copies of a text share it; ``dedup: exact`` keeps the first copy; data made by the
older location rule stays usable and a preparation over it says what moves."""

import dataclasses
import gzip
import json
import random
import shutil
import unicodedata
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from data_pipeline import generations, sources
from data_pipeline.config import SourceConfig
from data_pipeline.errors import DataError
from data_pipeline.prepare import prepare
from data_pipeline.prepared import PreparedData
from data_pipeline.reader import PackedReader
from data_pipeline.shards import MANIFEST, read_manifest
from data_pipeline.split import content_key, in_valid_split, in_valid_split_by_location
from data_pipeline.token_stream import TokenStream
from data_pipeline.tokenizer import Tokenizer
from launch import prepare as prepare_cli
from tests.conftest import tiny_run_dict
from tests.data_pipeline.conftest import prepare_in_parts
from tests.data_pipeline.test_prepare import _texts_of
from tests.data_pipeline.test_sources import TEXTS, jsonl_bytes, save_to_disk, zstd_frames


def _config(tiny_data, out: Path, sources_: list[SourceConfig], **kw):
    return dataclasses.replace(
        tiny_data,
        dir=str(out),
        valid_fraction=0.1,
        sources=sources_,
        tokenizer=dataclasses.replace(
            tiny_data.tokenizer, model_file=str(PreparedData(tiny_data.dir).tokenizer_file())
        ),
        **{"prepare_workers": 1, **kw},
    )


def _docs(cfg, split: str, source: str) -> list[str]:
    tok = Tokenizer(PreparedData(cfg.dir).tokenizer_file())
    return _texts_of(tok, TokenStream(cfg.dir, split, source))


def _valid(text: str) -> bool:
    return in_valid_split(content_key(text), 0.1)


def test_the_same_documents_in_six_containers_give_the_same_streams(tiny_data, tmp_path):
    raw = jsonl_bytes(TEXTS).replace(b'"body"', b'"text"')
    (tmp_path / "a.jsonl").write_bytes(raw)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "a.jsonl.zst").write_bytes(zstd_frames(raw, 3))
    table = pa.table({"text": TEXTS})
    (tmp_path / "pq").mkdir()
    pq.write_table(table.slice(0, 120), tmp_path / "pq" / "part-0.parquet", row_group_size=30)
    pq.write_table(table.slice(120), tmp_path / "pq" / "part-1.parquet", row_group_size=30)
    pq.write_table(table, tmp_path / "one.parquet", row_group_size=len(TEXTS))
    save_to_disk(tmp_path / "hf", "by_hand")
    containers = {
        "jsonl": ("jsonl", "a.jsonl"),
        "gz": ("jsonl", "a.jsonl.gz"),
        "zst": ("jsonl", "a.jsonl.zst"),
        "pqdir": ("parquet", "pq"),
        "pqfile": ("parquet", "one.parquet"),
        "hf": ("hf_disk", "hf"),
    }
    cfg = _config(
        tiny_data,
        tmp_path / "data",
        [
            SourceConfig(name=name, type=kind, paths=[str(tmp_path / path)])
            for name, (kind, path) in containers.items()
        ],
    )
    prepare(cfg, progress=False)
    want_valid = [t for t in TEXTS if _valid(t)]
    assert 5 < len(want_valid) < 40
    for split in ("train", "valid"):
        streams = {name: TokenStream(cfg.dir, split, name) for name in containers}
        tokens = {name: s.read(0, len(s)).tolist() for name, s in streams.items()}
        assert all(t == tokens["jsonl"] for t in tokens.values()), split
    assert _docs(cfg, "valid", "hf") == want_valid
    assert read_manifest(cfg.dir).split_rule == "content-v1"


def _copies(text: str) -> list[str]:
    """Texts equal to ``text`` after strip and NFC: what the split and dedup call copies."""
    return [f"  {text}\n", unicodedata.normalize("NFD", text), f"\t{text} "]


def _corpus_with_copies(root: Path) -> tuple[list[SourceConfig], str]:
    """Two sources: a JSONL file whose first document is a validation document, and Parquet
    files holding copies of it (and of a training document) among other documents."""
    (first,) = [t for t in TEXTS if _valid(t) and "é" in t][:1]
    train_doc = next(t for t in TEXTS if not _valid(t))
    root.mkdir()
    others = [t for t in TEXTS if t not in (first, train_doc)]
    (root / "a.jsonl").write_bytes(jsonl_bytes([first, train_doc, *others[:100], first]))
    more = [*_copies(first), train_doc, *others[100:], *_copies(first), train_doc]
    random.Random(0).shuffle(more)
    (root / "pq").mkdir()
    pq.write_table(pa.table({"body": more[:50]}), root / "pq" / "x.parquet", row_group_size=20)
    pq.write_table(pa.table({"body": more[50:]}), root / "pq" / "y.parquet", row_group_size=20)
    return [
        SourceConfig(name="j", type="jsonl", paths=[str(root / "a.jsonl")], field="body"),
        SourceConfig(name="p", type="parquet", paths=[str(root / "pq")], field="body"),
    ], first


def test_copies_of_a_validation_document_never_reach_training(tiny_data, tmp_path):
    srcs, first = _corpus_with_copies(tmp_path / "in")
    cfg = _config(tiny_data, tmp_path / "data", srcs)
    prepare(cfg, progress=False)
    norm = unicodedata.normalize("NFC", first).strip()
    for name in ("j", "p"):
        train = [unicodedata.normalize("NFC", d).strip() for d in _docs(cfg, "train", name)]
        valid = [unicodedata.normalize("NFC", d).strip() for d in _docs(cfg, "valid", name)]
        assert norm not in train and norm in valid
    assert [s["duplicates_dropped"] for s in read_manifest(cfg.dir).sources] == [0, 0]
    assert _docs(cfg, "valid", "j").count(first) == 2 and len(_docs(cfg, "valid", "p")) >= 6


def test_a_source_of_copies_is_refused_saying_they_are_copies(tiny_data, tmp_path):
    """A source made only of copies of another source's validation documents has nothing to
    train on (with dedup: nothing at all). The preparation refuses it, since its mixture
    weight could not be honoured, and says why: not that data.valid_fraction is too high
    (no fraction parts a copy from its original) or that its documents are empty."""
    root = tmp_path / "in"
    root.mkdir()
    (root / "a.jsonl").write_bytes(jsonl_bytes(TEXTS))
    valid = [t for t in TEXTS if _valid(t)][:8]
    (root / "b.jsonl").write_bytes(jsonl_bytes([c for t in valid for c in (t, f"  {t}\n")]))
    extra = next(t for t in (f"another text, number {i}" for i in range(1000)) if _valid(t))
    (root / "c.jsonl").write_bytes(jsonl_bytes([valid[0], extra, " "]))
    a, b, c = (
        SourceConfig(name=n, type="jsonl", paths=[str(root / f"{n}.jsonl")], field="body")
        for n in "abc"
    )
    cases = {
        ("none", "b"): "all its 16 documents are copies of validation documents of "
        "source 'a'; a copy goes to the split of its text",
        ("exact", "b"): "all its 16 documents are exact copies of documents before them; "
        "data.dedup: exact keeps only the first copy",
        ("none", "c"): "of its 3 documents, 1 is a copy of a validation document of "
        "source 'a', 1 is in the validation split by the hash of its text, "
        "1 is empty",
    }
    for (dedup, name), want in cases.items():
        cfg = _config(
            tiny_data, tmp_path / f"{dedup}-{name}", [a, b if name == "b" else c], dedup=dedup
        )
        with pytest.raises(DataError) as e:
            prepare(cfg, progress=False)
        assert str(e.value).startswith(
            f"source {name!r} ({root / name}.jsonl) has no documents to train on: "
        ) and want in str(e.value), str(e.value)
        assert "lower" not in str(e.value) and not Path(cfg.dir).exists()
    cfg = _config(
        tiny_data, tmp_path / "chance", [a, dataclasses.replace(c, paths=[str(root / "d.jsonl")])]
    )
    (root / "d.jsonl").write_bytes(jsonl_bytes([extra]))
    with pytest.raises(
        DataError,
        match="its only document is in the validation split by the "
        "hash of its text; add documents, or lower "
        "data.valid_fraction",
    ):
        prepare(cfg, progress=False)


def _run_yaml(cfg, tmp_path) -> Path:
    run = tiny_run_dict(cfg, tmp_path / "runs")
    run["data"] = {k: v for k, v in dataclasses.asdict(cfg).items()}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run))
    return path


def test_exact_dedup_keeps_the_first_copy_whatever_the_workers_or_parts(
    tiny_data, tmp_path, capsys
):
    srcs, first = _corpus_with_copies(tmp_path / "in")
    one = _config(tiny_data, tmp_path / "one", srcs, dedup="exact")
    prepare(one, progress=False)
    stats = {s["name"]: s for s in read_manifest(one.dir).sources}
    # j: its second copy of `first`; p: 6 copies of `first` and 2 of the training document.
    assert (stats["j"]["duplicates_dropped"], stats["p"]["duplicates_dropped"]) == (1, 8)
    assert _docs(one, "valid", "j").count(first) == 1
    everything = [d for n in ("j", "p") for s in ("train", "valid") for d in _docs(one, s, n)]
    keys = [content_key(d) for d in everything]
    assert len(set(keys)) == len(keys) == len(TEXTS)
    assert (
        read_manifest(one.dir).config_hash
        != read_manifest(
            prepare(_config(tiny_data, tmp_path / "all", srcs), progress=False).data_dir
        ).config_hash
    )

    two = dataclasses.replace(one, dir=str(tmp_path / "two"), prepare_workers=2)
    prepare_cli.main([str(_run_yaml(two, tmp_path)), "--quiet"])
    out = capsys.readouterr().out
    assert "source 'p': 8 duplicate documents dropped (data.dedup: exact)" in out
    parts = dataclasses.replace(one, dir=str(tmp_path / "parts"))
    prepare_in_parts(parts, 3)
    for other in (two, parts):
        assert (Path(other.dir) / MANIFEST).read_bytes() == (Path(one.dir) / MANIFEST).read_bytes()


def test_split_does_not_depend_on_files_order_workers_cuts_or_parts(
    tiny_data, tmp_path, monkeypatch
):
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "all.jsonl").write_bytes(jsonl_bytes(TEXTS))
    shuffled = TEXTS[:]
    random.Random(1).shuffle(shuffled)
    (tmp_path / "three").mkdir()
    for i in range(3):
        (tmp_path / "three" / f"{'cba'[i]}.jsonl").write_bytes(jsonl_bytes(shuffled[i::3]))

    def source(directory: str) -> list[SourceConfig]:
        return [
            SourceConfig(
                name="j", type="jsonl", field="body", paths=[str(tmp_path / directory / "*.jsonl")]
            )
        ]

    whole = _config(tiny_data, tmp_path / "whole", source("one"))
    prepare(whole, progress=False)
    monkeypatch.setattr(sources, "JSONL_MIN_CHUNK_BYTES", 512)  # ranges cut mid-line
    cut = _config(tiny_data, tmp_path / "cut", source("three"), prepare_workers=2)
    assert len(sources.work_items(cut.sources[0])) > 20
    prepare(cut, progress=False)
    parts = dataclasses.replace(cut, dir=str(tmp_path / "parts"))
    prepare_in_parts(parts, 3)
    for split in ("train", "valid"):
        want = sorted(_docs(whole, split, "j"))
        assert want and sorted(_docs(cut, split, "j")) == want
        assert sorted(_docs(parts, split, "j")) == want


def test_data_of_the_location_rule_is_used_and_a_new_preparation_says_what_moves(
    tiny_data, tmp_path, monkeypatch, capsys
):
    old = tmp_path / "data"
    shutil.copytree(tiny_data.dir, old)
    raw = json.loads((old / MANIFEST).read_text())
    del raw["split_rule"]  # as written before the rule was recorded
    (old / MANIFEST).write_text(json.dumps(raw))
    cfg = dataclasses.replace(tiny_data, dir=str(old), prepare_workers=1)
    assert prepare(cfg, progress=False).skipped
    assert "split by document location" in capsys.readouterr().err
    assert read_manifest(old).split_rule is None
    PackedReader(old, 8, 0).micro_batches(1)

    source = tiny_data.sources[0]
    docs = [
        (it.name, Path(it.path).read_text(encoding="utf-8")) for it in sources.work_items(source)
    ]
    docs = [(name, text) for name, text in docs if text.strip()]
    moved = sum(
        in_valid_split(content_key(text), cfg.valid_fraction)
        != in_valid_split_by_location(source.name, name, cfg.valid_fraction)
        for name, text in docs
    )
    assert moved > 0
    real_switch, said = generations.write_manifest, []

    def switch(data_dir, manifest):  # the manifest write that switches to the new data
        said.append(capsys.readouterr().err)  # what was said before anything was replaced
        assert read_manifest(data_dir).split_rule is None
        real_switch(data_dir, manifest)

    monkeypatch.setattr(generations, "write_manifest", switch)
    prepare(cfg, force=True, progress=False)
    assert f"{moved:,} of its {len(docs):,} documents change split" in said[0]
    assert read_manifest(old).split_rule == "content-v1"
