"""Saving and resuming training checkpoints: DeepSpeed's files plus our own run state, published
crash-safely.

A checkpoint is the directory ``<run>/checkpoints/step_NNNNNNN`` holding

- DeepSpeed's files: model states (non-expert weights, LR scheduler, our client state: step,
  token counter, data cursor), the ZeRO optimizer partitions of every rank, and in ``experts/``
  one file per expert of every MoE layer (DeepSpeed's ``zero_to_fp32`` script, which DeepSpeed
  copies next to the checkpoints, reads the directory as it is);
- ``rng_rank_NNNNN.pt``: the Python, NumPy and torch RNG states of each rank;
- ``run_config.yaml`` (the resolved config) and ``tokenizer.model`` (a copy of the tokenizer);
- ``checkpoint.json``, the completion marker, written last.

Publishing order (why a killed process never leaves a broken "latest"): every rank writes its
files; a barrier; rank 0 records each file's size in the marker, flushes everything to disk and
renames the marker into place. Only then is the checkpoint complete: :func:`find_latest` returns
the newest directory that has a marker, whatever DeepSpeed's ``latest`` file says (we still write
that file, after the marker, for DeepSpeed's own tools). Older checkpoints are pruned only after
the new one is complete, marker first, so an interrupted prune leaves an incomplete directory and
never a complete-looking partial one.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from data_pipeline.shards import write_atomic  # temp name, fsync, rename
from moe.checkpoint.files import (
    EXPERT_DIR,
    FORMAT_VERSION,
    LATEST,
    MARKER,
    RUN_CONFIG,
    TOKENIZER_COPY,
    complete_tags,
    find_latest,
    load_file,
    read_marker,
    rng_file,
    tag_for,
    tags_by_step,
)
from moe.errors import CheckpointError
from moe.training.hooks import Hook, StepState

log = logging.getLogger("moe.train")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- RNG state --------------------------------------------------------------------------------


def rng_state() -> dict:
    np_state = np.random.get_state()
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                      "pos": int(np_state[2]), "has_gauss": int(np_state[3]),
                      "cached_gaussian": float(np_state[4])},
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --- Saving -----------------------------------------------------------------------------------


@dataclass
class SaveContext:
    """What a checkpoint records besides DeepSpeed's state."""

    config_text: str
    tokenizer_file: Path
    tokenizer_sha256: str
    world_size: int
    expert_parallel_size: int
    num_moe_layers: int
    num_experts: int
    keep_last: int | None = None


