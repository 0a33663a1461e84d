"""Checkpoint-and-exit on a preemption signal (SLURM's ``--signal=USR1@SECONDS`` before the
time limit, or ``scancel --signal=USR1``).

The signal handler only sets a flag: saving inside a handler could interrupt a collective. At
each step boundary the ranks agree on the flag with one tiny all-reduce (a signal reaches ranks
at slightly different times, and a checkpoint is collective: if one rank saved while another
stepped on, both would hang). Then every rank saves, rank 0 leaves a marker for the job script,
and all exit with PREEMPTED_EXIT_CODE; the requeued job resumes from that checkpoint through the
trainer's ordinary auto-resume.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from moe.training.checkpoint import CheckpointHook
from moe.training.hooks import Hook, StepState

log = logging.getLogger("moe.train")

PREEMPTED_MARKER = "preempted.json"
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later"


class Preempted(SystemExit):
    """Raised on every rank after the preemption checkpoint is saved."""

    def __init__(self, step: int):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step = step


class PreemptionHook(Hook):
    def __init__(self, checkpoint: CheckpointHook, marker: Path, rank: int,
                 signum: int = signal.SIGUSR1):
        self.checkpoint, self.marker, self.rank, self.signum = checkpoint, marker, rank, signum
        self.requested = False
        self.previous = None
        # Python only installs handlers from the main thread (tests may train elsewhere).
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.requested = True

    def on_step_end(self, s: StepState) -> None:
        flag = torch.tensor([float(self.requested)])
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        # At the last step the loop saves and ends anyway.
        if not flag.item() or s.step >= s.max_steps:
            return
        self.checkpoint.save(s.step)
        if self.rank == 0:
            self.marker.write_text(json.dumps({"step": s.step, "signal": self.signum}))
            log.info(f"{signal.Signals(self.signum).name}: saved step {s.step}; exiting with "
                     f"code {PREEMPTED_EXIT_CODE} so that the job can resume from it")
        # No rank may exit (and have a scheduler kill the others) before the marker exists.
        if dist.is_initialized():
            dist.barrier()
        self.close()
        raise Preempted(s.step)

    def close(self) -> None:
        if self.previous is not None:
            signal.signal(self.signum, self.previous)
            self.previous = None
