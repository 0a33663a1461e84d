"""What a guard tells the loop after a step. Guards (nan_guard.py, spike_guard.py,
preemption.py) only decide; the loop in trainer.py acts, so every change of the step's course
is one branch there."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Continue:
    """Go on with the next step."""


@dataclass(frozen=True)
class Skip:
    """The step's update was dropped (a non-finite loss or a loss spike); go on."""

    reason: str


@dataclass(frozen=True)
class Rollback:
    """Restore the checkpoint ``checkpoint`` (of step ``step``) on every rank and run the steps
    after it again."""

    step: int
    checkpoint: Path
    reason: str


@dataclass(frozen=True)
class Stop:
    """End the run. ``signal`` set: a preemption: save step ``step`` and exit for a requeue;
    otherwise a failure the loop raises as a TrainingError with ``reason``."""

    reason: str
    signal: int | None = None
    step: int | None = None


Decision = Continue | Skip | Rollback | Stop
CONTINUE = Continue()
