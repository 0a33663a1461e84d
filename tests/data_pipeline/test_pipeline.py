"""Text -> tokenizer -> Arrow shards -> packed stream."""

from pathlib import Path

import numpy as np
import pytest

from data_pipeline.prepare import TOKENIZER_FILE, in_valid_split, prepare
from data_pipeline.reader import PackedReader, TokenStream, validation_windows
from data_pipeline.shards import read_manifest
from data_pipeline.tokenizer import Tokenizer
from moe.errors import DataError


def test_round_trip_text_to_stream(tiny_data):
    """Tokenizing the corpus directly gives exactly the stream the shards hold."""
    manifest = read_manifest(tiny_data.dir)
    tok = Tokenizer(Path(tiny_data.dir) / TOKENIZER_FILE)
    assert manifest.tokenizer["sha256"] == tok.sha256
    assert tok.vocab_size == 512 and (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id) == (1, 2, 3, 0)
    src = tiny_data.sources[0]
    files = sorted(Path(src.paths[0]).iterdir())
    expected = {"train": [], "valid": []}
    for f in files:
        split = "valid" if in_valid_split(src.name, str(f), tiny_data.valid_fraction) else "train"
        expected[split] += tok.encode(f.read_text(encoding="utf-8")) + [tok.eos_id]
    for split in ("train", "valid"):
        stream = TokenStream(tiny_data.dir, split)
        got = stream.read(0, len(stream))
        assert got.tolist() == expected[split]
        assert len(stream) == manifest.splits[split].tokens
    assert manifest.splits["valid"].tokens > 0
    assert len(manifest.splits["train"].shards) > 1  # shards of 20k tokens


def test_packed_samples_are_windows_of_the_stream(tiny_data):
    r = PackedReader(tiny_data.dir, 32, seed=1, rank=0, world=1, micro_batch=4)
    stream = TokenStream(tiny_data.dir, "train")
    (batch,) = r.micro_batches(1)
    assert batch.shape == (4, 33)
    for row, pos in zip(batch, range(4)):
        i = r._sample_id(pos)
        assert row.tolist() == stream.read(i * 33, 33).tolist()


def test_ranks_read_disjoint_samples_covering_the_global_batch(tiny_data):
    world, mb, accum = 2, 3, 2
    readers = [PackedReader(tiny_data.dir, 32, 5, r, world, mb) for r in range(world)]
    single = PackedReader(tiny_data.dir, 32, 5, 0, 1, mb * world)
    for _ in range(3):
        rows = [tuple(row.tolist()) for r in readers for b in r.micro_batches(accum) for row in b]
        assert len(set(rows)) == len(rows) == world * mb * accum
        ref = [tuple(row.tolist()) for b in single.micro_batches(accum) for row in b]
        assert sorted(rows) == sorted(ref)  # same global batch on another layout


def test_resume_continues_the_same_order(tiny_data):
    a = PackedReader(tiny_data.dir, 32, 5, 0, 1, 2)
    a.micro_batches(3)
    state = a.state_dict()
    expected = a.micro_batches(2)
    b = PackedReader(tiny_data.dir, 32, 5, 0, 1, 2)
    b.load_state_dict(state)
    for x, y in zip(b.micro_batches(2), expected):
        assert np.array_equal(x.numpy(), y.numpy())


def test_order_is_deterministic_and_seeded(tiny_data):
    a = PackedReader(tiny_data.dir, 32, 5, 0, 1, 4).micro_batches(1)[0]
    b = PackedReader(tiny_data.dir, 32, 5, 0, 1, 4).micro_batches(1)[0]
    c = PackedReader(tiny_data.dir, 32, 6, 0, 1, 4).micro_batches(1)[0]
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_validation_windows_predict_every_token_once(tiny_data):
    stream = TokenStream(tiny_data.dir, "valid")
    windows = list(validation_windows(tiny_data.dir, 32))
    assert sum(len(w) - 1 for w in windows) == len(stream) - 1
    assert windows[0].tolist() == stream.read(0, 33).tolist()


def test_prepare_is_idempotent_and_refuses_other_config(tiny_data):
    report = prepare(tiny_data, progress=False)
    assert report.skipped
    import dataclasses
    other = dataclasses.replace(tiny_data, valid_fraction=0.3)
    with pytest.raises(DataError, match="different config"):
        prepare(other, progress=False)


def test_corrupt_shard_is_named(tiny_data, tmp_path):
    import shutil
    copy = tmp_path / "data"
    shutil.copytree(tiny_data.dir, copy)
    shard = copy / read_manifest(copy).splits["train"].shards[0].file
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(DataError, match=shard.name):
        TokenStream(copy, "train")
    shard.unlink()
    with pytest.raises(DataError, match="missing"):
        TokenStream(copy, "train")


def test_missing_manifest_says_what_to_do(tmp_path):
    with pytest.raises(DataError, match="moe-prepare"):
        TokenStream(tmp_path, "train")
