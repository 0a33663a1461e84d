"""Preparation: sources -> tokenizer -> Arrow shards + manifest, atomically."""

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_pipeline.config import DataConfig, SourceConfig, TokenizerConfig
from data_pipeline.errors import DataError
from data_pipeline.prepare import prepare
from data_pipeline.prepared import PreparedData
from data_pipeline.reader import PackedReader
from data_pipeline.shards import SCHEMA_VERSION, read_manifest, token_type
from data_pipeline.split import content_key, in_valid_split
from data_pipeline.token_stream import TokenStream
from data_pipeline.tokenizer import TOKENIZER_FILE, Tokenizer
from launch import prepare as prepare_cli


def test_round_trip_text_to_stream(tiny_data):
    """Tokenizing the corpus directly gives exactly the stream the shards hold."""
    manifest = read_manifest(tiny_data.dir)
    tok = Tokenizer(PreparedData(tiny_data.dir).tokenizer_file())
    assert (
        manifest.tokenizer["sha256"] == tok.sha256
        and manifest.tokenizer["file"] == f"gen-1/{TOKENIZER_FILE}"
    )
    assert tok.vocab_size == 512 and (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id) == (
        1,
        2,
        3,
        0,
    )
    src = tiny_data.sources[0]
    files = sorted(Path(src.paths[0]).iterdir())
    expected = {"train": [], "valid": []}
    for f in files:
        text = f.read_text(encoding="utf-8")
        split = "valid" if in_valid_split(content_key(text), tiny_data.valid_fraction) else "train"
        expected[split] += tok.encode(text) + [tok.eos_id]
    for f in files[:3]:  # identity normalization + byte fallback: decoding gives the text back
        text = f.read_text(encoding="utf-8")
        assert tok.decode(tok.encode(text)) == text
    for split in ("train", "valid"):
        stream = TokenStream(tiny_data.dir, split)
        assert stream.read(0, len(stream)).tolist() == expected[split]
        assert len(stream) == manifest.splits[split].tokens
    assert manifest.splits["valid"].tokens > 0
    assert len(manifest.splits["train"].shards) > 1  # shards of 20k tokens


def test_manifest_records_schema_tokenizer_sources_and_shards(mixed_data):
    m = read_manifest(mixed_data.dir)
    raw = json.loads((Path(mixed_data.dir) / "manifest.json").read_text())
    assert raw["schema_version"] == SCHEMA_VERSION and raw["fingerprint"] == m.fingerprint
    assert m.source_names == ["files", "paras"] and m.token_type == "uint16"
    for split in ("train", "valid"):
        for s in m.splits[split].shards:
            assert s.file.startswith(f"gen-1/{split}-{s.source}-")
            table = pa.ipc.open_file(pa.memory_map(str(Path(mixed_data.dir) / s.file))).read_all()
            assert table.schema.field("tokens").type == pa.list_(pa.uint16())
            assert (table.num_rows, sum(len(x) for x in table.column(0).to_pylist())) == (
                s.documents,
                s.tokens,
            )
    for src in m.sources:
        ours = m.splits["train"].of_source(src["name"]) + m.splits["valid"].of_source(src["name"])
        assert sum(s.documents for s in ours) == sum(src["documents"].values())
        # Shards fill to the target, closing at the first document end past it.
        for split in ("train", "valid"):
            full = m.splits[split].of_source(src["name"])[:-1]
            assert all(s.tokens >= mixed_data.shard_tokens for s in full)
    assert m.sources[1]["documents"]["train"] > 100  # JSONL: one document per line


def test_smallest_token_type():
    assert [str(token_type(v)) for v in (256, 257, 65536, 65537)] == [
        "uint8",
        "uint16",
        "uint16",
        "uint32",
    ]


def _texts_of(tok: Tokenizer, stream: TokenStream) -> list[str]:
    ids = stream.read(0, len(stream)).tolist()
    docs, cur = [], []
    for t in ids:
        if t == tok.eos_id:
            docs.append(tok.decode(cur))
            cur = []
        else:
            cur.append(t)
    return docs


