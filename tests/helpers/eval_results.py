"""Results of moe-eval as evaluate_checkpoint_dir returns them, made up, for tests of the report
and the command line that need no model: a checkpoint directory that holds only its marker."""

from __future__ import annotations

import math
from pathlib import Path


def fake_checkpoint(run_dir: Path, step: int) -> Path:
    """A directory that moe-eval takes for a complete checkpoint until something loads it."""
    tag_dir = run_dir / "checkpoints" / f"step_{step:07d}"
    tag_dir.mkdir(parents=True)
    (tag_dir / "checkpoint.json").write_text("{}")
    return tag_dir


def fake_layer(block: int, experts: int = 4) -> dict:
    return {
        "block": block,
        "tokens": 10,
        "routed_copies": 20,
        "load_fraction": [1 / experts] * experts,
        "max_over_mean_load": 1.0,
        "load_cv": 0.0,
        "dropped_fraction": 0.0,
        "router_entropy": 1.3,
        "router_entropy_uniform": math.log(experts),
        "top_tokens": [[] for _ in range(experts)],
    }


def fake_result(tag_dir: Path, experts: bool = True) -> dict:
    """One checkpoint's entry of eval.json: a loss, and expert statistics of two blocks."""
    result = {
        "checkpoint": str(tag_dir),
        "tag": tag_dir.name,
        "step": int(tag_dir.name.removeprefix("step_")),
        "run_dir": str(tag_dir.parent.parent),
        "data": "made-up tokens",
        "vocab_size": 512,
        "uniform_loss": math.log(512),
        "batch_size": 2,
        "seq_len": 32,
        "capacity_factor": None,
        "loss": 6.0,
        "perplexity": math.exp(6.0),
        "tokens": 100,
        "positions": 100,
        "seconds": 0.1,
    }
    if experts:
        result["experts"] = [fake_layer(0), fake_layer(1)]
    return result
