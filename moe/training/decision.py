"""What a guard tells the loop after a step, and how the guards' answers combine. Guards
(nan_guard.py, spike_guard.py, preemption.py) only decide; the loop in trainer.py acts, so every
change of the step's course is one branch there."""

from __future__ import annotations

from collections.abc import Iterable
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


SEVERITY = {Continue: 0, Skip: 1, Rollback: 2, Stop: 3}


def decide(parts: Iterable, state, latest: tuple[int, Path] | None) -> Decision:
    """The guards' decision on step ``state`` (hooks.StepState): every part's ``decide`` (a
    hooks.LoopPart's; a part that is no guard answers Continue), asked in registration order (the non-finite guard, the
    spike guard, the preemption guard last): the most severe decision wins, the later guard's
    among equals. A stop ends the asking (every rank stops alike, so a guard's collective is
    skipped on every rank); a rollback is marked in the step state at once
    (``state.rollback_to``), for the guards after it and the reporters."""
    decision: Decision = CONTINUE
    for part in parts:
        answer = part.decide(state, latest)
        if isinstance(answer, Rollback):
            state.rollback_to = answer.step
        if SEVERITY[type(answer)] >= SEVERITY[type(decision)]:
            decision = answer
        if isinstance(answer, Stop):
            break
    return decision
