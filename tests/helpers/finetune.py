"""Fine-tuning runs for tests: a tiny pretrained base and a run fine-tuned from it."""

from __future__ import annotations

import copy
from pathlib import Path

from moe.checkpoint.consolidate import read_consolidated
from moe.checkpoint.files import find_latest
from tests.conftest import tiny_run_dict


def base_and_finetune(data, runs: Path, finetune: dict, **train) -> tuple[dict, dict]:
    """Run configs: "base" (6 steps of pretraining, 2 ranks, expert parallelism 2, ZeRO 2, one
    shared expert) and "ft" (``finetune`` from base's last checkpoint; ``train``: its train
    section's changes)."""
    base = tiny_run_dict(data, runs)
    base["name"] = "base"
    base["model"]["moe"]["num_shared_experts"] = 1
    base["train"].update(max_steps=6, micro_batch_size=4, lr=3e-3)
    ft = copy.deepcopy(base)
    ft["name"] = "ft"
    ft["model"]["init_from"] = str(runs / "base")
    ft["finetune"] = finetune
    ft["train"].update(train)
    return base, ft


def latest_weights(run_dir: Path) -> dict:
    """The single-device state dict of a run's newest checkpoint."""
    ckpt = run_dir / "checkpoints"
    return read_consolidated(ckpt / find_latest(ckpt))[0]
