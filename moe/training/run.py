"""What the training loop drives: the loop's own state, the parts around it and the states every
checkpoint carries, registered in one place (:meth:`Run.add`, :meth:`Run.carry`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from moe.config.run import RunConfig
from moe.model.transformer import MoETransformer
from moe.training.checkpoint import Checkpointer, Stateful, carry, restore
from moe.training.hooks import LoopPart
from moe.training.prefetch import PrefetchingReader
from moe.training.resilience.spike_guard import LossSpikeGuard

log = logging.getLogger("moe.train")
Part = TypeVar("Part", bound=LoopPart)


@dataclass
class TrainState:
    """What the loop owns and changes: where training stands and the run's newest checkpoint."""

    step: int = 0  # optimizer steps completed
    tokens: int = 0  # tokens trained on
    checkpoint: Path | None = None  # the newest complete checkpoint of this run's history
    checkpoint_step: int = -1
    failed_saves: list[int] = field(default_factory=list)  # steps saved in vain since then
    last_save_seconds: float | None = None
    history: list[dict] = field(default_factory=list)  # the logging steps' losses

    def latest(self) -> tuple[int, Path] | None:
        """(step, directory) of the newest complete checkpoint, the one a rollback restores."""
        return None if self.checkpoint is None else (self.checkpoint_step, self.checkpoint)


class History:
    """The summary's history (the logging steps' losses, ``TrainState.history``), carried by every
    checkpoint: a resumed run's ``train_summary.json`` covers the steps before the resume, as
    the run that finished computed them, and a run resumed with nothing left to train keeps
    them. A checkpoint saved before it was carried holds none: the history then starts at the
    resumed step (a rollback keeps the entries up to its step)."""

    def __init__(self, state: TrainState):
        self.state = state

    def state_dict(self) -> dict:
        return {"entries": [dict(h) for h in self.state.history]}

    def load_state_dict(self, state: dict | None) -> None:
        if state is None:
            self.state.history = [h for h in self.state.history if h["step"] <= self.state.step]
        else:
            self.state.history = [dict(h) for h in state["entries"]]


@dataclass
class Run:
    """What the loop drives, built once by ``trainer.start_run``."""

    cfg: RunConfig
    env: object  # trainer.DistEnv
    engine: object
    model: MoETransformer
    loader: PrefetchingReader
    tokenizer_sha256: str
    state: TrainState
    checkpointer: Checkpointer | None = None
    parts: list[LoopPart] = field(default_factory=list)  # hooks in registration order
    spike: LossSpikeGuard | None = None  # also checks each micro-batch inside the step
    states: dict[str, Stateful] = field(default_factory=dict)  # what every checkpoint carries
    resumed: tuple[dict, Path] | None = None  # while starting: (client state, checkpoint)

    def add(self, part: Part) -> Part:
        """Register a part of the loop (hooks.py, :class:`LoopPart`): its hooks run around every
        step, its ``close`` when training ends, and its state, if it has a ``state_key``, is
        carried by every checkpoint."""
        self.parts.append(part)
        if part.state_key is not None:
            self.carry(part.state_key, part)
        return part

    def carry(self, name: str, part: Stateful) -> None:
        """Carry ``part``'s state in every checkpoint under ``name`` (moe/training/checkpoint.py);
        a resumed run restores it here, from the checkpoint of any layout, and a rollback
        restores it again."""
        carry(self.states, name, part)
        if self.resumed is not None:
            restore({name: part}, *self.resumed)


PartFactory = Callable[[Run], LoopPart]
"""Builds a part for a run: ``train(..., parts=[...])`` adds parts beyond the built-in ones."""


def close(run: Run) -> list[Exception]:
    """Close every part (the last registered first) and the loader, each even when another
    fails; returns what failed."""
    failed = []
    for part in reversed(run.parts):
        try:
            part.close()
        except Exception as e:  # closing the rest comes first; the caller raises it
            log.error(f"closing {type(part).__name__} failed: {e}")
            failed.append(e)
    run.loader.close()
    return failed
