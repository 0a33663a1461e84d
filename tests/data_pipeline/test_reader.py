"""The streaming reader: windows of the token stream, one global order whatever the layout,
exact resume on another layout, mixtures, document ids, determinism."""

import json

import numpy as np
import pytest
import torch

from data_pipeline import reader as reader_module
from data_pipeline.errors import DataError
from data_pipeline.reader import PackedReader
from data_pipeline.token_stream import TokenStream, validation_windows
from tests.helpers.reader_reference import ReferenceRows, reference_doc_ids


def reader(cfg, rank=0, world=1, micro_batch=1, **kw) -> PackedReader:
    return PackedReader(cfg.dir, cfg.seq_len, cfg.seed, rank, world, micro_batch, **kw)


def reference(cfg, n, start=0, **kw) -> np.ndarray:
    """Rows of global positions [start, start + n), read on one rank as one micro-batch."""
    r = reader(cfg, micro_batch=n, **kw)
    r.consumed = start
    return r.micro_batches(1)[0].numpy()


def read_layout(cfg, world, micro_batch, accum, steps, workers=0, state=None, **kw):
    """{global position: row} of what every rank of a layout reads in ``steps`` steps, with the
    positions computed from the documented layout formula, and the state at the end."""
    rows = {}
    for rank in range(world):
        r = reader(cfg, rank, world, micro_batch, loader_workers=workers, **kw)
        if state is not None:
            r.load_state_dict(state)
        for _ in range(steps):
            start = r.consumed
            for m, batch in enumerate(r.micro_batches(accum)):
                assert batch.shape == (micro_batch, cfg.seq_len + 1) and batch.dtype == torch.int64
                for j, row in enumerate(batch.numpy()):
                    g = start + (m * world + rank) * micro_batch + j
                    assert g not in rows, f"position {g} read twice"
                    rows[g] = row
    return rows, r.state_dict()


def epoch_windows(stream, epoch) -> list[tuple]:
    order, _, _ = stream._epoch(epoch)
    tokens = np.concatenate([stream.arrays[i] for i in order])
    S = stream.window
    return [tuple(tokens[i * S : (i + 1) * S]) for i in range(stream.num_samples)]


def test_each_epoch_reads_every_window_of_its_shard_order_once(tiny_data):
    r = reader(tiny_data)
    stream = r.streams[0]
    n = stream.num_samples
    assert len(stream.arrays) > 1
    rows = reference(tiny_data, 2 * n)
    for epoch in (0, 1):
        got = sorted(tuple(row) for row in rows[epoch * n : (epoch + 1) * n])
        assert got == sorted(epoch_windows(stream, epoch))
    # Epochs differ in order, and (shards reshuffled) in where windows are cut.
    assert not np.array_equal(rows[:n], rows[n:])


@pytest.mark.parametrize(
    "world,micro_batch,accum,workers", [(2, 3, 2, 0), (3, 2, 1, 2), (1, 5, 3, 2)]
)
def test_ranks_and_workers_read_disjoint_parts_of_one_global_order(
    mixed_data, world, micro_batch, accum, workers
):
    steps = 3
    rows, state = read_layout(mixed_data, world, micro_batch, accum, steps, workers)
    total = steps * accum * world * micro_batch
    assert sorted(rows) == list(range(total))  # contiguous, nothing twice (checked on insert)
    ref = reference(mixed_data, total)
    assert all(np.array_equal(rows[g], ref[g]) for g in range(total))
    assert state["consumed_samples"] == total


@pytest.mark.parametrize(
    "before,after",
    [((2, 3, 1, 0), (2, 3, 1, 0)), ((2, 3, 1, 0), (3, 2, 2, 1)), ((1, 4, 2, 2), (4, 1, 1, 0))],
)
def test_resume_on_any_layout_continues_the_global_order(mixed_data, before, after):
    world, mb, accum, workers = before
    first, state = read_layout(mixed_data, world, mb, accum, 2, workers)
    c = state["consumed_samples"]
    world, mb, accum, workers = after
    rows, _ = read_layout(mixed_data, world, mb, accum, 2, workers, state=state)
    n = 2 * world * mb * accum
    assert sorted(rows) == list(range(c, c + n))  # nothing repeated or skipped
    ref = reference(mixed_data, c + n)
    assert all(np.array_equal(rows[g], ref[g]) for g in rows)
    assert all(np.array_equal(first[g], ref[g]) for g in first)


