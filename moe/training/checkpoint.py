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
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from data_pipeline.shards import write_atomic  # temp name, fsync, rename
from moe.config_schema import to_dict
from moe.errors import CheckpointError
from moe.training.hooks import Hook, StepState

log = logging.getLogger("moe.train")

RUN_CONFIG = "run_config.yaml"
MARKER = "checkpoint.json"
LATEST = "latest"
TOKENIZER_COPY = "tokenizer.model"
MAIN_STATES = "mp_rank_00_model_states.pt"
EXPERT_DIR = "experts"
"""Subdirectory of a tag directory that holds DeepSpeed's per-expert files."""
FORMAT_VERSION = 1
_TAG = re.compile(r"^step_(\d{7,})$")
_EXPERT_FILE = re.compile(r"^(?:experts/)?layer_(\d+)_expert_(\d+)_mp_rank_00_model_states\.pt$")

# Model settings that change parameter shapes or their meaning; a checkpoint resumes only into a
# config that agrees on all of them (training settings such as lr or max_steps may change).
ARCHITECTURE_KEYS = (
    "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "tie_embeddings",
    "moe.num_experts", "moe.expert_hidden", "moe.activation", "moe.num_shared_experts",
    "moe.every_n_layers", "moe.first_dense_layers", "moe.dense_hidden", "moe.router.top_k",
    "moe.router.score_func", "moe.router.order",
)


def tag_for(step: int) -> str:
    return f"step_{step:07d}"


def rng_file(rank: int) -> str:
    return f"rng_rank_{rank:05d}.pt"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_marker(tag_dir: Path) -> dict | None:
    """The completion marker of a checkpoint directory, or None if the save never finished."""
    try:
        marker = json.loads((tag_dir / MARKER).read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{tag_dir / MARKER}: unreadable completion marker ({e})") from None
    if not isinstance(marker, dict) or marker.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{tag_dir / MARKER}: not a checkpoint marker of format {FORMAT_VERSION}")
    return marker


def _tags_by_step(ckpt_dir: Path) -> list[tuple[int, str]]:
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p.name) for p in ckpt_dir.iterdir()
             if p.is_dir() and (m := _TAG.match(p.name))]
    return sorted(found)


def complete_tags(ckpt_dir: Path) -> list[str]:
    """Tags of the complete checkpoints in ``ckpt_dir``, oldest first."""
    return [tag for _, tag in _tags_by_step(ckpt_dir) if (ckpt_dir / tag / MARKER).is_file()]


def find_latest(ckpt_dir: Path) -> str | None:
    """The newest complete checkpoint's tag. Directories without a completion marker are saves
    that were interrupted; they are never chosen."""
    tags = complete_tags(Path(ckpt_dir))
    return tags[-1] if tags else None


# --- Checking a checkpoint before anything is loaded ----------------------------------------


def verify_files(tag_dir: Path) -> dict:
    """Check that ``tag_dir`` is a complete checkpoint whose files are all present with the sizes
    recorded at save time, and that every expert of every MoE layer has exactly one file.
    Returns the marker."""
    tag_dir = Path(tag_dir)
    if not tag_dir.is_dir():
        raise CheckpointError(f"{tag_dir}: no such checkpoint directory")
    marker = read_marker(tag_dir)
    if marker is None:
        raise CheckpointError(f"{tag_dir}: incomplete checkpoint (no {MARKER}); its save was "
                              "interrupted. Resume from an earlier one (--resume auto picks the "
                              "newest complete checkpoint)")
    problems = []
    for name, size in marker["files"].items():
        path = tag_dir / name
        if not path.is_file():
            problems.append(f"{path}: missing (the checkpoint recorded {size} bytes)")
        elif path.stat().st_size != size:
            problems.append(f"{path}: truncated or altered: {path.stat().st_size} bytes, the "
                            f"checkpoint recorded {size}")
    expected = {(layer, e) for layer in range(marker["num_moe_layers"])
                for e in range(marker["num_experts"])}
    present = {(int(m.group(1)), int(m.group(2))): name for name in marker["files"]
               if (m := _EXPERT_FILE.match(name))}
    missing = sorted(expected - present.keys())
    extra = sorted(present.keys() - expected)
    if missing:
        problems.append(f"{tag_dir}: no file for (MoE layer, expert) {missing[:8]}")
    if extra:
        problems.append(f"{tag_dir}: unexpected expert files {[present[k] for k in extra[:8]]}")
    if problems:
        raise CheckpointError("damaged checkpoint:\n" + "\n".join(f"  - {p}" for p in problems))
    return marker


def _get(d: dict, dotted: str):
    for k in dotted.split("."):
        d = d.get(k) if isinstance(d, dict) else None
    return d


def config_mismatches(saved_model: dict, model_cfg) -> list[str]:
    """Architecture settings on which a saved model config and ``model_cfg`` disagree."""
    current = to_dict(model_cfg)
    return [f"model.{key}: the checkpoint has {_get(saved_model, key)!r}, the config has "
            f"{_get(current, key)!r}"
            for key in ARCHITECTURE_KEYS if _get(saved_model, key) != _get(current, key)]


def verify_checkpoint(tag_dir: Path, cfg=None, tokenizer_sha256: str | None = None) -> dict:
    """Everything checkable before loading: complete, no missing or truncated file, every expert
    present once, the same architecture as ``cfg`` and the same tokenizer. Returns the marker."""
    import yaml

    marker = verify_files(tag_dir)
    problems = []
    if cfg is not None:
        saved = yaml.safe_load((Path(tag_dir) / RUN_CONFIG).read_text())
        problems += [f"{p} ({Path(tag_dir) / RUN_CONFIG})"
                     for p in config_mismatches(saved.get("model", {}), cfg.model)]
    saved_tok = marker.get("tokenizer") or {}
    if tokenizer_sha256 is not None and saved_tok.get("sha256") != tokenizer_sha256:
        problems.append(f"tokenizer: the checkpoint was trained with {saved_tok.get('file')} "
                        f"(sha256 {str(saved_tok.get('sha256'))[:12]}...), the data uses sha256 "
                        f"{tokenizer_sha256[:12]}...; token ids would mean different text")
    if problems:
        raise CheckpointError(f"checkpoint {tag_dir} does not match this run:\n"
                              + "\n".join(f"  - {p}" for p in problems))
    return marker


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


def load_file(path: Path) -> dict:
    """torch.load restricted to tensors and plain data, with errors that name the file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing checkpoint file") from None
    except Exception as e:  # torch raises many types for truncated or foreign files
        raise CheckpointError(f"{path}: unreadable checkpoint file ({type(e).__name__}: {e})") from e


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
        tags = _tags_by_step(self.ckpt_dir)
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
