"""Saving and resuming training checkpoints: DeepSpeed's files plus our own run state, published
crash-safely.

A checkpoint is the directory ``<run>/checkpoints/step_NNNNNNN`` holding

- DeepSpeed's files: model states (non-expert weights, LR scheduler, our client state: step,
  token counter, and the state of every part registered with the checkpointer, each under its
  name: the data cursor, the guards' windows, ESFT's selection, ...), the ZeRO optimizer
  partitions of every rank, and in ``experts/``
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

A save that fails (disk full, permission lost, an I/O error) on any rank fails on every rank:
each phase ends in one collective where the ranks exchange their errors instead of a bare
barrier, and a rank whose write failed still runs DeepSpeed's whole save (its file writes are
caught and recorded, see :class:`_RecordingEngine`) so that no rank waits in a barrier the others
never reach. Rank 0 then removes the partial directory (it never got a marker); the previous
complete checkpoint stays the newest, and nothing is pruned. ``checkpoint.on_save_error`` decides
whether training stops (:class:`CheckpointSaveError`) or goes on and tries again at the next save.
"""

from __future__ import annotations

import errno
import json
import logging
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

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
    resolve_checkpoint,
    rng_file,
    tag_for,
    tags_by_step,
)
from moe.core.errors import CheckpointError
from moe.core.fileio import fsync_path, write_atomic  # temp name, fsync, rename

log = logging.getLogger("moe.train")


# --- RNG state --------------------------------------------------------------------------------


def rng_state() -> dict:
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "numpy": {
            "name": np_state[0],
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (
            n["name"],
            n["keys"].numpy().astype(np.uint32),
            n["pos"],
            n["has_gauss"],
            n["cached_gaussian"],
        )
    )
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --- What a checkpoint carries ----------------------------------------------------------------


