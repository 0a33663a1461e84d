"""The read-ahead loader: same batches in the same order, and a reader state that describes
the batches handed out, not the ones read ahead."""

from __future__ import annotations

import threading

import pytest
import torch

from data_pipeline.reader import PackedReader
from moe.training.prefetch import PrefetchingReader

ACCUM = 3


def make_reader(tiny_data, workers: int = 0) -> PackedReader:
    return PackedReader(
        tiny_data.dir,
        tiny_data.seq_len,
        tiny_data.seed,
        rank=0,
        world=1,
        micro_batch=2,
        loader_workers=workers,
    )


def tokens(steps) -> list[torch.Tensor]:
    return [b.tokens_BS for step in steps for b in step]


@pytest.mark.parametrize("workers", [0, 1])
def test_yields_the_readers_batches_in_order(tiny_data, workers):
    plain = make_reader(tiny_data)
    want = tokens(plain.next_step(ACCUM) for _ in range(5))
    loader = PrefetchingReader(make_reader(tiny_data, workers), ACCUM)
    try:
        got = tokens(loader.next_step() for _ in range(5))
    finally:
        loader.close()
    assert len(got) == len(want) == 5 * ACCUM
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_state_describes_the_steps_handed_out_not_the_one_read_ahead(tiny_data):
    reader = make_reader(tiny_data)
    loader = PrefetchingReader(reader, ACCUM)
    try:
        before = loader.state_dict()
        assert before["consumed_samples"] == 0
        for step in range(1, 4):
            loader.next_step()
            # Wait until the thread has read the next step ahead: the reader is then past it.
            for _ in range(500):
                if reader.consumed == (step + 1) * ACCUM * 2:
                    break
                threading.Event().wait(0.01)
            assert reader.consumed == (step + 1) * ACCUM * 2
            assert loader.state_dict()["consumed_samples"] == step * ACCUM * 2
        saved = loader.state_dict()
        next_batches = tokens([loader.next_step()])
    finally:
        loader.close()

    # A resumed reader continues with exactly the step after the saved ones.
    resumed = PrefetchingReader(make_reader(tiny_data), ACCUM)
    resumed.load_state_dict(saved)
    try:
        for a, b in zip(tokens([resumed.next_step()]), next_batches):
            assert torch.equal(a, b)
    finally:
        resumed.close()


def test_close_puts_the_reader_back_so_nothing_is_skipped(tiny_data):
    plain = make_reader(tiny_data)
    want = tokens(plain.next_step(ACCUM) for _ in range(3))
    loader = PrefetchingReader(make_reader(tiny_data), ACCUM)
    got = tokens([loader.next_step()])
    loader.close()  # the step read ahead is dropped and the reader rewound to it
    got += tokens([loader.next_step(), loader.next_step()])
    loader.close()
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_a_reading_error_reaches_the_training_thread(tiny_data):
    reader = make_reader(tiny_data)

    def broken(accum):
        raise OSError("shard vanished")

    reader.next_step = broken
    loader = PrefetchingReader(reader, ACCUM)
    with pytest.raises(OSError, match="shard vanished"):
        loader.next_step()
    loader.close()
