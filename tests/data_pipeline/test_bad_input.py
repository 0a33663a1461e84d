"""Bad input: each case gives a clear error naming the file, a non-zero exit of the command line,
and nothing half-written."""

import dataclasses
import hashlib
import itertools
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import yaml

from data_pipeline import reader as reader_module
from data_pipeline.errors import DataError
from data_pipeline.prepared import PreparedData
from data_pipeline.reader import PackedReader
from data_pipeline.shards import MANIFEST, read_manifest, write_manifest, write_shard
from data_pipeline.token_stream import TokenStream
from data_pipeline.tokenizer import Tokenizer
from launch import prepare as prepare_cli
from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.core.errors import ConfigError
from moe.training.trainer import resolve_vocab
from tests.conftest import tiny_run_dict
from tests.helpers.reader_reference import ReferenceRows


def cli_fails(argv, capsys, *needles) -> str:
    with pytest.raises(SystemExit) as exc:
        prepare_cli.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    for needle in needles:
        assert needle in err, err
    return err


def prepared_copy(tiny_data, tmp_path) -> tuple[Path, Path]:
    """A copy of the prepared tiny data and the path of its first training shard."""
    copy = tmp_path / "data"
    shutil.copytree(tiny_data.dir, copy)
    return copy, copy / read_manifest(copy).splits["train"].shards[0].file


def run_config(tiny_data, tmp_path, sources) -> Path:
    raw = tiny_run_dict(tiny_data, tmp_path / "runs")
    raw["data"].update(dir=str(tmp_path / "out"), sources=sources)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def assert_nothing_written(tmp_path):
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if "staging" in p.name]