def test_skipped_ranges_are_never_read_and_the_rest_keeps_its_order(mixed_data):
    """A step starting inside a skipped range starts at its end (adjacent ranges chain); the
    state after the jump is a valid cursor for a resume on any layout."""
    r = reader(mixed_data, micro_batch=2)
    r.skip([(8, 12), (4, 6), (6, 8)])
    for _ in range(4):
        r.micro_batches(1)
    assert r.consumed == 16  # steps read [0, 2), [2, 4), [12, 14), [14, 16)
    state = r.state_dict()
    resumed = reader(mixed_data, micro_batch=2)
    resumed.load_state_dict(state)
    ref = reference(mixed_data, 18)
    assert np.array_equal(resumed.micro_batches(1)[0].numpy(), ref[16:18])
    again = reader(mixed_data, micro_batch=2)
    again.skip([(4, 12)])
    rows = np.concatenate([again.micro_batches(1)[0].numpy() for _ in range(3)])
    assert np.array_equal(rows, ref[[0, 1, 2, 3, 12, 13]])
    # A global batch that no longer lines up with a skipped range: refused, naming both ranges.
    wider = reader(mixed_data, micro_batch=3)
    wider.skip([(4, 6)])
    wider.micro_batches(1)
    with pytest.raises(
        DataError,
        match=r"samples \[4, 6\).*begin inside this step's samples "
        r"\[3, 6\): the global batch changed",
    ):
        wider.micro_batches(1)


def test_state_is_small_and_counts_each_source(mixed_data):
    r = reader(mixed_data, micro_batch=7)
    for _ in range(5):
        r.micro_batches(3)
    state = r.state_dict()
    assert len(json.dumps(state)) < 1024
    counts = {k: v["samples"] for k, v in state["sources"].items()}
    assert sum(counts.values()) == state["consumed_samples"] == 105
    assert all(
        v["tokens"] == v["samples"] * (mixed_data.seq_len + 1) for v in state["sources"].values()
    )


def test_mixture_token_proportions_track_the_weights(mixed_data):
    weights = {"files": 0.3, "paras": 0.7}
    r = reader(mixed_data, micro_batch=1000, weights=weights)
    rows = np.concatenate([r.micro_batches(1)[0].numpy() for _ in range(10)])  # 10k sequences
    # Classify each sequence by the windows each source can produce in the epochs read.
    state = r.state_dict()["sources"]
    sets = {
        s.name: {w for e in range(state[s.name]["epoch"] + 1) for w in epoch_windows(s, e)}
        for s in r.streams
    }
    origin = [[name for name, ws in sets.items() if tuple(row) in ws] for row in rows]
    assert all(len(o) >= 1 for o in origin)
    unique = [o[0] for o in origin if len(o) == 1]
    assert len(unique) > 9900
    for name, w in weights.items():
        assert abs(unique.count(name) / len(unique) - w) < 0.01
        assert abs(state[name]["tokens"] / (10_000 * (mixed_data.seq_len + 1)) - w) < 0.01


def test_changing_weights_on_resume_continues_each_source(mixed_data):
    a = reader(mixed_data, micro_batch=50, weights={"files": 1, "paras": 1})
    a.micro_batches(2)
    before = a.state_dict()
    b = reader(mixed_data, micro_batch=50, weights={"files": 1, "paras": 9})
    b.load_state_dict(before)
    b.micro_batches(10)
    after = b.state_dict()["sources"]
    gained = {n: after[n]["samples"] - before["sources"][n]["samples"] for n in after}
    assert sum(gained.values()) == 500 and abs(gained["paras"] / 500 - 0.9) < 0.01
    # Each source continues at its own counter: its next samples are the ones it had not read.
    solo = reader(mixed_data, micro_batch=50, weights={"files": 1, "paras": 9})
    solo.load_state_dict(b.state_dict())
    assert solo.schedule.base_counts.tolist() == [
        before["sources"]["files"]["samples"],
        before["sources"]["paras"]["samples"],
    ]


def test_resuming_on_other_data_is_refused_unless_allowed(mixed_data):
    state = reader(mixed_data).state_dict()
    state["fingerprint"] = "0" * 16
    with pytest.raises(DataError, match="fingerprint"):
        reader(mixed_data).load_state_dict(state)
    r = reader(mixed_data, allow_other_data=True)
    r.load_state_dict(state)
    with pytest.raises(DataError, match="seq_len/seed"):
        reader(mixed_data).load_state_dict({**reader(mixed_data).state_dict(), "seed": 99})


