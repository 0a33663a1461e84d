"""The last collective a rank entered, for the hang report, and a clear error when one times out.

:func:`record_collectives` wraps torch.distributed's collectives (the functions DeepSpeed's
communication layer and our code call, looked up by name at call time or bound when DeepSpeed's
back end starts: so it runs before ``deepspeed.init_distributed``). Each call notes its name,
the time, whether it returned and how many collectives the process entered before (a collective
called inside another, as ``all_gather_object`` calls ``all_gather``, counts as part of it):
a few assignments, no device work. The hang watchdog writes the note into the hang file and
publishes the count, so that a rank waiting in collective N can tell which peers never reached
it (moe/training/resilience/watchdog.py). A collective that fails with the process group's
timeout (set where the group starts: ``train.hang_timeout_s`` plus the watchdog's margin) is
re-raised as a :class:`CollectiveTimeout` that names the collective, the rank and the setting,
instead of gloo's or NCCL's bare "Timed out waiting ...".
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

from moe.core.errors import TrainingError

WRAPPED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "all_to_all_single",
    "all_to_all",
    "broadcast",
    "barrier",
    "reduce",
    "gather",
    "scatter",
    "all_gather_object",
    "broadcast_object_list",
    "monitored_barrier",
)


class CollectiveTimeout(TrainingError):
    """A collective did not complete within the process group's timeout."""


@dataclass
class LastCollective:
    name: str | None = None
    entered: float = 0.0  # time.monotonic() when it was entered
    returned: bool = True
    calls: int = 0
    """Collectives entered by this process (outermost calls): their sequence number."""
    depth: int = 0

    def describe(self) -> str:
        if self.name is None:
            return "last collective entered: none recorded"
        state = "returned" if self.returned else "still inside it"
        return (
            f"last collective entered: {self.name} (call {self.calls} of this process), "
            f"{time.monotonic() - self.entered:.1f}s ago, {state}"
        )


LAST = LastCollective()
"""This process's record (one per rank process)."""


def _is_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def _wrap(name: str, fn, rank: int, timeout_s: float):
    @functools.wraps(fn)
    def recorded(*args, **kwargs):
        outer = LAST.depth == 0
        if outer:
            LAST.name, LAST.entered, LAST.returned = name, time.monotonic(), False
            LAST.calls += 1
        LAST.depth += 1
        try:
            out = fn(*args, **kwargs)
        except RuntimeError as e:
            if _is_timeout(e):
                raise CollectiveTimeout(
                    f"rank {rank}: {name} did not complete within {timeout_s:g}s (the process "
                    f"group's timeout: train.hang_timeout_s plus the hang watchdog's margin): a "
                    f"peer rank is hung or gone ({str(e).splitlines()[0]})"
                ) from e
            raise
        finally:
            LAST.depth -= 1
        if outer:
            LAST.returned = True
        return out

    recorded.__wrapped_collective__ = fn
    return recorded


def record_collectives(rank: int, timeout_s: float) -> None:
    """Wrap the collectives of ``torch.distributed`` (and of ``distributed_c10d``, which some
    DeepSpeed paths call directly) in this process; a second call does nothing."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for name in WRAPPED:
        fn = getattr(dist, name, None)
        if fn is None or hasattr(fn, "__wrapped_collective__"):
            continue
        recorded = _wrap(name, fn, rank, timeout_s)
        setattr(dist, name, recorded)
        if getattr(c10d, name, None) is fn:
            setattr(c10d, name, recorded)
