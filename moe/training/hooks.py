"""Cross-cutting concerns around the training step: console progress, TensorBoard, router
balancing, checkpoints. The loop calls each hook's ``on_step_end``; hooks never change the step."""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger("moe.train")


@dataclass
class StepState:
    step: int  # optimizer steps completed
    max_steps: int
    loss: float  # mean over micro-batches and ranks (total loss)
    lm_loss: float
    aux_loss: float
    lr: float
    grad_norm: float | None
    step_seconds: float
    tokens_per_step: int
    samples_per_step: int
    is_log_step: bool
    extra: dict = field(default_factory=dict)
    local_loss: float = math.nan  # this rank's mean loss over its micro-batches
    tokens_sha256: str = ""  # hash of the token ids this rank trained on in this step
    skipped: bool = False  # the update was skipped (non-finite loss or gradient norm)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / max(self.step_seconds, 1e-9)


class Hook:
    def on_step_end(self, state: StepState) -> None:
        """Called on every rank after each optimizer step."""

    def close(self) -> None:
        pass


class ConsoleHook(Hook):
    """One concise rank-0 line per logging interval."""

    def __init__(self, rank: int):
        self.rank = rank
        self.t0 = time.time()

    def on_step_end(self, s: StepState) -> None:
        if self.rank != 0 or not s.is_log_step:
            return
        elapsed = time.time() - self.t0
        eta = elapsed / max(s.step, 1) * (s.max_steps - s.step)
        gn = f" | grad norm {s.grad_norm:.3f}" if s.grad_norm is not None else ""
        log.info(f"step {s.step:>5}/{s.max_steps} | loss {s.loss:.4f} (lm {s.lm_loss:.4f} aux "
                 f"{s.aux_loss:.4f}) | lr {s.lr:.2e}{gn} | {s.tokens_per_second:,.0f} tok/s | "
                 f"ETA {eta / 60:.1f} min")


class TensorBoardHook(Hook):
    """Rank 0 writes scalars; values are already averaged over ranks by the loop."""

    def __init__(self, log_dir: Path, config_text: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))
        self.writer.add_text("config", "```\n" + config_text + "\n```", 0)

    def on_step_end(self, s: StepState) -> None:
        if not s.is_log_step:
            return
        w = self.writer
        w.add_scalar("train/loss", s.loss, s.step)
        w.add_scalar("train/lm_loss", s.lm_loss, s.step)
        w.add_scalar("train/aux_loss", s.aux_loss, s.step)
        w.add_scalar("train/lr", s.lr, s.step)
        w.add_scalar("train/tokens_per_s", s.tokens_per_second, s.step)
        w.add_scalar("train/samples_per_s", s.samples_per_step / max(s.step_seconds, 1e-9), s.step)
        w.add_scalar("train/step_time_s", s.step_seconds, s.step)
        if s.grad_norm is not None and math.isfinite(s.grad_norm):
            w.add_scalar("train/grad_norm", s.grad_norm, s.step)
        for tag, value in s.extra.items():
            w.add_scalar(tag, value, s.step)
        w.flush()

    def close(self) -> None:
        self.writer.close()


class RouterBalanceHook(Hook):
    """After each step: sum every MoE layer's routed-token counts over all ranks (one all-reduce
    for all layers), apply the auxiliary-loss-free bias update, publish load statistics for the
    logging hooks, and reset the counters."""

    def __init__(self, moe_layers: list, group=None):
        self.layers = moe_layers
        self.group = group

    def on_step_end(self, s: StepState) -> None:
        if not self.layers:
            return
        loads_LE = torch.stack([layer.step_load_E for layer in self.layers])
        if dist.is_initialized():
            dist.all_reduce(loads_LE, group=self.group)
        for layer, load_E in zip(self.layers, loads_LE):
            layer.router.update_bias(load_E)
            layer.step_load_E.zero_()
        if s.is_log_step:
            for i, load_E in enumerate(loads_LE):
                mean = load_E.mean().clamp_min(1e-9)
                s.extra[f"moe/layer{i}/max_over_mean_load"] = float(load_E.max() / mean)
                s.extra[f"moe/layer{i}/load_cv"] = float(load_E.std(unbiased=False) / mean)


class StepRecordHook(Hook):
    """Every rank appends one JSON line per step to its own file: the step, this rank's loss and
    a hash of its token ids. Comparing these files shows whether a resumed run repeated the
    uninterrupted one exactly and whether the data stream repeated or skipped anything. A resumed
    run appends the steps after its checkpoint again; the last line of a step is the valid one."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a")

    def on_step_end(self, s: StepState) -> None:
        # repr of a Python float round-trips exactly: equal strings mean bitwise equal losses.
        self.file.write(json.dumps({"step": s.step, "loss": s.local_loss,
                                    "tokens_sha256": s.tokens_sha256, "skipped": s.skipped}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
