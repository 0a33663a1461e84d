"""moe-train: the per-rank training entry point that every launcher starts.

Preemption signals are held from the first instruction (launch.signal_latch): a signal during
start-up ends the rank with the preempted exit code once every rank can agree on it, instead of
killing it with the default action.
"""

from __future__ import annotations

from launch.signal_latch import LATCH

if __name__ == "__main__":  # as the schedulers start it (python -m launch.train): before torch
    LATCH.install()

import argparse
import dataclasses
import errno
import json
import logging
import os
import signal
from datetime import timedelta
from pathlib import Path

import torch

from data_pipeline.errors import DataError
from data_pipeline.shards import read_manifest
from launch.cli import exits_cleanly, setup_logging
from launch.launcher_watch import end_with_launcher, gone_line, say
from launch.rank_env import dist_env_from_environment
from launch.restarts import record_final
from moe.checkpoint.files import MARKER, complete_tags
from moe.config.run import SIGNALS, RunConfig, load_config
from moe.core.errors import CheckpointError, ConfigError, DamagedCheckpointError, MoEError
from moe.core.fileio import write_atomic
from moe.core.run_dir import RunDir
from moe.tools.planning import checkpoint_bytes, finetune_plan
from moe.training.checkpoint import CheckpointSaveError
from moe.training.cpu_allocator import keep_freed_memory
from moe.training.device import device_and_backend
from moe.training.resilience.collectives import record_collectives
from moe.training.resilience.faults import PlannedFaults
from moe.training.resilience.preemption import (
    PREEMPTED_EXIT_CODE,
    Preempted,
    hold_signals,
    received_signal,
)
from moe.training.resilience.watchdog import process_group_timeout_s
from moe.training.trainer import train


