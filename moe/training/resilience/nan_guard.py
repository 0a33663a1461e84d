"""Skipping steps whose loss or gradient norm is not finite, and stopping when it persists.

How a step is skipped: a non-finite loss is turned into NaN gradients (:func:`poison_nonfinite`);
the gradient norm is all-reduced, so every rank sees the same non-finite norm, and DeepSpeed's
ZeRO optimizer (stages 1 and 2, fp32 and bf16) then drops the gradients without touching the
parameters, the optimizer moments or the LR schedule. :class:`NonFiniteGuard` counts consecutive
skips and tells the loop to stop after ``max_skips`` of them, before it saves anything, so the
last checkpoint on disk is the last good state.
"""

from __future__ import annotations

import logging
import math

import torch

from moe.training.decision import CONTINUE, Decision, Skip, Stop
from moe.training.hooks import LoopPart, StepState

log = logging.getLogger("moe.train")


def poison_nonfinite(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` itself when finite (same value, same gradient); otherwise a loss whose gradient
    is NaN everywhere, so that the optimizer's overflow check skips the step. No host sync."""
    return loss * torch.where(torch.isfinite(loss), 1.0, math.nan).to(loss.dtype)


def step_is_finite(loss: float, grad_norm: float | None) -> bool:
    return math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))


class NonFiniteGuard(LoopPart):
    """Warns on every skipped step; stops after ``max_skips`` consecutive ones (steps skipped for
    a loss spike count too: the spike guard poisons their loss the same way). Stops at once if a
    non-finite step was applied anyway (no ZeRO: nothing skips it, the weights are lost). The
    count of skips in a row is carried by every checkpoint: a run resumed (or rolled back) in
    the middle of a streak stops where the uninterrupted run would have."""

    state_key = "nonfinite_guard"

    def __init__(self, max_skips: int, rank: int):
        self.max_skips, self.rank = max_skips, rank
        self.consecutive = 0

    def state_dict(self) -> dict:
        return {"consecutive_skips": self.consecutive}

    def load_state_dict(self, state: dict | None) -> None:
        """None: a checkpoint saved without it starts counting afresh."""
        self.consecutive = int((state or {}).get("consecutive_skips", 0))

    def decide(self, s: StepState, latest=None) -> Decision:
        finite = step_is_finite(s.loss, s.grad_norm)
        if finite and not s.skipped:
            self.consecutive = 0
            return CONTINUE
        if not s.skipped:
            return Stop(
                f"step {s.step}: non-finite loss ({s.loss}) or gradient norm "
                f"({s.grad_norm}) was applied to the weights (nothing skips steps "
                "without ZeRO stage 1 or 2); stopping. Resume from the last "
                "checkpoint, with ZeRO stage 1 or 2 to skip such steps"
            )
        self.consecutive += 1
        if self.rank == 0 and s.spike_zscore is None:  # a spike skip: spike_guard.py warns
            log.warning(
                f"step {s.step}: skipped: non-finite loss ({s.loss}) or gradient norm "
                f"({s.grad_norm}); {self.consecutive} consecutive skip(s) of at most "
                f"{self.max_skips}"
            )
        if self.consecutive >= self.max_skips:
            return Stop(
                f"step {s.step}: {self.consecutive} consecutive steps had a "
                "non-finite loss or gradient norm (or a loss spike, train.spike); "
                "stopping. The last checkpoint holds the last good state: lower "
                "train.lr or raise train.grad_clip, then resume"
            )
        return Skip(f"step {s.step}: non-finite loss or gradient norm, or a loss spike")
