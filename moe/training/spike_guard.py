"""Skipping steps whose training loss spikes far above its recent values.

Detection: after ``min_steps`` applied steps, a micro-batch whose loss, averaged over the ranks,
lies more than ``zscore`` standard deviations above the mean of the last ``window`` applied
steps' losses is a spike. The comparison runs on the device against a threshold computed on the
host before the step (no extra host read); the loss is averaged with one all-reduce per
micro-batch, so every rank sees the same value and takes the same decision.

Skipping reuses the non-finite guard's mechanism (nan_guard.py): the spiking micro-batch's loss
is multiplied by NaN, its gradients become NaN, and ZeRO's overflow check drops the whole step on
every rank (no weight, optimizer or LR-schedule change). Skipped steps count toward
``train.max_consecutive_skips``. Each event is logged, written to TensorBoard
(``train/loss_spike_zscore``) and recorded in ``RUN_DIR/skipped_batches.jsonl`` with the global
sample positions the step consumed (the data order is a function of the position, so the record
of consumed samples stays exact: the samples were read, not trained on).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from moe.config_schema import minimums
from moe.training.hooks import Hook, StepState

log = logging.getLogger("moe.train")

SKIPPED_BATCHES = "skipped_batches.jsonl"


@dataclass
class SpikeConfig:
    action: Literal["off", "skip", "rollback"] = "off"
    """What to do when the loss spikes: off (nothing), skip (drop that step's update on every
    rank and record its samples). rollback (restore the last checkpoint and skip the data window)
    is not implemented yet and is refused. Off by default: a z-score over a short window of an
    early, fast-falling loss is noisy, and skipping changes the training result, so a run opts
    in once its loss curve is known."""
    window: int = 100
    """Applied steps whose losses form the reference mean and standard deviation."""
    zscore: float = 6.0
    """A micro-batch loss more than this many standard deviations above the window mean is a
    spike (only upward spikes)."""
    min_steps: int = 50
    """Warm-up: no detection before this many applied steps are in the window."""

    def problems(self) -> list[str]:
        out = minimums(self, window=2, min_steps=2)
        if self.zscore <= 0:
            out.append(f"zscore: must be > 0, got {self.zscore}")
        if self.min_steps > self.window:
            out.append(f"min_steps: {self.min_steps} exceeds window ({self.window}); the window "
                       "never holds that many steps")
        if self.action == "rollback":
            out.append("action: rollback is not implemented yet; use skip (the step's update is "
                       "dropped on every rank and its samples recorded) or off")
        return out


class LossSpikeGuard(Hook):
    """Holds the window of recent losses; :meth:`check` marks a spiking micro-batch's loss for
    skipping, :meth:`on_step_end` records each event. One per rank; all ranks hold the same
    window (it is built from losses averaged over the ranks)."""

    def __init__(self, cfg: SpikeConfig, run_dir: Path, loader, rank: int, world_size: int):
        self.cfg, self.rank, self.world = cfg, rank, world_size
        self.loader = loader  # its state_dict() gives the data cursor after the step
        self.path = Path(run_dir) / SKIPPED_BATCHES
        self.losses: deque[float] = deque(maxlen=cfg.window)
        self.events = 0

    def reference(self) -> tuple[float, float] | None:
        """(mean, std) of the window, or None during the warm-up."""
        if len(self.losses) < self.cfg.min_steps:
            return None
        std = max(statistics.pstdev(self.losses), 1e-6)  # a flat window is not infinitely strict
        return statistics.fmean(self.losses), std

    def check(self, loss: torch.Tensor, ref: tuple[float, float]) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
        """(the loss to back-propagate: ``loss`` or, on a spike, NaN times it; the z-score of
        the micro-batch loss averaged over the ranks). No host read."""
        mean_loss = loss.detach().float().clone()
        if dist.is_initialized():
            dist.all_reduce(mean_loss)
            mean_loss /= self.world
        z = (mean_loss - ref[0]) / ref[1]
        spike = z > self.cfg.zscore
        return loss * torch.where(spike, math.nan, 1.0).to(loss.dtype), z

    def on_step_end(self, s: StepState) -> None:
        if s.spike_zscore is None:
            if not s.skipped:
                self.losses.append(s.loss)  # averaged over the ranks every step (trainer)
            return
        self.events += 1
        end = int(self.loader.state_dict()["consumed_samples"])
        mean, std = self.reference()
        event = {"step": s.step, "reason": "loss_spike", "loss": s.loss,
                 "zscore": s.spike_zscore, "window_mean": mean, "window_std": std,
                 "samples": [end - s.samples_per_step, end], "applied": not s.skipped}
        if self.rank != 0:
            return
        log.warning(f"step {s.step}: loss spike (z-score {s.spike_zscore:.1f} > "
                    f"{self.cfg.zscore} over the last {len(self.losses)} steps, mean {mean:.4f}, "
                    f"std {std:.4f}); update skipped on every rank; global samples "
                    f"[{event['samples'][0]}, {event['samples'][1]}) recorded in {self.path}")
        with self.path.open("a") as f:
            f.write(json.dumps(event) + "\n")