@exits_cleanly
def main(argv=None) -> None:
    LATCH.install()  # a no-op under python -m; the first instruction for the moe-train script
    end_with_launcher(launcher_gone)
    p = argparse.ArgumentParser(prog="moe-train", description=__doc__)
    p.add_argument("--config", required=True, help="resolved run config (YAML)")
    p.add_argument(
        "--resume",
        default="auto",
        help="'auto' (default): continue from the newest complete checkpoint of the "
        "run directory if it has one; 'none': start fresh; or a checkpoint "
        "directory (saved with any parallel layout), or a run or checkpoints directory "
        "(its newest complete checkpoint)",
    )
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    kept = {SIGNALS[n] for n in cfg.checkpoint.save_on_signals}
    hold_signals(kept, first=LATCH.first)  # now until the first step (PreemptionGuard)
    LATCH.keep_only(kept)
    env = dist_env_from_environment()
    # One rendezvous for every launcher: DeepSpeed then skips its own MPI discovery.
    os.environ.update(env.torch_env())
    threads = cfg.train.threads_per_rank or max(1, (os.cpu_count() or 1) // env.local_world_size)
    torch.set_num_threads(threads)
    if cfg.train.cpu_keep_freed_memory and not torch.cuda.is_available():
        keep_freed_memory()
    cfg.run_files.logs.mkdir(parents=True, exist_ok=True)
    setup_logging(env.rank, str(cfg.run_files.rank_log(env.rank)))
    try:
        run(cfg, env, args.resume, threads)
    except Preempted:
        raise
    except Exception as e:
        if record_stop(e, cfg.run_dir, env.rank, cfg) is None:  # a restart may fix it
            stop_if_signalled(e, cfg.run_dir, env.rank)
        raise


def launcher_gone(pid: int) -> None:
    """The moe-launch that started this rank is gone (killed): stop at once, as a rank whose
    launcher stopped it would (launch/launcher_watch.py). Said in the rank's own log file
    (its console may be the dead launcher's pipe) and on stderr."""
    text = gone_line(pid, f"rank pid {os.getpid()}")
    for handler in logging.getLogger("moe").handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(
                logging.LogRecord("moe.train", logging.WARNING, __file__, 0, text, None, None)
            )
    say(text)
    os.kill(os.getpid(), signal.SIGKILL)


def run(cfg, env, resume: str, threads: int) -> None:
    """Join the process group and train (``main`` once the rank's log is set up)."""
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    device, backend = device_and_backend(env.local_rank)
    if device.type == "cuda":
        # Before the process group and the engine: NCCL and DeepSpeed use the current device.
        torch.cuda.set_device(device)
    where = device if device.type == "cuda" else "cpu (no CUDA device visible)"
    logging.getLogger("moe.train").info(  # every rank: each rank's log tells its own story
        f"device: {where} (rank {env.rank}), backend {backend}, {env.world_size} rank(s), "
        f"{threads} thread(s) per rank"
    )
    # Collectives time out once the hang watchdog has reported (0: the process group's
    # default), and the last one entered is recorded for the watchdog's report.
    t = process_group_timeout_s(cfg.train.hang_timeout_s) if cfg.train.hang_timeout_s else 0
    record_collectives(env.rank, t)
    deepspeed.init_distributed(
        dist_backend=backend, verbose=False, **({"timeout": timedelta(seconds=t)} if t else {})
    )
    if backend == "gloo":
        unlink_cpu_allreduce_buffer(env.rank)
    try:
        # Test-only fault plan from the environment (moe/training/resilience/faults.py); None for users.
        train(cfg, env, resume=resume, faults=PlannedFaults.from_environment(env.rank))
    except Preempted:
        shut_down_distributed()  # every rank stops at the same step (the signal is all-reduced)
        raise
    shut_down_distributed()


FULL_BELOW_BYTES = 16 << 20
"""Less free space than this after a failed save: the storage is full, and a restart would fail
the same way (logs, events and the next attempt need room beside the checkpoints)."""


def checkpoint_size(ckpt_dir: Path, cfg: RunConfig | None = None) -> tuple[int, str] | None:
    """(bytes, where the figure comes from) of one checkpoint of the run: the newest complete
    one's files, else the planner's figure for the config (moe/tools/planning.py); None when
    neither is known."""
    newest = sorted(ckpt_dir.glob(f"step_*/{MARKER}")) if ckpt_dir.is_dir() else []
    if newest:
        tag = newest[-1].parent
        return (
            sum(p.stat().st_size for p in tag.rglob("*") if p.is_file()),
            f"the size of {tag.name}, the newest checkpoint",
        )
    if cfg is None:
        return None
    model = cfg.model
    if model.vocab_size is None:  # resolved by the trainer; the manifest's if it did not get there
        try:
            vocab = int(read_manifest(cfg.data.dir, cfg.data.s3).tokenizer["vocab_size"])
        except DataError:
            return None
        model = dataclasses.replace(model, vocab_size=vocab)
    planned = checkpoint_bytes(
        model,
        cfg.train.precision,
        cfg.parallel.zero_stage,
        cfg.parallel.expert_parallel_size,
        finetune_plan(model, cfg.finetune),
    )
    return int(planned), "planned from the config: weights and optimizer states"


def storage_verdict(ckpt_dir: Path, cfg: RunConfig | None = None) -> str | None:
    """Why the checkpoint storage cannot take a checkpoint now (read-only, or full), checked on
    the storage itself: a write error on a disk with room (a transient fault) may be restarted.
    ``cfg``: the run's config, for the size of a checkpoint before the first one exists."""
    probe = ckpt_dir if ckpt_dir.exists() else ckpt_dir.parent
    try:
        st = os.statvfs(probe)
    except OSError:
        return None
    if st.f_flag & os.ST_RDONLY:
        return f"the checkpoint storage at {probe} is read-only"
    free = st.f_bavail * st.f_frsize
    size = checkpoint_size(ckpt_dir, cfg)
    if free >= max(FULL_BELOW_BYTES, size[0] if size else 0):
        return None
    text = f"the checkpoint storage at {probe} is full: {free:,} bytes free"
    if size is not None:
        text += f", a checkpoint of this run takes about {size[0]:,} bytes ({size[1]})"
    if size is None or free >= size[0]:
        text += f"; less than the {FULL_BELOW_BYTES:,} a run needs free beside its checkpoints"
    return text


def final_cause(
    e: Exception, ckpt_dir: Path, cfg: RunConfig | None = None
) -> tuple[str, str] | None:
    """(kind, cause) of a failure no restart can fix; None for one a restart may fix."""
    if isinstance(e, (CheckpointSaveError, OSError)) and (
        not isinstance(e, OSError) or e.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT)
    ):
        verdict = storage_verdict(ckpt_dir, cfg)
        return ("storage", f"{verdict} ({e})") if verdict else None
    if isinstance(e, ConfigError):
        return "configuration", str(e)
    if isinstance(e, DataError):
        return "data", str(e)
    if isinstance(e, CheckpointError):  # a restart would load the same checkpoint again
        return "checkpoint", f"{e}{_older_checkpoint_hint(e, ckpt_dir)}"
    return None