def read_all(data_dir):
    r = PackedReader(data_dir, 32, 0, micro_batch=64)
    for _ in range(r.streams[0].num_samples // 64 + 1):
        r.micro_batches(1)


def test_missing_shard(tiny_data, tmp_path, capsys):
    copy, shard = prepared_copy(tiny_data, tmp_path)
    shard.unlink()
    with pytest.raises(DataError, match=f"{shard.name}.*missing"):
        PackedReader(copy, 32, 0)
    cli_fails(["--verify", str(copy)], capsys, str(shard), "missing")


def test_corrupt_shard(tiny_data, tmp_path, capsys):
    copy, shard = prepared_copy(tiny_data, tmp_path)
    shard.write_bytes(np.random.default_rng(0).bytes(shard.stat().st_size))
    with pytest.raises(DataError, match=f"{shard.name}: corrupt"):
        PackedReader(copy, 32, 0)
    cli_fails(["--verify", str(copy)], capsys, str(shard), "corrupt")


def test_corrupt_bytes_inside_a_shard_are_caught_by_verify(tiny_data, tmp_path, capsys):
    copy, shard = prepared_copy(tiny_data, tmp_path)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # a flipped bit in the token data: structure still valid
    shard.write_bytes(bytes(data))
    info = next(i for i in read_manifest(copy).splits["train"].shards if copy / i.file == shard)
    found = hashlib.sha256(bytes(data)).hexdigest()
    cli_fails(
        ["--verify", str(copy)],
        capsys,
        str(shard),
        "SHA-256",
        f"is {found}",
        f"manifest's is {info.sha256}",
    )


def overwrite_offset(shard: Path, which: int, value: int) -> None:
    """Overwrite offset ``which`` of the first record batch's token lists, in place in the file
    (the bytes of its whole offsets buffer are found in the file and changed there)."""
    with pa.ipc.open_file(pa.memory_map(str(shard), "r")) as r:
        offsets = r.get_batch(0).column(0).offsets.to_numpy().astype("<i4")
    data = bytearray(shard.read_bytes())
    at = bytes(data).find(offsets.tobytes())
    assert at > 0 and bytes(data).count(offsets.tobytes()) == 1
    offsets[which] = value
    data[at : at + offsets.nbytes] = offsets.tobytes()
    shard.write_bytes(bytes(data))


def test_damaged_offsets_are_a_named_error_not_a_crash(tiny_data, tmp_path, capsys):
    """The last offset past the token data: reading the tokens by it would read outside the file
    (a segmentation fault, before the structure was validated on opening)."""
    copy, shard = prepared_copy(tiny_data, tmp_path)
    overwrite_offset(shard, -1, 10**9)
    with pytest.raises(DataError, match=f"{shard.name}: corrupt or truncated shard .*offsets"):
        PackedReader(copy, 32, 0)
    cli_fails(["--verify", str(copy)], capsys, str(shard), "corrupt or truncated")


def test_offsets_out_of_order_inside_a_shard_are_caught_by_verify(tiny_data, tmp_path, capsys):
    """A document's offset moved backwards: the first and last offsets still hold, so opening a
    shard for training (O(1) per batch) does not see it; --verify checks every offset."""
    copy, shard = prepared_copy(tiny_data, tmp_path)
    overwrite_offset(shard, 1, 10**6)
    cli_fails(["--verify", str(copy)], capsys, str(shard), "corrupt or truncated", "offset")


def test_truncated_arrow_file(tiny_data, tmp_path, capsys):
    copy, shard = prepared_copy(tiny_data, tmp_path)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(DataError, match=f"{shard.name}: corrupt or truncated"):
        TokenStream(copy, "train")
    cli_fails(["--verify", str(copy)], capsys, str(shard), "truncated")


@pytest.mark.parametrize(
    "schema",
    [pa.schema([("ids", pa.list_(pa.uint16()))]), pa.schema([("tokens", pa.list_(pa.int64()))])],
)
def test_wrong_schema(tiny_data, tmp_path, capsys, schema):
    copy, shard = prepared_copy(tiny_data, tmp_path)
    with pa.ipc.new_file(str(shard), schema) as w:
        w.write_table(pa.table({schema.names[0]: [[5, 6, 2]]}, schema=schema))
    with pytest.raises(DataError, match=f"{shard.name}: wrong shard schema"):
        PackedReader(copy, 32, 0)
    cli_fails(["--verify", str(copy)], capsys, str(shard), "wrong shard schema")


def test_manifest_disagreeing_with_shards(tiny_data, tmp_path, capsys):
    copy, shard = prepared_copy(tiny_data, tmp_path)
    raw = json.loads((copy / MANIFEST).read_text())
    raw["splits"]["train"]["shards"][0]["tokens"] += 1
    (copy / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(DataError, match=f"{shard.name}: holds .* but the manifest says"):
        PackedReader(copy, 32, 0)
    cli_fails(["--verify", str(copy)], capsys, str(shard), "manifest says")
    (copy / MANIFEST).write_text("{not json")
    cli_fails(["--verify", str(copy)], capsys, str(copy / MANIFEST), "unreadable manifest")


def copy_with_bad_token(tiny_data, tmp_path) -> tuple[Path, Path]:
    """A prepared copy whose first training shard holds token id 600 a third of the way in (the
    vocabulary has 512 pieces; uint16 can still store it), and the path of that shard."""
    copy, shard = prepared_copy(tiny_data, tmp_path)
    manifest = read_manifest(copy)
    info = manifest.splits["train"].shards[0]
    tokens = TokenStream(copy, "train").shards[0].astype(np.int64)
    tokens[len(tokens) // 3] = 600
    lengths = np.array([info.tokens])
    manifest.splits["train"].shards[0] = dataclasses.replace(
        write_shard(shard, info.source, tokens, lengths, vocab_size=1000), file=info.file
    )
    write_manifest(copy, manifest)
    return copy, shard


def test_token_id_out_of_range(tiny_data, tmp_path, capsys):
    copy, shard = copy_with_bad_token(tiny_data, tmp_path)
    with pytest.raises(DataError, match=f"token id 600 out of range .*{shard.name}"):
        read_all(copy)
    cli_fails(["--verify", str(copy)], capsys, str(shard), "token id 600 out of range")


def test_out_of_range_id_fails_its_own_micro_batch(tiny_data, tmp_path):
    """Micro-batches are copied a group at a time: those before the bad one in its group are
    still delivered, and the error comes with the micro-batch that holds the bad row."""
    copy, shard = copy_with_bad_token(tiny_data, tmp_path)
    B = 2
    r = PackedReader(copy, 32, 0, micro_batch=B)
    ref = ReferenceRows(r)
    first_bad = next(g for g in itertools.count() if (ref(g) >= r.vocab_size).any())
    per_group = reader_module.GROUP_ROWS // B
    assert (first_bad // B) % per_group  # not the first micro-batch of its group
    for m in range(first_bad // B):
        (batch,) = r.next_step(1)
        assert np.array_equal(batch.tokens_BS.numpy(), [ref(m * B + j) for j in range(B)])
    with pytest.raises(DataError, match=f"token id 600 out of range .*{shard.name} at token"):
        r.next_step(1)


def test_tokenizer_vocabulary_larger_than_the_model(tiny_data, tmp_path):
    raw = tiny_run_dict(tiny_data, tmp_path)
    raw["model"]["vocab_size"] = 500  # the tokenizer has 512 pieces
    with pytest.raises(
        ConfigError, match=f"model.vocab_size: 500 .* vocabulary \\(512, {tiny_data.dir}"
    ):
        resolve_vocab(from_dict(RunConfig, raw))
    raw["model"]["vocab_size"] = None
    assert resolve_vocab(from_dict(RunConfig, raw)).model.vocab_size == 512


def test_a_replaced_tokenizer_is_refused_by_prepare_and_by_training(
    tiny_data, tmp_path, capsys, monkeypatch
):
    """Prepared data whose tokenizer file was swapped for another (a valid one, of other
    tokens): moe-prepare does not call it prepared, and a run refuses it before building
    anything, with a data error no restart retries; the original file back, both go on."""
    from launch.train import final_cause
    from moe.training import trainer
    from tests.data_pipeline.test_tokenizer_json import write_json

    copy, _ = prepared_copy(tiny_data, tmp_path)
    manifest = read_manifest(copy)
    tokenizer = copy / manifest.tokenizer["file"]
    original = tokenizer.read_bytes()
    write_json(tokenizer)
    found = hashlib.sha256(tokenizer.read_bytes()).hexdigest()
    raw = tiny_run_dict(tiny_data, tmp_path / "runs")
    raw["data"]["dir"] = str(copy)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    needles = (str(tokenizer), found, manifest.tokenizer["sha256"], "moe-prepare --force")
    cli_fails([str(config), "--quiet"], capsys, *needles)

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was built on data with a replaced tokenizer")

    monkeypatch.setattr(trainer, "build_engine", no_engine)
    cfg = from_dict(RunConfig, raw)
    with pytest.raises(DataError) as e:
        trainer.start_run(cfg, trainer.DistEnv(0, 1, 0, 1), resume="none")
    assert all(needle in str(e.value) for needle in needles), e.value
    assert final_cause(e.value, tmp_path / "runs") == ("data", str(e.value))

    tokenizer.write_bytes(original)
    prepare_cli.main([str(config), "--quiet"])
    assert "already prepared" in capsys.readouterr().out
    assert PreparedData(copy).tokenizer_file() == tokenizer


def test_empty_source(tiny_data, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("  \n\n ")
    (tmp_path / "empty" / "b.txt").write_text("")
    config = run_config(
        tiny_data,
        tmp_path,
        [
            {"name": "docs", "type": "text", "paths": tiny_data.sources[0].paths},
            {"name": "blank", "type": "text", "paths": [str(tmp_path / "empty")]},
        ],
    )
    cli_fails([str(config), "--quiet"], capsys, "'blank'", str(tmp_path / "empty"), "no text")
    assert_nothing_written(tmp_path)
    config = run_config(
        tiny_data,
        tmp_path,
        [{"name": "docs", "type": "text", "paths": [str(tmp_path / "nothing" / "*.txt")]}],
    )
    cli_fails([str(config), "--quiet"], capsys, "nothing matches", "nothing/*.txt")
    assert_nothing_written(tmp_path)


def test_too_few_documents_for_a_validation_split_says_how_many(tiny_data, tmp_path, capsys):
    """Two long text files are two documents: the validation split gets none of them."""
    (tmp_path / "two").mkdir()
    for name, word in (("a.txt", "alpha"), ("b.txt", "beta")):
        (tmp_path / "two" / name).write_text(
            "\n\n".join(f"{word} gamma delta {i} epsilon" for i in range(2000))
        )
    config = run_config(
        tiny_data, tmp_path, [{"name": "docs", "type": "text", "paths": [str(tmp_path / "two")]}]
    )
    raw = yaml.safe_load(config.read_text())
    raw["data"]["valid_fraction"] = 0.01  # neither of the two lands in it (split by content hash)
    config.write_text(yaml.safe_dump(raw))
    cli_fails(
        [str(config), "--quiet"],
        capsys,
        "the validation split is empty",
        "2 document(s) in all",
        "data.valid_fraction",
        "one document",
    )
    assert_nothing_written(tmp_path)


def test_bad_jsonl_and_missing_columns(tiny_data, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "no text field"}\n')
    config = run_config(tiny_data, tmp_path, [{"name": "j", "type": "jsonl", "paths": [str(bad)]}])
    cli_fails([str(config), "--quiet"], capsys, str(bad), "byte 17", "no field 'text'")
    bad.write_text('{"text": "fine"}\n{"text": "unterminated\n')
    cli_fails([str(config), "--quiet"], capsys, str(bad), "not valid JSON")
    # In a byte range that starts mid-file, the line is numbered from the file's start, and
    # the whole reason (what, where in the line) is given.
    lines = [json.dumps({"text": f"line {i} " * 80}) for i in range(3000)]
    lines[2345] = '{"text": "a quote missing, "x": 1}'
    bad.write_text("".join(line + "\n" for line in lines))
    offset = sum(len(line) + 1 for line in lines[:2345])
    assert offset > 1 << 20  # past the first of the file's byte ranges
    err = cli_fails(
        [str(config), "--quiet"],
        capsys,
        str(bad),
        f"line 2346 (byte {offset}) is not valid JSON: Expecting ',' delimiter at column 29",
        "x",
    )
    assert "Traceback" not in err
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "t.parquet")
    config = run_config(
        tiny_data,
        tmp_path,
        [{"name": "p", "type": "parquet", "paths": [str(tmp_path / "t.parquet")]}],
    )
    cli_fails([str(config), "--quiet"], capsys, "t.parquet", "no column 'text'", "body")
    assert_nothing_written(tmp_path)


def test_non_utf8_bytes_are_replaced_and_counted(tiny_data, tmp_path, capsys):
    corpus = tmp_path / "corpus"
    shutil.copytree(tiny_data.sources[0].paths[0], corpus)
    (corpus / "zz_bad.txt").write_bytes(b"valid text \xff then \xfe\xfd and a cut \xc3 end\n" * 3)
    config = run_config(
        tiny_data, tmp_path, [{"name": "docs", "type": "text", "paths": [str(corpus)]}]
    )
    prepare_cli.main([str(config), "--quiet"])
    out = capsys.readouterr().out
    assert "source 'docs': 12 invalid UTF-8 sequences replaced" in out
    manifest = read_manifest(tmp_path / "out")
    assert manifest.sources[0]["invalid_utf8"] == 12
    tok = Tokenizer(PreparedData(tmp_path / "out").tokenizer_file())
    streams = [TokenStream(tmp_path / "out", split) for split in ("train", "valid")]
    text = tok.decode([t for s in streams for t in s.read(0, len(s)) if t != tok.eos_id])
    assert "valid text \ufffd then \ufffd\ufffd and a cut \ufffd end" in text


LONE = "\ud800"
"""A lone surrogate: JSON's "\\ud800" escape and a Python literal allow it, UTF-8 has no form."""


def corpus_paragraphs(tiny_data, count: int) -> list[str]:
    return [
        p.strip()
        for path in sorted(Path(tiny_data.sources[0].paths[0]).iterdir())
        for p in path.read_text(encoding="utf-8").split("\n\n")
        if p.strip()
    ][:count]


def surrogate_source(tiny_data, tmp_path, kind: str) -> tuple[dict, int, int]:
    """A source of documents that hold lone surrogates (the corpus's paragraphs, so that a
    tokenizer trained on them is a real one), how many they hold, and how many documents
    hold ``"U+FFFD lone"`` once they are replaced."""
    paras = corpus_paragraphs(tiny_data, 30)
    if kind == "python":  # a docstring's escape
        (tmp_path / "py").mkdir()
        for i, para in enumerate(paras):
            (tmp_path / "py" / f"m{i}.py").write_text(f'"""{para} \\ud800 lone"""\n')
        return {"name": "u", "type": kind, "paths": [str(tmp_path / "py")]}, len(paras), len(paras)
    if kind == "instruction":
        records = [{"prompt": f"Say{LONE} it", "response": f"{p} {LONE} lone"} for p in paras]
    else:
        records = [{"text": f"{p} {LONE} lone"} for p in paras]
    path = tmp_path / "u.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))  # with "\ud800" escapes
    per_record = 2 if kind == "instruction" else 1
    return {"name": "u", "type": kind, "paths": [str(path)]}, per_record * len(paras), len(paras)


@pytest.mark.parametrize(
    "kind,trained",
    [("jsonl", False), ("jsonl", True), ("instruction", False), ("python", False)],
    ids=["encode", "tokenizer-training", "instruction-spans", "python-docstring"],
)
def test_lone_surrogates_are_replaced_and_counted(tiny_data, tmp_path, capsys, kind, trained):
    source, replaced, documents = surrogate_source(tiny_data, tmp_path, kind)
    docs = {"name": "docs", "type": "text", "paths": tiny_data.sources[0].paths}
    config = run_config(tiny_data, tmp_path, [docs, source])
    if not trained:
        raw = yaml.safe_load(config.read_text())
        raw["data"]["tokenizer"] = {"model_file": str(PreparedData(tiny_data.dir).tokenizer_file())}
        config.write_text(yaml.safe_dump(raw))
    prepare_cli.main([str(config), "--quiet"])
    out = capsys.readouterr().out
    assert f"source 'u': {replaced} invalid UTF-8 sequences replaced with U+FFFD" in out
    stats = {s["name"]: s for s in read_manifest(tmp_path / "out").sources}
    assert stats["u"]["invalid_utf8"] == replaced and stats["docs"]["invalid_utf8"] == 0
    tok = Tokenizer(PreparedData(tmp_path / "out").tokenizer_file())
    streams = [TokenStream(tmp_path / "out", split) for split in ("train", "valid")]
    text = tok.decode([t for s in streams for t in s.read(0, len(s)) if t != tok.eos_id])
    assert text.count("\ufffd lone") == documents


@pytest.mark.parametrize("kind", ["sentencepiece", "tokenizer.json"])
def test_a_tokenizer_takes_lone_surrogates_as_u_fffd(tiny_data, tmp_path, kind):
    """Text that comes through no source (a prompt, a template written in YAML) may hold lone
    surrogates too: every path into a tokenizer reads each as U+FFFD, one character for one."""
    from data_pipeline.tokenizer import train_tokenizer
    from tests.data_pipeline.test_tokenizer_json import write_json

    if kind == "sentencepiece":
        tok = Tokenizer(PreparedData(tiny_data.dir).tokenizer_file())
    else:
        write_json(tmp_path / "tokenizer.json")
        tok = Tokenizer(tmp_path / "tokenizer.json")
    text, clean = f"the {LONE}box \udfff", "the \ufffdbox \ufffd"
    assert tok.encode(text) == tok.encode(clean)
    assert tok.encode_batch([text, "fox"]) == tok.encode_batch([clean, "fox"])
    [(ids, spans)], [(clean_ids, clean_spans)] = tok.encode_spans([text]), tok.encode_spans([clean])
    assert ids == clean_ids and np.array_equal(spans, clean_spans)
    if kind == "sentencepiece":
        lines = corpus_paragraphs(tiny_data, 400)
        dirty = train_tokenizer(lines + [text], tiny_data.tokenizer, tmp_path / "a.model")
        plain = train_tokenizer(lines + [clean], tiny_data.tokenizer, tmp_path / "b.model")
        assert dirty.sha256 == plain.sha256


def test_corrupt_or_mislabelled_compressed_input(tiny_data, tmp_path, capsys):
    import gzip

    import zstandard

    raw = b"".join(json.dumps({"text": f"line {i} " * 20}).encode() + b"\n" for i in range(3000))
    gz, zst = gzip.compress(raw), zstandard.ZstdCompressor().compress(raw)
    cases = {
        "truncated.jsonl.gz": (gz[: len(gz) // 2], "corrupt gzip data"),
        "flipped.jsonl.gz": (
            gz[:40] + bytes(b ^ 0x55 for b in gz[40:80]) + gz[80:],
            "corrupt gzip data",
        ),
        "truncated.jsonl.zst": (zst[: len(zst) // 2], "corrupt zstd data"),
        "garbled.jsonl.zst": (zst[:4] + b"\x00" * 64 + zst[68:], "corrupt zstd data"),
        "plain.jsonl.gz": (raw, "does not start like gzip"),
    }
    for name, (data, message) in cases.items():
        bad = tmp_path / "in" / name
        bad.parent.mkdir(exist_ok=True)
        bad.write_bytes(data)
        config = run_config(
            tiny_data, tmp_path, [{"name": "j", "type": "jsonl", "paths": [str(bad)]}]
        )
        cli_fails([str(config), "--quiet"], capsys, str(bad), message)
        assert_nothing_written(tmp_path)
        bad.unlink()


def test_empty_rows_are_counted_per_file_with_their_rows_or_refused(
    tiny_data, tmp_path, capsys, monkeypatch
):
    import pyarrow.parquet as pq

    from data_pipeline import sources

    lines = [json.dumps({"text": f"record {i} with some words"}) for i in range(12)]
    lines[2], lines[5], lines[8] = '{"text": null}', '{"text": "   "}', '{"text": ""}'
    lines[7] = ""  # a blank line is no record, but it is a line
    (tmp_path / "a.jsonl").write_text("".join(line + "\n" for line in lines))
    texts = [f"row {i} text" for i in range(8)]
    texts[2], texts[5] = None, " \n"
    pq.write_table(pa.table({"text": texts}), tmp_path / "b.parquet", row_group_size=4)
    monkeypatch.setattr(sources, "JSONL_MIN_CHUNK_BYTES", 64)  # several ranges, cut mid-line
    config = run_config(
        tiny_data,
        tmp_path,
        [
            {"name": "docs", "type": "text", "paths": tiny_data.sources[0].paths},
            {"name": "j", "type": "jsonl", "paths": [str(tmp_path / "a.jsonl")]},
            {"name": "p", "type": "parquet", "paths": [str(tmp_path / "b.parquet")]},
        ],
    )
    raw = yaml.safe_load(config.read_text())
    raw["data"]["tokenizer"] = {"model_file": str(PreparedData(tiny_data.dir).tokenizer_file())}
    config.write_text(yaml.safe_dump(raw))
    prepare_cli.main([str(config), "--quiet"])
    out = capsys.readouterr().out
    assert (
        f"source 'j': 3 empty documents skipped ({tmp_path / 'a.jsonl'}: 3 with null, "
        "empty or whitespace-only text (lines 3, 6, 9))"
    ) in out
    assert f"source 'p': 2 empty documents skipped ({tmp_path / 'b.parquet'}: 2 with" in out
    stats = {s["name"]: s for s in read_manifest(tmp_path / "out").sources}
    assert stats["j"]["empty_rows"] == {str(tmp_path / "a.jsonl"): {"count": 3, "lines": [3, 6, 9]}}
    assert stats["p"]["empty_rows"] == {str(tmp_path / "b.parquet"): {"count": 2, "rows": [2, 5]}}
    assert (
        stats["docs"]["empty_rows"] == {}
        and stats["j"]["documents"]["train"] + stats["j"]["documents"]["valid"] == 8
    )

    shutil.rmtree(tmp_path / "out")
    raw["data"]["on_empty"] = "error"
    config.write_text(yaml.safe_dump(raw))
    cli_fails(
        [str(config), "--quiet"],
        capsys,
        "source 'j'",
        str(tmp_path / "a.jsonl"),
        "(lines 3",
        "data.on_empty is 'error'",
    )
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize(
    "vocab,fix",
    [
        (300, r"; set data.tokenizer.vocab_size to at least \d+$"),
        (100000, r"to at most \d+, or add"),
    ],
)
def test_a_vocabulary_the_corpus_cannot_fill_is_a_named_error(tmp_path, vocab, fix):
    """SentencePiece refuses a vocabulary smaller than the corpus's characters or larger than
    its text can make: a DataError naming the key and the size that works, not a traceback."""
    from data_pipeline.config import TokenizerConfig
    from data_pipeline.tokenizer import train_tokenizer
    from tests.conftest import write_corpus

    write_corpus(tmp_path / "corpus")
    lines = [
        line
        for f in sorted((tmp_path / "corpus").iterdir())
        for line in f.read_text().splitlines()
        if line.strip()
    ]
    with pytest.raises(DataError) as e:
        train_tokenizer(lines, TokenizerConfig(vocab_size=vocab), tmp_path / "t.model")
    assert str(e.value).startswith(f"data.tokenizer.vocab_size {vocab}: SentencePiece cannot")
    assert re.search(fix, str(e.value)) and not (tmp_path / "t.model").exists()


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_a_string_column_holding_bytes_that_are_not_utf8_is_read_replaced_and_counted(
    tmp_path, kind
):
    """Arrow does not check a string column's bytes when it is written: one holding invalid
    UTF-8 (here the encoding of a lone surrogate, ED A0 80) is read as text with U+FFFD, each
    bad byte counted, as a binary column's or a text file's are."""
    import pyarrow.parquet as pq

    from data_pipeline.config import SourceConfig
    from data_pipeline.sources import read_item, work_items

    raw = pa.array([b"good text", b"bad \xed\xa0\x80 bytes", None], type=pa.binary())
    column = pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())
    path = tmp_path / f"x.{kind}"
    if kind == "parquet":
        pq.write_table(pa.table({"text": column}), path)
    else:
        with pa.ipc.new_file(path, pa.schema([("text", pa.string())])) as w:
            w.write_table(pa.table({"text": column}))
    source = SourceConfig(name="t", type=kind, paths=[str(path)])
    [item] = work_items(source)
    docs = read_item(source, item)
    assert [text for _, text in docs.docs] == ["good text", "bad \ufffd\ufffd\ufffd bytes"]
    assert docs.invalid_utf8 == 3 and docs.empty == 1


def test_a_text_too_small_for_any_vocabulary_says_so(tmp_path):
    """Where the largest size SentencePiece would take is below the least the config allows,
    the advice is to add text, not a size the config refuses."""
    from data_pipeline.config import TokenizerConfig
    from data_pipeline.tokenizer import train_tokenizer

    with pytest.raises(DataError) as e:
        train_tokenizer(
            ["a b c d e f g"] * 20,
            TokenizerConfig(vocab_size=400, model_type="unigram"),
            tmp_path / "t.model",
        )
    assert str(e.value).endswith("; the text is too small for the least vocab_size, 300: add text")