def test_document_ids_follow_eos(mixed_data):
    r = reader(mixed_data, micro_batch=256, document_ids=True)
    eos = r.eos_id
    (batch,) = r.next_step(1)
    assert batch.doc_ids_BS.shape == batch.tokens_BS.shape
    assert (batch.tokens_BS == eos).any(dim=1).sum() > 20  # many sequences span documents
    for tokens, ids in zip(batch.tokens_BS.numpy(), batch.doc_ids_BS.tolist()):
        assert ids == reference_doc_ids(tokens, eos)  # the EOS belongs to the document it ends
    assert reader(mixed_data, micro_batch=2).next_step(1)[0].doc_ids_BS is None


@pytest.mark.parametrize(
    "micro_batch,world,accum,small_plans",
    [(1, 1, 1, True), (3, 2, 2, True), (7, 1, 3, True), (40, 3, 1, True), (7, 2, 2, False)],
)
def test_batches_match_the_per_row_definition(
    mixed_data, monkeypatch, micro_batch, world, accum, small_plans
):
    """Every row and document id against the definition, one position at a time, over two
    sources and more than an epoch of each: rows that cross shards, and (small plans) plans and
    copy groups that end mid-step, groups of several micro-batches and a shorter last group."""
    if small_plans:
        monkeypatch.setattr(reader_module, "PLAN_ROWS", 60)
        monkeypatch.setattr(reader_module, "GROUP_ROWS", 16)
    rank = world - 1
    r = reader(mixed_data, rank, world, micro_batch, document_ids=True)
    ref = ReferenceRows(r)
    G = accum * world * micro_batch
    positions = []
    # Sources are drawn in proportion to their sizes: a tenth more than all their samples
    # passes the end of every source's first epoch.
    for t in range(int(1.1 * sum(s.num_samples for s in r.streams)) // G + 1):
        for m, batch in enumerate(r.next_step(accum)):
            pos = t * G + (m * world + rank) * micro_batch + np.arange(micro_batch)
            want = np.stack([ref(int(g)) for g in pos])
            assert batch.tokens_BS.dtype == torch.int64 and batch.doc_ids_BS.dtype == torch.int32
            assert np.array_equal(batch.tokens_BS.numpy(), want)
            assert batch.doc_ids_BS.tolist() == [reference_doc_ids(row, r.eos_id) for row in want]
            positions.append(pos)
    assert all(v["epoch"] >= 1 for v in r.state_dict()["sources"].values())
    _, _, shard, _, _ = r._locate(np.concatenate(positions))
    assert (shard < 0).any()  # some rows crossed a shard boundary


def test_batches_stay_valid_and_separate(mixed_data):
    """A batch is never overwritten by later ones, and writing into one leaves the others."""
    r = reader(mixed_data, micro_batch=3, document_ids=True)
    held, copies = [], []
    for _ in range(50):
        for b in r.next_step(2):
            held.append(b)
            copies.append((b.tokens_BS.clone(), b.doc_ids_BS.clone()))
    assert all(
        torch.equal(b.tokens_BS, t) and torch.equal(b.doc_ids_BS, d)
        for b, (t, d) in zip(held, copies)
    )
    for i, b in enumerate(held):
        b.tokens_BS.fill_(-i)
        b.doc_ids_BS.fill_(-i)
    assert all((b.tokens_BS == -i).all() and (b.doc_ids_BS == -i).all() for i, b in enumerate(held))


def test_order_is_deterministic_and_seeded(mixed_data):
    a = reference(mixed_data, 8)
    assert np.array_equal(a, reference(mixed_data, 8))
    r = PackedReader(mixed_data.dir, mixed_data.seq_len, mixed_data.seed + 1, 0, 1, 8)
    assert not np.array_equal(a, r.micro_batches(1)[0].numpy())


def test_validation_windows_predict_every_token_once(tiny_data):
    stream = TokenStream(tiny_data.dir, "valid")
    windows = [w for w, _ in validation_windows(tiny_data.dir, 32)]
    assert sum(len(w) - 1 for w in windows) == len(stream) - 1
    assert windows[0].tolist() == stream.read(0, 33).tolist()
    assert [w.tolist() for w in windows] == [
        w.tolist() for w, _ in validation_windows(tiny_data.dir, 32)
    ]
    # Data without a loss mask: every next token is a target.
    assert all(t.tolist() == w[1:].tolist() for w, t in validation_windows(tiny_data.dir, 32))


def test_validation_windows_of_one_source(mixed_data):
    one = list(validation_windows(mixed_data.dir, 16, source="paras"))
    stream = TokenStream(mixed_data.dir, "valid", source="paras")
    assert sum(len(w) - 1 for w, _ in one) == len(stream) - 1
    assert len(stream) < len(TokenStream(mixed_data.dir, "valid"))