def _older_checkpoint_hint(e: CheckpointError, ckpt_dir: Path) -> str:
    """For a damaged newest checkpoint of the run: how to resume from the one before it."""
    tags = complete_tags(ckpt_dir)
    newest = ckpt_dir / tags[-1] if tags else None
    if not isinstance(e, DamagedCheckpointError) or newest is None or str(newest) not in str(e):
        return ""
    if len(tags) < 2:
        return f"; it is the run's only complete checkpoint: move {newest} aside to start over"
    return (
        f"; to resume from {tags[-2]}, the complete checkpoint before it, move {newest} "
        f"out of {ckpt_dir} and run the same command again"
    )


def record_stop(
    e: Exception, run_dir: Path, rank: int, cfg: RunConfig | None = None
) -> tuple[str, str] | None:
    """Every rank's own log holds the error that stopped it (its console may be another's); a
    failure no restart can fix is also recorded for the supervisor (launch/restarts.py), and
    returned: (kind, cause), else None. ``cfg``: the run's config (storage_verdict)."""
    text = f"stopped by {type(e).__name__}: {e}"
    for handler in logging.getLogger("moe").handlers:
        if isinstance(handler, logging.FileHandler):
            record = logging.LogRecord(
                "moe.train",
                logging.ERROR,
                __file__,
                0,
                text,
                None,
                None if isinstance(e, (MoEError, DataError)) else (type(e), e, e.__traceback__),
            )
            handler.handle(record)
    files = RunDir(run_dir)
    final = final_cause(e, files.checkpoints, cfg)
    if final is not None:
        record_final(files.logs, rank, *final)
    return final


def stop_if_signalled(e: Exception, run_dir: Path, rank: int) -> None:
    """Raise :class:`Preempted` (exit code 75, the run's preemption marker left) when this rank
    failed after it caught a preemption signal (for a failure a restart may fix: the caller
    asks :func:`record_stop` first).

    A scheduler's stop signal reaches every process of the step, not only the ranks: a child the
    rank runs at that moment (DeepSpeed's ``ninja --version`` while it loads an op, a compiler)
    dies of it, and the rank, which holds the signal to act on it at the next step, fails
    instead with that child's error. Counted as a failure, the job would be restarted in the
    allocation the scheduler is taking back, where a requeue was asked for."""
    signum = received_signal()
    if signum is None:
        return
    name = signal.Signals(signum).name
    marker = RunDir(run_dir).preempted
    if not marker.exists():  # a stop before any save: the job resumes from its newest checkpoint
        write_atomic(marker, json.dumps({"step": None, "signal": name}))
    logging.getLogger("moe.train").warning(
        f"rank {rank}: {type(e).__name__} after {name}: taken as the stop the signal asked for "
        f"(it also reaches the processes a rank runs), not as a failure; exiting with code "
        f"{PREEMPTED_EXIT_CODE} so that the job can start again"
    )
    raise Preempted(None) from e


SHM_DIR = Path("/dev/shm")


def cpu_allreduce_buffer(rank: int) -> Path:
    """The shared-memory file DeepSpeed's CPU communication op creates for ``rank`` when every
    rank is on one node (the launcher sets ``LOCAL_SIZE`` to the world size)."""
    return SHM_DIR / (
        f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}"
        f"_{os.environ.get('MASTER_PORT', '')}_{rank}"
    )


def unlink_cpu_allreduce_buffer(rank: int) -> None:
    """Remove this rank's DeepSpeed shared-memory file from ``/dev/shm`` once every rank mapped it.

    DeepSpeed creates it (about 69 MB) at ``init_distributed`` and never unlinks it, so every
    run on CPU would leave that much memory behind per rank, for good: a machine that runs
    many jobs fills ``/dev/shm`` until the kernel kills processes for memory. When
    ``init_distributed`` returns, this rank has mapped every peer's file; after a barrier every
    rank has, and the names are no longer needed. The mappings stay valid, and the memory is
    freed when the last process exits, however it exits."""
    import torch.distributed as dist

    if not dist.is_initialized() or not SHM_DIR.is_dir():
        return
    dist.barrier()
    cpu_allreduce_buffer(rank).unlink(missing_ok=True)


def shut_down_distributed() -> None:
    """Tear the process groups down while the interpreter is alive, on every rank together.

    Only after every rank finished the same way: a rank that left the process group to its
    destructor at interpreter exit can abort there ("terminate called without an active
    exception", a joinable gloo thread), which turns a finished run's exit code 0 (or a
    preempted run's 75) into a crash. After an error the group is left alone: a peer may still
    be inside a collective, and destroying the group would wait for it."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
