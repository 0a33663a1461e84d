"""The verdict on checkpoint storage after a failed save (launch/train.py, storage_verdict): a
full disk is named with the size a checkpoint of this run takes, from its newest checkpoint or,
before the first one, from the planner's figure for the config."""

import dataclasses
import json
import os
from types import SimpleNamespace

import pytest

import launch.train as train_entry
from moe.checkpoint.files import MARKER
from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.tools.planning import checkpoint_bytes
from tests.conftest import tiny_run_dict

SIZE = 4_310_052  # a real tiny checkpoint's size, from the report of this defect


@pytest.fixture
def free_bytes(monkeypatch):
    """Set the free space statvfs reports (``free_bytes(n)``)."""

    def set_free(n: int) -> None:
        monkeypatch.setattr(
            os, "statvfs", lambda path: SimpleNamespace(f_flag=0, f_bavail=n // 512, f_frsize=512)
        )

    return set_free


def write_checkpoint(ckpt_dir, tag: str, sizes: list[int]) -> int:
    """A complete checkpoint of files of these sizes; returns its size with the marker."""
    tag_dir = ckpt_dir / tag
    tag_dir.mkdir(parents=True)
    for i, n in enumerate(sizes):
        (tag_dir / f"file{i}.pt").write_bytes(b"\0" * n)
    marker = json.dumps({"step": 2})
    (tag_dir / MARKER).write_text(marker)
    return sum(sizes) + len(marker)


def test_a_full_disk_is_named_with_the_newest_checkpoints_size(tmp_path, free_bytes):
    ckpt_dir = tmp_path / "checkpoints"
    write_checkpoint(ckpt_dir, "step_0000002", [100])
    size = write_checkpoint(ckpt_dir, "step_0000004", [SIZE - 100_000, 100_000])
    free_bytes(1_000_448)
    verdict = train_entry.storage_verdict(ckpt_dir)
    assert verdict == (
        f"the checkpoint storage at {ckpt_dir} is full: 1,000,448 bytes free, a "
        f"checkpoint of this run takes about {size:,} bytes (the size of "
        "step_0000004, the newest checkpoint)"
    )
    assert "16,777,216" not in verdict


def test_before_the_first_checkpoint_the_planner_sizes_it(tiny_data, tmp_path, free_bytes):
    cfg = from_dict(RunConfig, tiny_run_dict(tiny_data, tmp_path / "runs"))
    assert cfg.model.vocab_size is None  # read from the prepared data's manifest
    planned = train_entry.checkpoint_size(tmp_path / "none", cfg)
    model = dataclasses.replace(cfg.model, vocab_size=tiny_data.tokenizer.vocab_size)
    assert planned == (
        int(checkpoint_bytes(model, "fp32", 2, 2)),
        "planned from the config: weights and optimizer states",
    )
    free_bytes(4096)
    verdict = train_entry.storage_verdict(tmp_path / "runs" / "tiny" / "checkpoints", cfg)
    assert (
        f"4,096 bytes free, a checkpoint of this run takes about {planned[0]:,} bytes "
        "(planned from the config" in verdict
    )


def test_room_for_a_checkpoint_but_not_for_the_run_beside_it(tmp_path, free_bytes):
    ckpt_dir = tmp_path / "checkpoints"
    size = write_checkpoint(ckpt_dir, "step_0000002", [SIZE])
    free_bytes(8 << 20)
    verdict = train_entry.storage_verdict(ckpt_dir)
    assert f"8,388,608 bytes free, a checkpoint of this run takes about {size:,} bytes" in verdict
    assert verdict.endswith("; less than the 16,777,216 a run needs free beside its checkpoints")
    free_bytes(17 << 20)  # room for both: a restart may succeed
    assert train_entry.storage_verdict(ckpt_dir) is None