class CheckpointHook(Hook):
    """Saves every ``every_n_steps`` steps; :meth:`save` may also be called at any step boundary
    (end of training, a preemption signal). All ranks must call it together."""

    def __init__(self, engine, reader, ckpt_dir: Path, every_n_steps: int, ctx: SaveContext,
                 rank: int):
        self.engine, self.reader = engine, reader
        self.ckpt_dir, self.every = Path(ckpt_dir), every_n_steps
        self.ctx, self.rank = ctx, rank
        self.last_tag: str | None = None
        self.last_step = -1
        self.tokens = 0  # tokens trained on, kept up to date by the loop
        self.last_save_seconds: float | None = None
        self.fingerprints: dict[str, list[float]] = {}

    def on_step_end(self, s: StepState) -> None:
        if self.every and s.step % self.every == 0:
            self.save(s.step)

    def save(self, step: int) -> None:
        if step == self.last_step:  # already saved at this step (periodic, or resumed here)
            return
        t0 = time.time()
        tag = tag_for(step)
        tag_dir = self.ckpt_dir / tag
        if self.rank == 0:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            if tag_dir.exists():
                # A complete checkpoint of this step belongs to another run history (e.g. one
                # resumed from an earlier checkpoint): move it aside rather than overwrite it;
                # an incomplete one is debris of an interrupted save.
                if read_marker(tag_dir) is not None:
                    tag_dir.rename(tag_dir.with_name(f"{tag}.replaced.{int(time.time())}"))
                else:
                    shutil.rmtree(tag_dir)
        _barrier()
        if self.ctx.num_moe_layers:  # after the barrier: rank 0 has cleared any debris
            (tag_dir / EXPERT_DIR).mkdir(parents=True, exist_ok=True)
        from moe.parallel.deepspeed_adapter import gather_expert_fingerprints  # (imports deepspeed)

        self.fingerprints = gather_expert_fingerprints(self.engine.module)
        client = {"step": step, "tokens": self.tokens, "data": self.reader.state_dict()}
        self.engine.save_checkpoint(str(self.ckpt_dir), tag=tag, client_state=client,
                                    save_latest=False)
        write_atomic(tag_dir / rng_file(self.rank), _serialize(rng_state()))
        if self.rank == 0:
            write_atomic(tag_dir / RUN_CONFIG, self.ctx.config_text.encode())
            write_atomic(tag_dir / TOKENIZER_COPY, self.ctx.tokenizer_file.read_bytes())
        _barrier()  # every rank's files are written: now, and only now, publish
        if self.rank == 0:
            self._publish(tag_dir, step)
            self._prune()
        _barrier()
        self.last_tag, self.last_step = tag, step
        self.last_save_seconds = time.time() - t0
        if self.rank == 0:
            log.info(f"saved checkpoint {tag_dir} in {self.last_save_seconds:.2f}s")

    def _publish(self, tag_dir: Path, step: int) -> None:
        files = {}
        for p in sorted(tag_dir.rglob("*")):
            if p.is_file() and p.name != MARKER:
                _fsync(p)
                files[p.relative_to(tag_dir).as_posix()] = p.stat().st_size
        if (tag_dir / EXPERT_DIR).is_dir():
            _fsync(tag_dir / EXPERT_DIR)
        ctx = self.ctx
        marker = {"format": FORMAT_VERSION, "tag": tag_dir.name, "step": step,
                  "tokens": self.tokens, "world_size": ctx.world_size,
                  "expert_parallel_size": ctx.expert_parallel_size,
                  "num_moe_layers": ctx.num_moe_layers, "num_experts": ctx.num_experts,
                  "tokenizer": {"file": ctx.tokenizer_file.name, "sha256": ctx.tokenizer_sha256},
                  "expert_fingerprints": self.fingerprints, "files": files, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        write_atomic(tag_dir / MARKER, json.dumps(marker, indent=1).encode())
        _fsync(tag_dir)
        write_atomic(self.ckpt_dir / LATEST, tag_dir.name.encode())  # for DeepSpeed's own tools
        _fsync(self.ckpt_dir)

    def _prune(self) -> None:
        """Keep the newest ``keep_last`` complete checkpoints; drop debris of interrupted saves
        older than the newest complete one."""
        keep = self.ctx.keep_last
        tags = tags_by_step(self.ckpt_dir)
        complete = [(s, t) for s, t in tags if (self.ckpt_dir / t / MARKER).is_file()]
        if not complete:
            return
        doomed = [t for _, t in complete[:-keep]] if keep else []
        doomed += [t for s, t in tags if (s, t) not in complete and s < complete[-1][0]]
        for tag in doomed:
            d = self.ckpt_dir / tag
            (d / MARKER).unlink(missing_ok=True)  # first: a half-deleted one is never "complete"
            shutil.rmtree(d, ignore_errors=True)


def _serialize(obj) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# --- Resuming ---------------------------------------------------------------------------------


def resolve_resume(resume: str, ckpt_dir: Path) -> Path | None:
    """``auto``: the newest complete checkpoint of the run, if any; ``none``: start fresh (refused
    when the run already has checkpoints, which a fresh run would overwrite); otherwise a path to
    a checkpoint directory."""
    if resume == "auto":
        tag = find_latest(ckpt_dir)
        return ckpt_dir / tag if tag else None
    if resume == "none":
        if complete_tags(ckpt_dir):
            raise CheckpointError(f"{ckpt_dir} already holds checkpoints "
                                  f"({', '.join(complete_tags(ckpt_dir)[-3:])}); a fresh run would "
                                  "overwrite them. Use --resume auto, or another run name")
        return None
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"--resume {resume}: no such checkpoint directory")
    return path


def load_rng(tag_dir: Path, marker: dict, rank: int, world_size: int, seed: int) -> bool:
    """Restore this rank's RNG state when the layout matches the saving one; otherwise give each
    rank a fresh stream derived from (seed, rank, step). Returns whether the state was restored."""
    if marker["world_size"] == world_size:
        set_rng_state(load_file(Path(tag_dir) / rng_file(rank)))
        return True
    s = seed + 1_000_003 * (marker["step"] + 1) + 1000 * rank
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)
    return False