def test_jsonl_parquet_arrow_sources_read_the_named_field(tmp_path):
    texts = [f"Document number {i}: " + "some words here. " * (i % 7 + 1) for i in range(60)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"t": t, "n": 1}) + "\n" for t in texts))
    table = pa.table({"n": list(range(60)), "t": texts})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=25)
    with pa.ipc.new_file(str(tmp_path / "a.arrow"), table.schema) as w:
        for batch in table.to_batches(max_chunksize=20):
            w.write_batch(batch)
    cfg = DataConfig(
        dir=str(tmp_path / "data"),
        valid_fraction=0.1,
        shard_tokens=1024,
        prepare_workers=1,
        sources=[
            SourceConfig(name=t, type=t, paths=[str(tmp_path / f"a.{ext}")], field="t")
            for t, ext in (("jsonl", "jsonl"), ("parquet", "parquet"), ("arrow", "arrow"))
        ],
        tokenizer=TokenizerConfig(vocab_size=300, special_tokens=["<sep>"]),
    )
    prepare(cfg, progress=False)
    tok = Tokenizer(PreparedData(cfg.dir).tokenizer_file())
    assert "<sep>" in tok.sp.EncodeAsPieces("a<sep>b")  # a special token is never split
    for name in ("jsonl", "parquet", "arrow"):
        got = _texts_of(tok, TokenStream(cfg.dir, "train", name)) + _texts_of(
            tok, TokenStream(cfg.dir, "valid", name)
        )
        assert sorted(got) == sorted(texts)


def reusing_tokenizer(data, out_dir, workers: int):
    """``data`` prepared again into ``out_dir`` with ``workers`` workers and its tokenizer."""
    return dataclasses.replace(
        data,
        dir=str(out_dir),
        prepare_workers=workers,
        tokenizer=dataclasses.replace(
            data.tokenizer, model_file=str(PreparedData(data.dir).tokenizer_file())
        ),
    )


def test_result_does_not_depend_on_workers_and_reuses_a_tokenizer(mixed_data, tmp_path):
    one = reusing_tokenizer(mixed_data, tmp_path / "one", workers=1)
    prepare(one, progress=False)
    assert read_manifest(one.dir).fingerprint == read_manifest(mixed_data.dir).fingerprint


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_trained_tokenizer_and_fingerprint_do_not_depend_on_workers(
    tiny_data, tmp_path, model_type
):
    """SentencePiece writes its trainer's thread count into the model, and the unigram
    trainer's sums depend on how its work is split: a thread count taken from prepare_workers
    would change the tokenizer's bytes, the fingerprint and with it the sample order."""
    made = {}
    for workers in (1, 2):
        cfg = dataclasses.replace(
            tiny_data,
            dir=str(tmp_path / f"w{workers}"),
            prepare_workers=workers,
            tokenizer=dataclasses.replace(tiny_data.tokenizer, model_type=model_type),
        )
        prepare(cfg, progress=False)
        made[workers] = (
            PreparedData(cfg.dir).tokenizer_file().read_bytes(),
            read_manifest(cfg.dir).fingerprint,
        )
    assert made[1] == made[2]


def test_prepare_is_idempotent_and_refuses_other_config(tiny_data):
    assert prepare(tiny_data, progress=False).skipped
    # Reading options are not part of the prepared data.
    assert prepare(dataclasses.replace(tiny_data, seed=99, seq_len=8), progress=False).skipped
    with pytest.raises(DataError, match="different config"):
        prepare(dataclasses.replace(tiny_data, valid_fraction=0.3), progress=False)


