"""Skipping or rolling back steps whose training loss spikes far above its recent values.

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
of consumed samples stays exact: the samples were read, not trained on). A run resumed from a
checkpoint decides the steps after it again: when it starts (with the guard on or off), the skips
an earlier run recorded for them leave the file, so it holds each event once, as the run that
finished decided it (rollbacks stay, see below).

Rolling back (``action: rollback``) starts the same way: the spiking step's update is dropped.
Then every rank restores model, optimizer, LR schedule, data cursor, RNG and this guard's window
from the newest complete checkpoint (step c), in this process, through the code path of a
resumed run (``trainer.roll_back``), and never reads the samples of the last
``rollback_skip_steps`` steps after c up to the spiking step s again: steps c+1.. run again on
the samples they had, and once the cursor reaches the skipped window it jumps past it. In process
rather than by exiting for the launcher to restart: it costs one checkpoint load instead of a
new job start, and works the same under every launcher, without one and with
``launch.max_restarts: 0``. The event, with the skipped ranges, is appended to
``skipped_batches.jsonl`` before the restore; every later start of the run reads the file, so a
run killed and resumed from a checkpoint before the window skips the same samples. A checkpoint
holds this guard's window (registered with the checkpointer as ``spike_guard``), so re-run
steps detect spikes as they did.
Spikes at one step number roll back at most ``max_rollbacks`` times, counted over the whole
record; one more stops the run. Before the first checkpoint there is nothing to roll back to: the
step is skipped as with ``action: skip`` (with a warning), and recorded as such.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
from collections import Counter, deque
from pathlib import Path

import torch
import torch.distributed as dist

from moe.config.run import SpikeConfig
from moe.training.decision import CONTINUE, Decision, Rollback, Skip, Stop
from moe.training.hooks import LoopPart, StepState, cut_back

log = logging.getLogger("moe.train")

SKIPPED_BATCHES = "skipped_batches.jsonl"


def _merged(ranges: list[tuple[int, int]]) -> list[list[int]]:
    """Adjacent ``[start, end)`` ranges joined, in order."""
    out: list[list[int]] = []
    for a, b in sorted(ranges):
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return out


def recorded_events(run_dir: Path) -> list[dict]:
    """The events of ``RUN_DIR/skipped_batches.jsonl`` (a line cut short by a kill is dropped),
    read by rank 0 and sent to every rank."""
    events: list = []
    path = Path(run_dir) / SKIPPED_BATCHES
    if (not dist.is_initialized() or dist.get_rank() == 0) and path.exists():
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    if dist.is_initialized():
        box = [events]
        dist.broadcast_object_list(box, src=0)
        events = box[0]
    return [e for e in events if isinstance(e, dict)]


def cut_back_events(run_dir: Path, step: int) -> None:
    """A run resumed before ``step`` decides the steps from ``step`` on again: the events an
    earlier run recorded for them leave ``RUN_DIR/skipped_batches.jsonl``, except rollbacks,
    whose samples the resumed run skips too (:func:`skipped_windows`), so it never meets those
    spikes again. Rank 0's, which writes the file."""
    cut_back(Path(run_dir) / SKIPPED_BATCHES, step, keep=lambda e: e.get("action") == "rollback")


def skipped_windows(events: list[dict]) -> list[list[int]]:
    """The global sample ranges that rollbacks took out of the data stream."""
    return [r for e in events if e.get("action") == "rollback" for r in e["skipped_samples"]]