class Stateful(Protocol):
    """A part of a run whose state every checkpoint carries, registered by name (:func:`carry`).
    ``state_dict`` gives plain data and tensors (the checkpoint is read back with
    ``weights_only``); ``load_state_dict`` takes it back on resume, on any layout, and on a
    rollback, or None when the checkpoint holds nothing under the part's name (saved before the
    part existed, or with it switched off): the part starts fresh or refuses, naming why."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict | None) -> None: ...


RESERVED_NAMES = (
    "step",
    "tokens",
    "module",
    "optimizer",
    "lr_scheduler",
    "buffer_names",
    "param_shapes",
    "frozen_param_shapes",
    "frozen_param_fragments",
    "shared_params",
    "sparse_tensor_module_names",
    "skipped_steps",
    "global_steps",
    "global_samples",
    "dp_world_size",
    "mp_world_size",
    "ds_config",
    "ds_version",
    "data_sampler",
    "random_ltd",
    "num_experts",
    "checkpoint_parallel_dimensions",
    "ds_autoep_layers",
)
"""Entries of a checkpoint's model-states file that are not a registered part's: the loop's
step and token counter, and DeepSpeed's own (tests/moe/training/test_layout_resume.py checks
this list against a saved file), which a part of the same name would overwrite."""


def carry(states: dict[str, Stateful], name: str, part: Stateful) -> None:
    """Register ``part`` in ``states`` (the dict a :class:`Checkpointer` saves) under ``name``."""
    if name in RESERVED_NAMES or name in states:
        taken = "reserved" if name in RESERVED_NAMES else f"taken by {states[name]!r}"
        raise ValueError(f"checkpoint state name {name!r} is {taken}")
    states[name] = part


def restore(states: dict[str, Stateful], client: dict, source: Path) -> None:
    """Give every registered part its state from ``client``, a checkpoint's client state
    (DeepSpeed's, or :func:`~moe.parallel.layout.load_other_layout`'s on another layout);
    ``source``: the checkpoint, named in errors."""
    for name, part in states.items():
        try:
            part.load_state_dict(client.get(name))
        except CheckpointError as e:
            raise CheckpointError(f"{source}: {e}") from None


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


class Checkpointer:
    """Writes the checkpoint of a step when the loop asks (every ``checkpoint.every_n_steps``,
    at the end, on a preemption). All ranks must call :meth:`save` together.

    ``states``: name -> part (:class:`Stateful`, registered with :func:`carry`); each save
    holds every part's ``state_dict()`` under its name, beside the step and the token counter.
    The dict is read at each save: a part registered later is saved too."""

    def __init__(
        self,
        engine,
        ckpt_dir: Path,
        ctx: SaveContext,
        rank: int,
        on_error: str = "stop",
        states: dict[str, Stateful] | None = None,
    ):
        self.engine = engine
        self.states = {} if states is None else states
        self.on_error = on_error  # checkpoint.on_save_error: stop | continue
        self.ckpt_dir = Path(ckpt_dir)
        self.ctx, self.rank = ctx, rank
        self.fingerprints: dict[str, list[float]] = {}

    def save(self, step: int, tokens: int) -> Path | None:
        """The complete checkpoint of ``step`` (``tokens`` trained on so far); None when the save
        failed and ``on_save_error`` is ``continue`` (with ``stop`` it raises
        :class:`CheckpointSaveError`)."""
        t0 = time.time()
        tag = tag_for(step)
        tag_dir = self.ckpt_dir / tag
        errors: list[str] = []
        if self.rank == 0:
            with _recorded(errors, self.ckpt_dir):
                self.ckpt_dir.mkdir(parents=True, exist_ok=True)
                if tag_dir.exists():
                    # A complete checkpoint of this step belongs to another run history (e.g.
                    # one resumed from an earlier checkpoint): move it aside rather than
                    # overwrite it; an incomplete one is debris of an interrupted save.
                    if read_marker(tag_dir) is not None:
                        tag_dir.rename(tag_dir.with_name(f"{tag}.replaced.{int(time.time())}"))
                    else:
                        shutil.rmtree(tag_dir)
        # after this exchange: rank 0 has cleared any debris (a failure here wrote nothing, and
        # what it could not move aside may be another history's complete checkpoint: kept)
        if self._failed(step, tag_dir, _exchange(errors), remove=False):
            return None
        self._write(step, tokens, tag, tag_dir, errors)
        if self._failed(step, tag_dir, _exchange(errors)):  # every rank's files are written
            return None
        if self.rank == 0:  # now, and only now, publish
            with _recorded(errors, tag_dir):
                self._publish(tag_dir, step, tokens)
            if not errors:
                try:
                    self._prune()
                except OSError as e:  # the new checkpoint is complete: keep it, prune next time
                    log.warning(f"pruning old checkpoints failed: {_describe(e, self.ckpt_dir)}")
        if self._failed(step, tag_dir, _exchange(errors)):
            return None
        # every rank (its own files are part of it): each rank's log tells its own story
        log.info(f"saved checkpoint {tag_dir} in {time.time() - t0:.2f}s")
        return tag_dir

    def _write(self, step: int, tokens: int, tag: str, tag_dir: Path, errors: list[str]) -> None:
        """This rank's files; write errors are recorded in ``errors``, never raised (see the
        module docstring)."""
        from moe.parallel.deepspeed_adapter import gather_expert_fingerprints  # (imports deepspeed)

        with _recorded(errors, tag_dir / EXPERT_DIR):
            if self.ctx.num_moe_layers:
                (tag_dir / EXPERT_DIR).mkdir(parents=True, exist_ok=True)
        self.fingerprints = gather_expert_fingerprints(self.engine.module)
        client = {
            "step": step,
            "tokens": tokens,
            **{name: part.state_dict() for name, part in self.states.items()},
        }
        with _RecordingEngine(self.engine, errors):
            self.engine.save_checkpoint(
                str(self.ckpt_dir), tag=tag, client_state=client, save_latest=False
            )
        with _recorded(errors, tag_dir / rng_file(self.rank)):
            write_atomic(tag_dir / rng_file(self.rank), _serialize(rng_state()))
        if self.rank == 0:
            with _recorded(errors, tag_dir / RUN_CONFIG):
                write_atomic(tag_dir / RUN_CONFIG, self.ctx.config_text.encode())
            with _recorded(errors, tag_dir / TOKENIZER_COPY):
                write_atomic(tag_dir / TOKENIZER_COPY, self.ctx.tokenizer_file.read_bytes())

    def _failed(
        self, step: int, tag_dir: Path, errors_by_rank: list[list[str]], remove: bool = True
    ) -> bool:
        """After an exchange: if some rank failed, remove the partial checkpoint (rank 0, when
        ``remove``), then stop (raise on every rank) or warn and go on, as ``on_save_error``
        says."""
        failed = {r: e for r, e in enumerate(errors_by_rank) if e}
        if not failed:
            return False
        if self.rank == 0 and remove:
            (tag_dir / MARKER).unlink(missing_ok=True)  # first: never a complete-looking rest
            shutil.rmtree(tag_dir, ignore_errors=True)
        latest = find_latest(self.ckpt_dir) if self.ckpt_dir.is_dir() else None
        what = "; ".join(f"rank {r}: {', '.join(e)}" for r, e in failed.items())
        kept = (
            f"the newest complete checkpoint is still {self.ckpt_dir / latest}"
            if latest
            else "there is no complete checkpoint yet"
        )
        msg = (
            f"saving checkpoint {tag_dir} at step {step} failed ({what}); "
            f"{'the partial checkpoint was removed and ' if remove else ''}{kept}"
        )
        _barrier()  # the partial directory is gone before any rank goes on
        if self.on_error == "stop":
            raise CheckpointSaveError(
                f"{msg}. Free space or fix the storage, then resume (or set "
                "checkpoint.on_save_error: continue to keep training)"
            )
        if self.rank == 0:
            log.warning(
                f"{msg}; training goes on (checkpoint.on_save_error: continue) and the "
                "next save tries again"
            )
        return True

    def _publish(self, tag_dir: Path, step: int, tokens: int) -> None:
        files = {}
        for p in sorted(tag_dir.rglob("*")):
            if p.is_file() and p.name != MARKER:
                fsync_path(p)
                files[p.relative_to(tag_dir).as_posix()] = p.stat().st_size
        if (tag_dir / EXPERT_DIR).is_dir():
            fsync_path(tag_dir / EXPERT_DIR)
        ctx = self.ctx
        marker = {
            "format": FORMAT_VERSION,
            "tag": tag_dir.name,
            "step": step,
            "tokens": tokens,
            "world_size": ctx.world_size,
            "expert_parallel_size": ctx.expert_parallel_size,
            "num_moe_layers": ctx.num_moe_layers,
            "num_experts": ctx.num_experts,
            "tokenizer": {"file": ctx.tokenizer_file.name, "sha256": ctx.tokenizer_sha256},
            "expert_fingerprints": self.fingerprints,
            "files": files,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        write_atomic(tag_dir / MARKER, json.dumps(marker, indent=1).encode())
        fsync_path(tag_dir)
        write_atomic(self.ckpt_dir / LATEST, tag_dir.name.encode())  # for DeepSpeed's own tools
        fsync_path(self.ckpt_dir)

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


class CheckpointSaveError(CheckpointError):
    """A checkpoint could not be written (disk full, permissions, I/O error) and the run config
    says to stop (``checkpoint.on_save_error: stop``)."""


def _describe(e: OSError, path) -> str:
    code = errno.errorcode.get(e.errno, "?") if e.errno is not None else "?"
    return f"{e.filename or path}: {e.strerror or e} ({code}, errno {e.errno})"


class _recorded:
    """``with _recorded(errors, path):`` appends an OSError of the block to ``errors`` (naming
    the file and the cause) instead of raising it."""

    def __init__(self, errors: list[str], path):
        self.errors, self.path = errors, path

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb) -> bool:
        if isinstance(e, OSError):
            self.errors.append(_describe(e, self.path))
            return True
        return False


class _RecordingEngine:
    """While active, DeepSpeed's file writes in ``engine.save_checkpoint`` record their OSErrors
    instead of raising, so that a rank that cannot write still runs DeepSpeed's collectives
    (its save ends in a barrier). Files are written through a Python file object: torch.save to a
    path reports a full disk as an errno-less RuntimeError, through a file object as OSError."""

    def __init__(self, engine, errors: list[str]):
        self.engine, self.errors = engine, errors
        self.inner = engine.checkpoint_engine

    def __enter__(self):
        self.engine.checkpoint_engine = self
        copy_script = self.engine._copy_recovery_script  # rank 0 copies zero_to_fp32.py

        def copy_recorded(save_path):
            with _recorded(self.errors, save_path):
                copy_script(save_path)

        self.engine._copy_recovery_script = copy_recorded
        return self

    def __exit__(self, *exc) -> None:
        self.engine.checkpoint_engine = self.inner
        del self.engine._copy_recovery_script  # back to the class's method

    def save(self, state_dict, path: str) -> None:
        with _recorded(self.errors, path):
            try:
                with open(path, "wb") as f:
                    torch.save(state_dict, f)
            except RuntimeError as e:
                # torch's zip writer fails again while closing after the failed write; the
                # cause is the OSError underneath.
                if isinstance(e.__context__, OSError):
                    raise e.__context__ from None
                raise

    def makedirs(self, path, exist_ok: bool = False) -> None:
        with _recorded(self.errors, path):
            self.inner.makedirs(path, exist_ok=exist_ok)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _exchange(errors: list[str]) -> list[list[str]]:
    """Every rank's errors, on every rank (a collective: it also orders the ranks like a
    barrier)."""
    if not dist.is_initialized():
        return [list(errors)]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, list(errors))
    return out


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
    a checkpoint directory, or a checkpoints or run directory (its newest complete checkpoint)."""
    if resume == "auto":
        tag = find_latest(ckpt_dir)
        return ckpt_dir / tag if tag else None
    if resume == "none":
        if complete_tags(ckpt_dir):
            raise CheckpointError(
                f"{ckpt_dir} already holds checkpoints "
                f"({', '.join(complete_tags(ckpt_dir)[-3:])}); a fresh run would "
                "overwrite them. Use --resume auto, or another run name"
            )
        return None
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"--resume {resume}: no such checkpoint directory")
    return resolve_checkpoint(path)


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
