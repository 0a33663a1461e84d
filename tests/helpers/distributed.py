"""Run a function on several ranks (gloo on CPU), as real processes."""

from __future__ import annotations

import multiprocessing
import os

import torch.multiprocessing as mp

from moe.training.ports import free_port


def count_all_to_all() -> list[int]:
    """From now on in this process, count the calls of ``torch.distributed.all_to_all_single``
    (the expert-parallel dispatcher looks it up there). Returns a one-element list holding the
    count, which the caller reads and resets. Meant for worker processes, which end with the
    test."""
    import torch.distributed as dist

    calls = [0]
    original = dist.all_to_all_single

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    dist.all_to_all_single = counting
    return calls


def _free_port() -> int:
    return free_port()


# Modules every rank imports, imported once by the fork server that starts the ranks (see
# run_distributed): a rank is a fork of it, not a fresh interpreter importing torch and DeepSpeed.
PRELOAD = ["torch", "deepspeed", "moe.training.trainer", "tests.helpers.distributed"]


def _entry(
    rank: int, world_size: int, port: int, fn, args, backend: str = "gloo", env=None
) -> None:
    if env is not None:  # the test's environment, not the fork server's (started earlier)
        os.environ.clear()
        os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import deepspeed
    import torch

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    deepspeed.init_distributed(dist_backend=backend, verbose=False)
    fn(rank, world_size, *args)
    # As launch/train.py ends a rank: every rank done before any tears its groups down, while
    # the interpreter is alive (a peer still inside a collective, or a group left to its
    # destructor at exit, can abort a rank with "terminate called without an active exception").
    # After an error the process just exits: a peer may still be inside a collective.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def run_distributed(fn, world_size: int, *args, backend: str = "gloo") -> None:
    """Start ``world_size`` processes running ``fn(rank, world_size, *args)``; raise if any
    fails. ``fn`` must be a module-level function (it is pickled). ``backend="nccl"`` puts rank
    r on ``cuda:r``.

    The ranks are forked from multiprocessing's fork server, which imports :data:`PRELOAD`
    once per test process: two ranks start in about 0.2 s instead of the 2.3-2.8 s of two
    spawned interpreters importing torch and DeepSpeed (on 2 idle cores), and each is still a
    process of its own, forked from an interpreter that has imported those modules and run
    nothing else (CUDA is not initialised there; the test process itself is never forked).
    Each rank gets the test's current environment, not the server's."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    mp.start_processes(
        _entry,
        args=(world_size, _free_port(), fn, args, backend, dict(os.environ)),
        nprocs=world_size,
        join=True,
        start_method="forkserver",
    )


def global_params(model, ep_rank: int) -> dict:
    """Parameters under single-device names, expert stacks (``allreduce`` False: the experts'
    weights and their adapters) split by global expert id."""
    out = {}
    for name, p in model.named_parameters():
        name = name.replace(".deepspeed_moe.", ".")
        if getattr(p, "allreduce", True) is False:
            for i in range(p.shape[0]):
                out[f"{name}[{ep_rank * p.shape[0] + i}]"] = p[i].detach().clone()
        else:
            out[name] = p.detach().clone()
    return out
