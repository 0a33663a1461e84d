"""Checkpoint-and-exit on a preemption signal: SLURM's ``--signal=USR1@SECONDS`` before the
time limit or ``scancel --signal=USR1``, and, where ``checkpoint.save_on_signals`` names it,
SIGTERM (what Kubernetes, torchrun and most schedulers send before they kill a process).

The signal handler only sets a flag: saving inside a handler could interrupt a collective. At
each step boundary the ranks agree on the flag with one tiny all-reduce (a signal reaches ranks
at slightly different times, and a checkpoint is collective: if one rank saved while another
stepped on, both would hang); :meth:`PreemptionGuard.decide` tells the loop to stop. Then every
rank saves, rank 0 leaves a marker for the job script (:func:`exit_for_requeue`), and all
exit with PREEMPTED_EXIT_CODE; the requeued job resumes from that checkpoint through the
trainer's ordinary auto-resume. A second SIGTERM is not caught: it ends the process at once.

Before training begins (process-group start-up, checkpoint load, data start-up) the entry point
holds the signals with ``hold_signals``. When the guard starts, just before the first step, the
ranks agree on a held signal the same way; with nothing trained yet there is nothing to save:
rank 0 leaves the marker and every rank exits with PREEMPTED_EXIT_CODE at once, so the job is
requeued and starts again from where it stood.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from moe.core.run_dir import RunDir
from moe.training.decision import CONTINUE, Decision, Stop
from moe.training.device import comm_device
from moe.training.hooks import LoopPart, StepState

log = logging.getLogger("moe.train")

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later"


def was_preempted(returncode: int, run_dir: Path) -> bool:
    """Whether training that ended with ``returncode`` (a rank's, or the launcher's that ran
    them) stopped for a preemption: the exit code, or the marker rank 0 leaves in ``run_dir``
    (:func:`exit_for_requeue`), which stays when a launcher reports another code for it."""
    return returncode == PREEMPTED_EXIT_CODE or RunDir(run_dir).preempted.exists()


class Preempted(SystemExit):
    """Raised on every rank after the preemption checkpoint is saved."""

    def __init__(self, step: int | None):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step = step  # None: before the first step, nothing saved


_RECEIVED: list[int] = []
"""Every preemption signal this process caught, held or guarded, in order (never cleared)."""


def received_signal() -> int | None:
    """The first preemption signal this process caught, at start-up or while training (None:
    none). A rank that fails after one was, most likely, failed by it: SLURM signals every
    process of a step, so a tool the rank runs (a compiler, a probe) dies and the rank's call
    of it fails (launch/train.py then exits as preempted)."""
    return _RECEIVED[0] if _RECEIVED else None


class HeldSignal:
    """The first preemption signal received before a PreemptionGuard takes over."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def _on_signal(self, signum, frame) -> None:
        _RECEIVED.append(signum)
        if self.signum is None:
            self.signum = signum

    def take(self) -> int | None:
        signum, self.signum = self.signum, None
        return signum


HELD = HeldSignal()


def hold_signals(signals, first: int | None = None) -> None:
    """Record ``signals`` until training starts; ``first``: one already received (by a handler
    installed before this module could be imported)."""
    for signum in signals:
        signal.signal(signum, HELD._on_signal)
    if first is not None and HELD.signum is None:
        HELD.signum = first
        _RECEIVED.insert(0, first)


def exit_for_requeue(marker: Path, rank: int, decision: Stop) -> NoReturn:
    """After every rank saved ``decision.step`` (None: before the first step, nothing to save):
    rank 0 leaves the marker for the job script, and every rank raises :class:`Preempted`
    once all are here."""
    if rank == 0:
        marker.write_text(json.dumps({"step": decision.step, "signal": decision.reason}))
    if decision.step is None:
        log.info(
            f"{decision.reason} before the first step: nothing to save; exiting with code "
            f"{PREEMPTED_EXIT_CODE} so that the job can start again"
        )
    else:
        log.info(
            f"{decision.reason}: saved step {decision.step}; exiting with code "
            f"{PREEMPTED_EXIT_CODE} so that the job can resume from it"
        )
    # No rank may exit (and have a scheduler kill the others) before the marker exists.
    if dist.is_initialized():
        dist.barrier()
    raise Preempted(decision.step)


class PreemptionGuard(LoopPart):
    """Catches the preemption signals from the first step on and tells the loop, at a step
    boundary, to save and exit (:meth:`decide`); :meth:`close` gives the signals back."""

    def __init__(self, marker: Path, rank: int, signals: tuple[int, ...] = (signal.SIGUSR1,)):
        self.marker, self.rank = marker, rank
        self.signum: int | None = None  # the first signal received
        self.previous: dict[int, object] = {}
        # Python only installs handlers from the main thread (tests may train elsewhere).
        if threading.current_thread() is threading.main_thread():
            for signum in signals:
                previous = signal.signal(signum, self._on_signal)
                # Holding was for start-up only: afterwards (and on a second SIGTERM) a signal
                # takes its default action.
                self.previous[signum] = signal.SIG_DFL if previous == HELD._on_signal else previous
        held = HELD.take()  # after the handlers above: no signal falls between the two
        self.signum = self.signum or held
        self._stop_if_signalled_before_training()

    def _agreed_signal(self) -> int:
        """The signal number (0: none); the maximum over ranks names one that some rank got."""
        # torch.full: filled on the device, no host-to-device copy.
        flag = torch.full((1,), float(self.signum or 0), device=comm_device())
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        # Read every step (a host sync with NCCL): every rank must stop at the same step.
        return int(flag.item())

    def _stop_if_signalled_before_training(self) -> None:
        signum = self._agreed_signal()
        if not signum:
            return
        self.close()  # never registered with the loop, which would close it
        exit_for_requeue(self.marker, self.rank, Stop(signal.Signals(signum).name, signum))

    def _on_signal(self, signum, frame) -> None:
        _RECEIVED.append(signum)
        if self.signum is None:
            self.signum = signum
        if signum == signal.SIGTERM and signum in self.previous:
            # Someone means it: the next SIGTERM gets the old disposition (by default, death).
            signal.signal(signum, self.previous.pop(signum))

    def decide(self, s: StepState, latest=None) -> Decision:
        """Every rank calls it at every step boundary (a collective): stop, on every rank alike,
        when some rank got a signal; the step to save is ``Stop.step``. The loop asks it after
        the other guards: a step they roll back has ``s.rollback_to``."""
        signum = self._agreed_signal()
        # At the last step the loop saves and ends anyway.
        if not signum or s.step >= s.max_steps:
            return CONTINUE
        # A step that rolls back for a loss spike is undone: the checkpoint it rolls back to is
        # the one to resume from (the skipped data is recorded in the run directory already).
        step = s.step if s.rollback_to is None else s.rollback_to
        return Stop(signal.Signals(signum).name, signal=signum, step=step)

    def close(self) -> None:
        for signum, previous in self.previous.items():
            signal.signal(signum, previous)
        self.previous = {}