class LossSpikeGuard(LoopPart):
    """Holds the window of recent losses; :meth:`check` marks a spiking micro-batch's loss for
    skipping, :meth:`decide` records each event and tells the loop to skip the step or to roll
    back to a checkpoint. One per rank; all ranks hold the same window (it is built from losses
    averaged over the ranks) and decide alike.

    ``events``: the run's recorded events (:func:`recorded_events`), which count earlier
    rollbacks."""

    state_key = "spike_guard"

    def __init__(
        self,
        cfg: SpikeConfig,
        run_dir: Path,
        loader,
        rank: int,
        world_size: int,
        events: list[dict] = (),
    ):
        self.cfg, self.rank, self.world = cfg, rank, world_size
        self.loader = loader  # its state_dict() gives the data cursor after the step
        self.path = Path(run_dir) / SKIPPED_BATCHES
        self.losses: deque[float] = deque(maxlen=cfg.window)
        # (step, first sample, end) of the latest steps: the window a rollback skips.
        self.recent: deque[tuple[int, int, int]] = deque(maxlen=cfg.rollback_skip_steps)
        self.events = 0
        self.rollbacks = Counter(e["step"] for e in events if e.get("action") == "rollback")
        self.pending: list[list[int]] = []  # the sample ranges the decided rollback skips

    def reference(self) -> tuple[float, float] | None:
        """(mean, std) of the window, or None during the warm-up."""
        if len(self.losses) < self.cfg.min_steps:
            return None
        std = max(statistics.pstdev(self.losses), 1e-6)  # a flat window is not infinitely strict
        return statistics.fmean(self.losses), std

    def check(
        self, loss: torch.Tensor, ref: tuple[float, float], backprop: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss to back-propagate: ``backprop`` (default ``loss``) or, on a spike, NaN times
        it; the z-score of the micro-batch loss averaged over the ranks). No host read."""
        mean_loss = loss.detach().float().clone()
        if dist.is_initialized():
            dist.all_reduce(mean_loss)
            mean_loss /= self.world
        z = (mean_loss - ref[0]) / ref[1]
        spike = z > self.cfg.zscore
        backprop = loss if backprop is None else backprop
        return backprop * torch.where(spike, math.nan, 1.0).to(backprop.dtype), z

    def state_dict(self) -> dict:
        return {"losses": list(self.losses)}

    def load_state_dict(self, state: dict | None) -> None:
        """From a checkpoint (None, one saved without it: the warm-up starts again)."""
        self.losses.clear()
        self.losses.extend((state or {}).get("losses", ()))
        self.recent.clear()

    def on_rollback(self, client: dict) -> None:
        # The loop restored the checkpoint's window and cursor before (checkpoint.restore).
        self.loader.skip(self.pending)
        self.pending = []

    def decide(self, s: StepState, latest: tuple[int, Path] | None) -> Decision:
        """``latest``: (step, directory) of the newest complete checkpoint of the run's history,
        the one a rollback restores (None before the first)."""
        end = int(self.loader.state_dict()["consumed_samples"])
        self.recent.append((s.step, end - s.samples_per_step, end))
        if s.spike_zscore is None:
            if not s.skipped:
                self.losses.append(s.loss)  # averaged over the ranks every step (trainer)
            return CONTINUE
        self.events += 1
        mean, std = self.reference()
        event = {
            "step": s.step,
            "reason": "loss_spike",
            "action": "skip",
            "loss": s.loss,
            "zscore": s.spike_zscore,
            "window_mean": mean,
            "window_std": std,
            "samples": [end - s.samples_per_step, end],
            "applied": not s.skipped,
        }
        what = (
            f"step {s.step}: loss spike (z-score {s.spike_zscore:.1f} > {self.cfg.zscore} "
            f"over the last {len(self.losses)} steps, mean {mean:.4f}, std {std:.4f})"
        )
        if self.cfg.action == "rollback" and latest is not None:
            decision = self._roll_back(s, event, what, *latest)
        else:
            decision = Skip(what)
            if self.rank == 0:
                fallback = (
                    " (train.spike.action rollback: no checkpoint to roll back to yet)"
                    if self.cfg.action == "rollback"
                    else ""
                )
                log.warning(
                    f"{what}; update skipped on every rank{fallback}; global samples "
                    f"[{event['samples'][0]}, {event['samples'][1]}) recorded in "
                    f"{self.path}"
                )
        if not isinstance(decision, Stop):
            self._record(event)
        return decision

    def _roll_back(
        self, s: StepState, event: dict, what: str, step: int, tag_dir: Path
    ) -> Decision:
        done = self.rollbacks[s.step]
        if done >= self.cfg.max_rollbacks:
            return Stop(
                f"{what} after {done} rollback(s) for spikes at step {s.step} "
                f"(train.spike.max_rollbacks {self.cfg.max_rollbacks}); stopping. The skipped "
                f"data is recorded in {self.path}; lower train.lr or raise train.spike.zscore, "
                "then resume"
            )
        self.rollbacks[s.step] += 1
        skipped = _merged([(a, b) for st, a, b in self.recent if st > step])
        event.update(
            action="rollback",
            rolled_back_to=step,
            checkpoint=str(tag_dir),
            skipped_samples=skipped,
            rollback=done + 1,
        )
        self.pending = skipped
        if self.rank == 0:
            ranges = ", ".join(f"[{a}, {b})" for a, b in skipped)
            log.warning(
                f"{what}; update dropped; rolling back every rank to {tag_dir} (step "
                f"{step}, rollback {done + 1} of at most {self.cfg.max_rollbacks} for "
                f"step {s.step}); global samples {ranges} will not be trained on, "
                f"recorded in {self.path}"
            )
        return Rollback(step, tag_dir, what)

    def _record(self, event: dict) -> None:
        if self.rank != 0:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(event) + "\n")
            f.flush()
            os.fsync(f.fileno())  # a rollback's skipped window must outlive a kill right after
