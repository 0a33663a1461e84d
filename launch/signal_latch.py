"""Hold preemption signals from a rank's first instruction until training can act on them.

Importing torch and DeepSpeed, joining the process group, loading a checkpoint and starting the
data readers take seconds to minutes. A SIGUSR1 (SLURM's warning before the time limit, or
``scancel --signal=USR1``) in that window would otherwise end the rank with the default action
and the job FAILED, with no requeue. This module uses the standard library only, so that the
entry point can install it before any heavy import.
"""

from __future__ import annotations

import os
import signal

HELD_SIGNALS_ENV = "MOE_HELD_SIGNALS"
"""The file in which a SLURM job script's shell records the stop signals that reach the job
before its supervisor can take them (launch/slurm/script.py)."""

# Every signal checkpoint.save_on_signals may name (moe.training.resilience.preemption.SIGNALS).
CATCHABLE = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)


class SignalLatch:
    """Records the first of ``CATCHABLE`` received; nothing else happens in the handler."""

    def __init__(self) -> None:
        self.first: int | None = None
        self.installed = False

    def install(self) -> None:
        """Catch :data:`CATCHABLE`, then unblock them: a rank starts with them blocked
        (launch/rank.py), so one that came while the interpreter started was pending and is
        recorded now."""
        if not self.installed:
            for signum in CATCHABLE:
                signal.signal(signum, self._on_signal)
            self.installed = True
        signal.pthread_sigmask(signal.SIG_UNBLOCK, CATCHABLE)

    def _on_signal(self, signum, frame) -> None:
        if self.first is None:
            self.first = signum

    def keep_only(self, keep: set[int]) -> None:
        """Give the signals the config does not save on their default action back; if one of
        them already arrived, it takes that action now (as it would have without the latch)."""
        for signum in CATCHABLE:
            if signum not in keep:
                signal.signal(signum, signal.SIG_DFL)
        if self.first is not None and self.first not in keep:
            os.kill(os.getpid(), self.first)


LATCH = SignalLatch()