def test_pool_messages_stay_short_whatever_the_item_size(tiny_data, tmp_path):
    """Documents and token arrays go through spill files; what the pool's pipes carry stays
    below PIPE_BUF (4096 bytes), so a worker terminated mid-send cannot leave half a message
    that Pool.terminate() would wait for forever."""
    import pickle

    from data_pipeline import workers
    from data_pipeline.sources import work_items

    corpus = tmp_path / "big"
    corpus.mkdir()
    (corpus / "a.txt").write_text("\n\n".join(f"document {i} " + "word " * 2000 for i in range(50)))
    source = SourceConfig(name="big", type="text", paths=[str(corpus)])
    (item,) = work_items(source)
    spill = tmp_path / "spill"
    spill.mkdir()
    read_result = workers.read_into_spill((source, item, str(spill / "r.json")))
    docs = workers.load_docs(read_result)
    assert sum(len(t) for _, t in docs.docs) > 400_000  # one file, one document
    workers.init_worker(str(PreparedData(tiny_data.dir).tokenizer_file()))
    encode_result = workers.encode_item((source, 0.1, item, read_result, str(spill / "e.bin")))
    # A whole task of items comes back as one message: a few counts per item.
    job = (source, 0.1, item, None, str(spill / "e.bin"))
    task_result = workers.encode_task([job] * workers.TASK_ITEMS)
    for result in (read_result, encode_result, task_result):
        assert len(pickle.dumps(result)) < 4096
    arrays = workers.load_encoded(str(spill / "e.bin"), encode_result[0])
    assert sum(len(a.tokens) for a in arrays.values()) > 100_000
    for tokens, lengths, keys, mask in arrays.values():
        assert lengths.sum() == len(tokens) and len(keys) == len(lengths) and mask is None


