"""Fault injection for tests: ``train(cfg, env, faults=...)`` calls these at fixed points of
every step, so that tests can feed a bad batch, change the learning rate, stall or kill a rank.
No config key or command line creates one: a user's run always has ``faults=None``.

Tests of a real launch (ranks are processes the launcher starts) name a JSON fault plan in the
environment variable :data:`PLAN_ENV` (test-only: nothing in the project sets it, and the entry
point ignores it unless it is set); see :class:`PlannedFaults`."""

from __future__ import annotations

import errno
import json
import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path

PLAN_ENV = "MOE_TEST_FAULT_PLAN"
"""Test only: the path of a JSON fault plan for the ranks of a launch (see PlannedFaults)."""
PHASES = ("forward", "backward", "optimizer", "save", "eval")
KINDS = ("kill", "term", "hang", "save_error")


class FaultInjector:
    """Does nothing; tests override what they need."""

    def batches(self, step: int, packed: list, samples: tuple[int, int]) -> list:
        """The micro-batches step ``step`` trains on (``packed``: the reader's, this rank's part
        of the global sample positions ``samples``, ``[start, end)``)."""
        return packed

    def before_update(self, step: int, engine) -> None:
        """Called after the batches are read and before the first forward of step ``step``."""

    def at(self, phase: str, step: int) -> None:
        """Called in step ``step`` before the first micro-batch's ``forward``, ``backward`` and
        optimizer step (``optimizer``)."""


class PlannedFaults(FaultInjector):
    """The faults of a JSON plan, each fired once per job, restarts included::

        {"fired_dir": DIR, "faults": [{"id": 0, "kind": "kill", "rank": 1, "step": 5,
                                       "phase": "backward", "seconds": 60}, ...]}

    ``kind``: ``kill`` (SIGKILL to itself), ``term`` (SIGTERM), ``hang`` (sleep ``seconds``),
    ``save_error`` (phase ``save`` only: the rank's first checkpoint file write fails with
    ENOSPC). ``phase``: one of :data:`PHASES`; ``save`` fires inside the checkpoint save after
    DeepSpeed's files are written (before the checkpoint is published), ``eval`` at the start
    of a validation pass. Before a fault fires, ``DIR/fault_{id}`` is created (exclusively), so
    that a restarted rank passing the same point again does not fire it again; its content is
    the time it fired."""

    def __init__(self, plan: dict, rank: int):
        self.rank = rank
        self.fired_dir = Path(plan["fired_dir"])
        self.faults = [f for f in plan["faults"] if f["rank"] == rank]
        self.step = 0
        self._patched = False

    @classmethod
    def from_environment(cls, rank: int) -> PlannedFaults | None:
        path = os.environ.get(PLAN_ENV)
        return cls(json.loads(Path(path).read_text()), rank) if path else None

    def _due(self, phase: str, step: int) -> dict | None:
        for f in self.faults:
            if f["phase"] == phase and f["step"] == step:
                try:
                    fd = os.open(self.fired_dir / f"fault_{f['id']}",
                                 os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                except FileExistsError:
                    continue  # fired before a restart
                os.write(fd, repr(time.time()).encode())
                os.fsync(fd)
                os.close(fd)
                return f
        return None

    def at(self, phase: str, step: int) -> None:
        f = self._due(phase, step)
        if f is not None:
            self._fire(f)

    @staticmethod
    def _fire(f: dict) -> None:
        if f["kind"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f["kind"] == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        elif f["kind"] == "hang":
            time.sleep(f.get("seconds", 3600))

    def before_update(self, step: int, engine) -> None:
        self.step = step
        if self._patched:
            return
        self._patched = True
        save, module_eval = engine.save_checkpoint, engine.module.eval

        def save_checkpoint(*args, **kwargs):
            f = self._due("save", self.step)
            if f is not None and f["kind"] == "save_error":
                with _failing_writes():
                    return save(*args, **kwargs)
            out = save(*args, **kwargs)
            if f is not None:
                self._fire(f)
            return out

        def eval_():
            self.at("eval", self.step)
            return module_eval()

        engine.save_checkpoint = save_checkpoint
        engine.module.eval = eval_


@contextmanager
def _failing_writes():
    """``torch.save`` raises ENOSPC once, as a full disk does under the checkpoint's writer."""
    import torch

    original = torch.save

    def failing(*args, **kwargs):
        torch.save = original
        raise OSError(errno.ENOSPC, "No space left on device (injected by a test)")

    torch.save = failing
    try:
        yield
    finally:
        torch.save = original
