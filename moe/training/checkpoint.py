"""Saving and resuming training checkpoints (DeepSpeed files plus our own run state)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch.distributed as dist

from moe.errors import CheckpointError
from moe.training.hooks import Hook, StepState

log = logging.getLogger("moe.train")

RUN_CONFIG = "run_config.yaml"


def find_latest(ckpt_dir: Path) -> str | None:
    """The tag DeepSpeed recorded as latest, if it exists on disk."""
    latest = ckpt_dir / "latest"
    if not latest.exists():
        return None
    tag = latest.read_text().strip()
    if not (ckpt_dir / tag).is_dir():
        raise CheckpointError(f"{latest} names {tag!r}, which is not a directory in {ckpt_dir}")
    return tag


def load_training_state(engine, reader, ckpt_dir: Path, tag: str) -> int:
    path, client = engine.load_checkpoint(str(ckpt_dir), tag)
    if path is None or client is None:
        raise CheckpointError(f"could not load checkpoint {ckpt_dir / tag}")
    reader.load_state_dict(client["data"])
    return int(client["step"])


class CheckpointHook(Hook):
    def __init__(self, engine, reader, ckpt_dir: Path, every_n_steps: int, config_text: str,
                 rank: int):
        self.engine, self.reader = engine, reader
        self.ckpt_dir, self.every = ckpt_dir, every_n_steps
        self.config_text, self.rank = config_text, rank
        self.last_tag: str | None = None
        self.last_step = -1

    def on_step_end(self, s: StepState) -> None:
        if self.every and s.step % self.every == 0:
            self.save(s.step)

    def save(self, step: int) -> None:
        if step == self.last_step:  # already saved by the periodic schedule
            return
        tag = f"step_{step:07d}"
        t0 = time.time()
        client = {"step": step, "data": self.reader.state_dict()}
        self.engine.save_checkpoint(str(self.ckpt_dir), tag=tag, client_state=client)
        if self.rank == 0:
            (self.ckpt_dir / tag / RUN_CONFIG).write_text(self.config_text)
        if dist.is_initialized():
            dist.barrier()
        self.last_tag, self.last_step = tag, step
        if self.rank == 0:
            log.info(f"saved checkpoint {self.ckpt_dir / tag} in {time.time() - t0:.1f}s")