def test_tasks_group_consecutive_items_by_input_bytes():
    from data_pipeline import workers

    jobs = list(range(40))
    sizes = [workers.TASK_BYTES // 4] * 8 + [3 * workers.TASK_BYTES] * 2 + [10] * 30
    tasks = workers.group_tasks(jobs, sizes)
    assert [j for task in tasks for j in task] == jobs  # every job once, in order
    assert [len(t) for t in tasks] == [4, 4, 1, 1, workers.TASK_ITEMS, 30 - workers.TASK_ITEMS]
    assert workers.group_tasks([], []) == []


def test_main_process_only_hands_out_items_and_writes_token_arrays(
    mixed_data, tmp_path, monkeypatch
):
    """With N workers on N cores, per-document work in the main process takes a core from
    them: it must never read, parse or tokenize a document. It sends work items (a file, a
    byte range) and spill file names, and gets back a few counts per item; tokens come as
    arrays in spill files. The result is that of the reference preparation, byte for byte."""
    import pickle

    from data_pipeline import sources, tokenizer, workers

    def per_document(*args, **kw):
        raise AssertionError("per-document work in the main process")

    # The workers are spawned: they import their own, unpatched modules.
    for module, name in (
        (workers, "read_item"),
        (sources, "read_item"),
        (workers, "load_docs"),
        (tokenizer.Tokenizer, "encode_batch"),
        (tokenizer.Tokenizer, "encode"),
        (sources, "decode"),
        (sources, "_jsonl_documents"),
    ):
        monkeypatch.setattr(module, name, per_document)
    sent, received = [], []
    real_tasks, real_task = workers.group_tasks, workers.encode_task

    def spy_tasks(jobs, sizes):
        tasks = real_tasks(jobs, sizes)
        sent.extend(tasks)
        return tasks

    monkeypatch.setattr(workers, "group_tasks", spy_tasks)
    real_run = workers.run_tasks

    def spy_run(pool, jobs, sizes):
        for counts in real_run(pool, jobs, sizes):
            received.append(counts)
            yield counts

    monkeypatch.setattr(workers, "run_tasks", spy_run)
    texts = [
        t
        for p in sorted(Path(mixed_data.sources[0].paths[0]).iterdir())
        for t in p.read_text(encoding="utf-8").split("\n\n")
        if len(t) > 40
    ]
    cfg = reusing_tokenizer(mixed_data, tmp_path / "data", workers=2)
    prepare(cfg, progress=False)
    assert read_manifest(cfg.dir).fingerprint == read_manifest(mixed_data.dir).fingerprint
    assert real_task is workers.encode_task and sent and len(received) == sum(map(len, sent))
    for task in sent:
        raw = pickle.dumps(task)
        assert len(raw) < 2048 * len(task)
        assert not any(t.encode() in raw or t.upper().encode() in raw for t in texts[:20])
    for counts in received:
        assert all(
            type(n) is int
            for n in [
                *counts.documents,
                counts.invalid_utf8,
                counts.empty,
                counts.filtered,
                counts.rows,
                counts.moved,
            ]
        )


def test_jsonl_ranges_of_any_size_read_the_same_documents(tmp_path, monkeypatch):
    """Smaller sources are cut into smaller byte ranges (so that every worker gets several);
    the documents, their ids and their order do not depend on where the cuts fall."""
    from data_pipeline import sources

    path = tmp_path / "a.jsonl"
    path.write_text(
        "".join(json.dumps({"text": f"doc {i} " + "é " * (i % 37)}) + "\n" for i in range(300)),
        encoding="utf-8",
    )
    source = SourceConfig(name="j", type="jsonl", paths=[str(path)])

    def documents() -> tuple[int, list]:
        items = sources.work_items(source)
        return len(items), [d for it in items for d in sources.read_item(source, it).docs]

    one_range, want = documents()
    assert one_range == 1 and len(want) == 300
    for chunk in (1, 7, 64, 1000):
        monkeypatch.setattr(sources, "JSONL_MIN_CHUNK_BYTES", chunk)
        n, got = documents()
        assert n > 1 and got == want
    assert sources.jsonl_chunk_bytes(10 << 30) == sources.JSONL_CHUNK_BYTES
    assert sources.jsonl_chunk_bytes(0) == sources.JSONL_MIN_CHUNK_BYTES


def _one_row_group_parquet(path: Path) -> list:
    texts = [f"row {i} " + "ünïcode words " * (i % 23) for i in range(4000)]
    texts[17], texts[333] = None, ""
    langs = ["en" if i % 3 else "fr" for i in range(4000)]
    pq.write_table(pa.table({"text": texts, "lang": langs}), path, row_group_size=4000)
    return texts


@pytest.mark.parametrize("row_filter", [None, {"column": "lang", "value": "en"}])
def test_parquet_row_groups_cut_into_row_ranges_read_the_same_documents(
    tmp_path, monkeypatch, row_filter
):
    """A large row group is cut into row ranges (so that one file of one row group still
    feeds every worker); documents, ids, order and counts do not depend on the cuts."""
    from data_pipeline import sources
    from data_pipeline.config import FilterConfig

    _one_row_group_parquet(tmp_path / "a.parquet")
    source = SourceConfig(
        name="p",
        type="parquet",
        paths=[str(tmp_path / "a.parquet")],
        filter=FilterConfig(**row_filter) if row_filter else FilterConfig(),
    )

    def read() -> tuple[list, list, tuple[int, int]]:
        items = sources.work_items(source)
        got = [sources.read_item(source, it) for it in items]
        return (
            [it.part for it in items],
            [d for r in got for d in r.docs],
            (sum(r.filtered for r in got), sum(r.empty for r in got)),
        )

    parts, want, counts = read()
    assert parts == [0] and len(want) == (2665 if row_filter else 3998)
    assert ("a.parquet#0:5", "row 5 " + "ünïcode words " * 5) in want
    for chunk in (30_000, 4096, 1):
        monkeypatch.setattr(sources, "JSONL_MIN_CHUNK_BYTES", chunk)
        parts, got, got_counts = read()
        assert len(parts) > 2 and all(p[0] == 0 for p in parts)
        # consecutive, covering every row once
        assert [p[1] for p in parts] == [0] + [p[2] for p in parts[:-1]] and parts[-1][2] == 4000
        assert got == want and got_counts == counts
    assert sources.row_ranges(10, 100, 1000) is None
    assert sources.row_ranges(3, 10_000, 1) == [(0, 1), (1, 2), (2, 3)]


def test_one_parquet_row_group_is_shared_by_the_workers_with_the_same_result(
    tiny_data, tmp_path, monkeypatch
):
    from data_pipeline import sources

    _one_row_group_parquet(tmp_path / "a.parquet")
    whole = dataclasses.replace(
        tiny_data,
        dir=str(tmp_path / "whole"),
        prepare_workers=2,
        sources=[SourceConfig(name="p", type="parquet", paths=[str(tmp_path / "a.parquet")])],
        tokenizer=dataclasses.replace(
            tiny_data.tokenizer, model_file=str(PreparedData(tiny_data.dir).tokenizer_file())
        ),
    )
    prepare(whole, progress=False)
    monkeypatch.setattr(sources, "JSONL_MIN_CHUNK_BYTES", 4096)
    assert len(sources.work_items(whole.sources[0])) > 8
    cut = dataclasses.replace(whole, dir=str(tmp_path / "cut"))
    prepare(cut, progress=False)
    assert read_manifest(cut.dir).fingerprint == read_manifest(whole.dir).fingerprint


def test_interrupted_preparation_leaves_nothing_and_keeps_old_data(
    tiny_data, tmp_path, monkeypatch
):
    from data_pipeline import shards

    cfg = dataclasses.replace(tiny_data, dir=str(tmp_path / "data"), prepare_workers=1)
    real, calls = shards.write_shard, []

    def crash_on_second(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # what Ctrl-C delivers mid-preparation
        return real(*args, **kw)

    monkeypatch.setattr(shards, "write_shard", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg, progress=False)
    assert not Path(cfg.dir).exists() and list(tmp_path.iterdir()) == []
    with pytest.raises(DataError, match="prepare the data first"):
        PackedReader(cfg.dir, 8, 0)

    # Replacing existing data (--force) and failing keeps the old data whole.
    monkeypatch.setattr(shards, "write_shard", real)
    shutil.copytree(tiny_data.dir, cfg.dir)
    before = read_manifest(cfg.dir).fingerprint
    leftover = tmp_path / ".data.staging"  # what a killed (SIGKILL) preparation leaves
    leftover.mkdir()
    (leftover / "train-docs-00000.arrow").write_bytes(b"half a shard")
    calls.clear()
    monkeypatch.setattr(shards, "write_shard", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        prepare(dataclasses.replace(cfg, valid_fraction=0.5), force=True, progress=False)
    assert read_manifest(cfg.dir).fingerprint == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]
    PackedReader(cfg.dir, 8, 0).micro_batches(1)


def test_cli_module_imports_no_model_code():
    """Spawned workers run moe-prepare's module again as they start: importing torch there
    (through the run config) cost each worker seconds of CPU before its first document."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys, launch.prepare; print(sorted({'torch', 'moe.config.run'} & set(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert out.stdout.strip() == "[]"


def test_cli_prepares_then_verifies(tiny_data, tmp_path, capsys):
    import yaml

    from tests.conftest import tiny_run_dict

    run = tiny_run_dict(tiny_data, tmp_path / "runs")
    run["data"]["dir"] = str(tmp_path / "data")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    prepare_cli.main([str(tmp_path / "run.yaml"), "--quiet"])
    out = capsys.readouterr().out
    assert "prepared in" in out and "tokens in" in out
    prepare_cli.main(["--verify", str(tmp_path / "data")])
    assert "ok;" in capsys.readouterr().out
    prepare_cli.main([str(tmp_path / "run.yaml"), "--quiet"])
    assert "already prepared" in capsys.readouterr().out
    assert np.array_equal(
        TokenStream(tmp_path / "data", "train").read(0, 100),
        TokenStream(tiny_data.dir, "train").read(0, 100),
    )


def test_data_of_an_older_schema_asks_for_force(tiny_data, tmp_path):
    copy = tmp_path / "data"
    shutil.copytree(tiny_data.dir, copy)
    raw = json.loads((copy / "manifest.json").read_text())
    raw["schema_version"] = 1
    (copy / "manifest.json").write_text(json.dumps(raw))
    cfg = dataclasses.replace(tiny_data, dir=str(copy))
    with pytest.raises(DataError, match="schema version 1.*--force"):
        prepare(cfg, progress=False)
    assert not prepare(cfg, force=True, progress=False).skipped
    assert read_manifest(copy).fingerprint == read_manifest(tiny_data.dir).fingerprint


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_tokenizer_types_byte_fallback_and_special_ids(tiny_data, tmp_path, model_type):
    from data_pipeline.tokenizer import LineSample, train_tokenizer

    sample = LineSample(20000, seed=0)
    for f in sorted(Path(tiny_data.sources[0].paths[0]).iterdir()):
        sample.add(f.read_text(encoding="utf-8"))
    cfg = TokenizerConfig(vocab_size=600, model_type=model_type, special_tokens=["<tool>"])
    tok = train_tokenizer(sample.lines, cfg, tmp_path / "t.model")
    assert (tok.unk_id, tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2, 3)
    text = "Unseen: λx → 漢字 🙂 <tool>  two  spaces"
    ids = tok.encode(text)
    assert tok.unk_id not in ids and tok.decode(ids) == text  # byte fallback, identity
    assert tok.sp.piece_to_id("<tool>") in ids
    assert tok.sha256 == hashlib.sha256((tmp_path / "t.model").read_bytes()).hexdigest()


def test_stdlib_source_reads_docstrings_and_comments():
    from data_pipeline.sources import read_item, work_items

    items = work_items(SourceConfig())
    assert len(items) > 500 and all(not Path(i.name).is_absolute() for i in items)
    (item,) = [i for i in items if i.name == "textwrap.py"]
    ((doc_id, text),) = read_item(SourceConfig(), item).docs
    assert doc_id == "textwrap.py"
    assert "Text wrapping and filling." in text  # the module docstring
    assert "import re" not in text  # code is left out


def test_progress_logs_lines_when_not_on_a_terminal(tiny_data, tmp_path, monkeypatch):
    import io

    from data_pipeline import progress as progress_module

    out = io.StringIO()  # not a terminal: log lines, no bar
    real = progress_module.Progress

    def logging_progress(desc, total, enabled=True):
        return real(desc, total, enabled, stream=out, interval=0.0)

    monkeypatch.setattr("data_pipeline.assemble.Progress", logging_progress)
    cfg = dataclasses.replace(
        tiny_data,
        dir=str(tmp_path / "data"),
        prepare_workers=1,
        tokenizer=dataclasses.replace(
            tiny_data.tokenizer, model_file=str(PreparedData(tiny_data.dir).tokenizer_file())
        ),
    )
    prepare(cfg, progress=True)
    lines = out.getvalue().splitlines()
    manifest = read_manifest(cfg.dir)
    total_mb = sum(p.stat().st_size for p in Path(tiny_data.sources[0].paths[0]).iterdir()) / 1e6
    assert (
        len(lines) == len(manifest_items := list(Path(tiny_data.sources[0].paths[0]).iterdir())) + 1
    )
    assert all(line.startswith("tokenize docs: ") for line in lines)
    assert f"of {total_mb:,.1f} MB" in lines[0] and "ETA" in lines[0] and "tokens/s" in lines[0]
    tokens = manifest.splits["train"].tokens + manifest.splits["valid"].tokens
    docs = manifest.splits["train"].documents + manifest.splits["valid"].documents
    assert lines[-1].endswith("(done)") and "(100%)" in lines[-1] and "ETA 0:00:00" in lines[-1]
    assert f"{docs:,} documents, {tokens:,} tokens" in lines[-1]
    assert len(manifest_items) > 1
    quiet = io.StringIO()
    p = real("x", 10, enabled=False, stream=quiet, interval=0.0)
    p.update(10, 1, 1)
    p.close()
    assert quiet.getvalue() == ""
