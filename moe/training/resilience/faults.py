"""Fault injection for tests: ``train(cfg, env, faults=...)`` puts a proxy around the engine and
the data loader (:meth:`FaultInjector.install`, one line of the trainer, only when faults are
given), which calls the injector at fixed points of every step, so that tests can feed a bad
batch, change the learning rate, stall or kill a rank, or fail a checkpoint write. The training
step itself has no fault call sites, and no config key or command line creates an injector: a
user's run always has ``faults=None``.

Tests of a real launch (ranks are processes the launcher starts) name a JSON fault plan in the
environment variable :data:`PLAN_ENV`, read here only (:meth:`PlannedFaults.from_environment`;
test-only: nothing in the project sets it, and the entry point ignores it unless it is set)."""

from __future__ import annotations

import errno
import json
import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

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
        optimizer step (``optimizer``), and at the start of a validation pass (``eval``)."""

    def save(self, step: int, save):
        """Runs the checkpoint save of step ``step`` (DeepSpeed's ``save_checkpoint``, bound to
        its arguments: ``save()``) and returns what it returns."""
        return save()

    def install(self, engine, loader, state) -> tuple:
        """(the engine, the loader) behind proxies that call this injector; ``state``: the
        loop's TrainState (its ``step`` counts the steps completed)."""
        engine = _FaultyEngine(engine, self)
        return engine, _FaultyLoader(loader, engine, state)


class _FaultyEngine:
    """The engine, with the injector called around forward, backward, step, save and eval.
    Everything else (attributes included, also when set) is the engine's own."""

    _OWN = ("_inner", "_faults", "_step", "_first")

    def __init__(self, inner, faults: FaultInjector):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_faults", faults)
        object.__setattr__(self, "_step", 0)  # the step running (its batches were read)
        object.__setattr__(self, "_first", set())  # phases not yet passed in this step

    def _begin(self, step: int) -> None:
        object.__setattr__(self, "_step", step)
        object.__setattr__(self, "_first", {"forward", "backward"})

    def _once(self, phase: str) -> None:
        if phase in self._first:
            self._first.discard(phase)
            self._faults.at(phase, self._step)

    def __call__(self, *args, **kwargs):
        self._once("forward")
        return self._inner(*args, **kwargs)

    def backward(self, *args, **kwargs):
        self._once("backward")
        return self._inner.backward(*args, **kwargs)

    def step(self, *args, **kwargs):
        if self._inner.is_gradient_accumulation_boundary():  # this step() updates the weights
            self._faults.at("optimizer", self._step)
        return self._inner.step(*args, **kwargs)

    def save_checkpoint(self, *args, **kwargs):
        return self._faults.save(self._step, lambda: self._inner.save_checkpoint(*args, **kwargs))

    def eval(self):
        self._faults.at("eval", self._step)
        return self._inner.eval()

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value) -> None:
        setattr(self._inner, name, value)

    def __delattr__(self, name) -> None:
        delattr(self._inner, name)


class _FaultyLoader:
    """The loader, with the injector given each step's batches (and its turn before the
    step's first forward)."""

    def __init__(self, inner, engine: _FaultyEngine, state):
        self.inner, self.engine, self.state = inner, engine, state

    def next_step(self) -> list:
        step = self.state.step + 1
        packed = self.inner.next_step()
        faults = self.engine._faults
        end = int(self.inner.state_dict()["consumed_samples"])
        world = dist.get_world_size() if dist.is_initialized() else 1
        per_step = sum(p.tokens_BS.shape[0] for p in packed) * world  # every rank's samples
        packed = faults.batches(step, packed, (end - per_step, end))
        self.engine._begin(step)
        faults.before_update(step, self.engine._inner)
        return packed

    def __getattr__(self, name):
        return getattr(self.inner, name)


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

    @classmethod
    def from_environment(cls, rank: int) -> PlannedFaults | None:
        path = os.environ.get(PLAN_ENV)
        return cls(json.loads(Path(path).read_text()), rank) if path else None

    def _due(self, phase: str, step: int) -> dict | None:
        for f in self.faults:
            if f["phase"] == phase and f["step"] == step:
                try:
                    fd = os.open(
                        self.fired_dir / f"fault_{f['id']}", os.O_CREAT | os.O_EXCL | os.O_WRONLY
                    )
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

    def save(self, step: int, save):
        f = self._due("save", step)
        if f is not None and f["kind"] == "save_error":
            with _failing_writes():
                return save()
        out = save()
        if f is not None:
            self._fire(f)
        return out


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
