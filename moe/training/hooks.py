"""The parts of the training loop: :class:`LoopPart`, the one base of everything the loop runs
around a step, the step's state they see, and the parts that measure and report:

- meters (throughput, memory, validation) add scalars to the step state (``after_step``) before
  anything reports it;
- reporters (console, TensorBoard, step records) report the step state (``on_step_end``) and
  change nothing.

Decisions about the step (skip, roll back, stop) are the guards' (``decide``;
moe/training/resilience/); the router balance (routing.py) moves the router bias after the
step; the loop (trainer.py) acts on the decisions: it raises, saves, exits, rolls back.
docs/training-loop.md shows how to add a part."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from moe.config.run import RunConfig
from moe.core.config_schema import to_dict
from moe.core.run_dir import STEP_RECORDS
from moe.training.decision import CONTINUE, Decision
from moe.training.device import comm_device

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
    extra: dict = field(default_factory=dict)  # more scalars for the loggers: tag -> float
    histograms: dict = field(default_factory=dict)  # tag -> per-bucket counts (1-D tensor)
    local_loss: float = math.nan  # this rank's mean loss over its micro-batches
    tokens_sha256: str = ""  # hash of the token ids this rank trained on in this step
    skipped: bool = False  # the update was skipped (non-finite loss or gradient norm)
    spike_zscore: float | None = None  # a loss spike: the largest z-score (spike_guard.py)
    consumed_samples: int = 0  # global samples the data stream has handed out after this step
    rollback_to: int | None = None  # the loop rolls back to this checkpoint step (spike_guard.py)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / max(self.step_seconds, 1e-9)


class LoopPart:
    """A part of the training loop: a meter, a guard, a reporter, the router balance, the
    preemption guard, the hang watchdog. A part overrides the hooks it needs; the loop registers
    it with one line (``run.add(part)`` in trainer.py's ``add_parts``) and calls the hooks of
    every registered part, in registration order, on every rank:

    1. :meth:`after_step` once the optimizer step is done: meters add their scalars;
    2. :meth:`decide`: guards decide the step's course (decision.py); nothing else may;
    3. :meth:`on_step_end`: reporters report the step state and change nothing;
    4. then the loop acts on the decision (raise, save, exit for a requeue, roll back), calling
       :meth:`on_checkpoint` after each complete save and :meth:`on_rollback` after a rollback;
    5. :meth:`close` once when training ends, also when it fails or is preempted.

    A part with state sets :attr:`state_key` and gives :meth:`state_dict` and
    :meth:`load_state_dict`: every checkpoint then carries that state under the key, and a
    resumed run (on any parallel layout) or a rollback gives it back (checkpoint.py)."""

    state_key: str | None = None
    """The name of this part's state in every checkpoint; None: the part has no state to keep."""

    def after_step(self, state: StepState) -> None:
        """The optimizer step ``state.step`` is done: add scalars to ``state.extra``."""

    def decide(self, state: StepState, latest: tuple[int, Path] | None) -> Decision:
        """What the loop should do after the step (a guard's answer). ``latest``: (step,
        directory) of the newest complete checkpoint, the one a rollback restores (None before
        the first). Every rank must decide alike (a guard all-reduces what it decides on)."""
        return CONTINUE

    def on_step_end(self, state: StepState) -> None:
        """Report the step, once the guards have decided (``state.rollback_to`` set when the
        step rolls back); change nothing, except scalars added to ``state.extra`` for the
        reporters registered later (a meter of the steps that stand: downstream.py)."""

    def on_checkpoint(self, step: int, tag_dir: Path) -> None:
        """The checkpoint of step ``step`` is complete in ``tag_dir``."""

    def on_rollback(self, client: dict) -> None:
        """The loop restored the checkpoint whose client state (step, tokens, every registered
        state) is ``client``, and every registered state from it: the steps after
        ``client["step"]`` will run again, so drop what was kept of them."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict | None) -> None:
        """``state``: what :meth:`state_dict` gave when the checkpoint was saved; None when the
        checkpoint holds none (saved before the part existed, or with it off)."""

    def close(self) -> None:
        """Release what the part holds (files, threads, signal handlers). Called exactly once,
        whether training ended, failed or was preempted."""


class ConsoleReporter(LoopPart):
    """One concise rank-0 line per logging interval."""

    def __init__(self, rank: int):
        self.rank = rank
        self.t0 = time.time()

    def on_step_end(self, s: StepState) -> None:
        if self.rank != 0 or not s.is_log_step:
            return
        elapsed = time.time() - self.t0
        eta = elapsed / max(s.step, 1) * (s.max_steps - s.step)
        gn = f" | grad norm {s.grad_norm:.3g}" if s.grad_norm is not None else ""
        mfu = f" | MFU {s.extra['train/mfu']:.1%}" if "train/mfu" in s.extra else ""
        log.info(
            f"step {s.step:>5}/{s.max_steps} | loss {s.loss:.4f} (lm {s.lm_loss:.4f} aux "
            f"{s.aux_loss:.4f}) | lr {s.lr:.2e}{gn} | {s.tokens_per_second:,.0f} tok/s{mfu} | "
            f"ETA {eta / 60:.1f} min"
        )


class TensorBoardReporter(LoopPart):
    """Rank 0 writes scalars; values are already averaged over ranks by the loop.

    The run's TensorBoard history holds each step once, as the run that finished computed it, as
    the step records do: a run that starts after step ``start_step`` (the resumed checkpoint's,
    0 for a new run) runs the steps after it again, so its event file begins with a purge of
    them, and a rollback purges the steps after its checkpoint the same way. The rollbacks
    recorded for those steps stand (the run skips their samples and never meets those spikes
    again): their scalars are written again after each purge. The running counts (loss spikes,
    rollbacks, skipped steps) go on from the run's history at ``start_step``: ``events``, the
    run's event record as cut back for this start (spike_guard.py, ``recorded_events``), and
    ``step_records``, rank 0's step records (:class:`StepRecorder`). They are not checkpoint
    state: a rollback restores those, and the counts go on across it."""

    def __init__(
        self,
        log_dir: Path,
        config_text: str,
        hparams: dict | None = None,
        start_step: int = 0,
        events: Sequence[dict] = (),
        step_records: Path | None = None,
    ):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        self.writer = SummaryWriter(log_dir=str(log_dir))
        self.spikes = 0  # loss spikes, so far
        self.rollbacks = 0  # rollbacks for a loss spike, so far
        self.standing: list[tuple[int, dict]] = []  # (step, scalars) of each rollback
        for e in events:
            self._spike(
                e["step"], e.get("zscore"), e.get("action") == "rollback", e.get("rolled_back_to")
            )
        # Steps skipped for a non-finite loss or gradient norm or a spike, so far: those the
        # step records hold up to the start, and each rollback's spiking step (its record left
        # with the steps the rollback undid).
        self.skipped = skipped_steps(step_records, start_step) + self.rollbacks
        self._purge_after(start_step)
        self.writer.add_text("config", "```\n" + config_text + "\n```", 0)
        if hparams:
            # Written into this run's own event file (SummaryWriter.add_hparams would open a
            # sub-run), with the metrics the hparams view shows next to the settings.
            metrics = {"valid/loss": float("nan"), "train/loss": float("nan")}
            for summary in hparams_summary(hparams, metrics):
                self.writer.file_writer.add_summary(summary)

    def _spike(
        self, step: int, zscore: float | None, rollback: bool, rollback_to: int | None
    ) -> dict:
        """Count a loss spike at ``step``; its scalars, those of a rollback (to checkpoint step
        ``rollback_to``) kept to write again after a purge."""
        self.spikes += 1
        scalars = {"train/loss_spike_zscore": zscore, "train/loss_spikes": self.spikes}
        if rollback:
            self.rollbacks += 1
            scalars["train/loss_rollbacks"] = self.rollbacks
            scalars["train/loss_rollback_to_step"] = rollback_to
        scalars = {tag: value for tag, value in scalars.items() if value is not None}
        if rollback:
            self.standing.append((step, scalars))
        return scalars

    def _purge_after(self, step: int) -> None:
        """The steps after ``step`` run again: a SessionLog START at step + 1 (what
        ``SummaryWriter(purge_step=)`` writes) makes TensorBoard's reader drop every earlier
        event at or after it, from this file and the earlier ones. Then the rollbacks after
        ``step``, which stand, are written again."""
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        start = SessionLog(status=SessionLog.START)
        self.writer.file_writer.add_event(Event(step=step + 1, session_log=start))
        self.standing = [(s, scalars) for s, scalars in self.standing if s > step]
        for s, scalars in self.standing:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, s)
        self.writer.flush()

    def on_step_end(self, s: StepState) -> None:
        self.skipped += int(s.skipped)
        w = self.writer
        if s.spike_zscore is not None:  # every event, logging step or not
            rollback = s.rollback_to is not None
            for tag, value in self._spike(s.step, s.spike_zscore, rollback, s.rollback_to).items():
                w.add_scalar(tag, value, s.step)
            w.flush()
        if not s.is_log_step:
            return
        w.add_scalar("train/skipped_steps", self.skipped, s.step)
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
        for tag, counts in s.histograms.items():
            add_bucket_histogram(w, tag, counts, s.step)
        w.flush()

    def on_rollback(self, client: dict) -> None:
        self._purge_after(int(client["step"]))

    def close(self) -> None:
        self.writer.close()


def skipped_steps(step_records: Path | None, last: int) -> int:
    """How many steps up to ``last`` the step records (:class:`StepRecorder`) mark skipped."""
    if step_records is None or not step_records.exists():
        return 0
    skipped = set()
    for line in step_records.read_text().splitlines():
        if '"skipped": true' not in line:  # json.dumps' spelling; most lines: no need to parse
            continue
        try:
            record = json.loads(line)
        except ValueError:  # a line cut short by a kill
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            if record["step"] <= last:
                skipped.add(record["step"])
    return len(skipped)


class ThroughputMeter(LoopPart):
    """Model FLOPs per second and utilization (MFU) from the training FLOPs per token of the
    active parameters and attention (moe/model/size.py documents the formula)."""

    def __init__(
        self, train_flops_per_token: float, peak_flops_per_device: float | None, world_size: int
    ):
        self.flops_per_token = train_flops_per_token
        self.peak = peak_flops_per_device
        self.world = world_size

    def after_step(self, s: StepState) -> None:
        if not s.is_log_step:
            return
        achieved = s.tokens_per_second * self.flops_per_token
        s.extra["train/model_tflops_per_s"] = achieved / 1e12
        if self.peak:
            s.extra["train/mfu"] = achieved / (self.peak * self.world)


class MemoryMeter(LoopPart):
    """Process memory (resident set, max over ranks) and accelerator memory when present."""

    def __init__(self, group=None):
        import psutil

        self.proc = psutil.Process()
        self.group = group

    def after_step(self, s: StepState) -> None:
        if not s.is_log_step:
            return
        mem = torch.tensor(
            [
                self.proc.memory_info().rss / 2**30,
                torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
            ],
            device=comm_device(),
        )
        if dist.is_initialized():
            dist.all_reduce(mem, op=dist.ReduceOp.MAX, group=self.group)
        rss, gpu = mem.tolist()
        s.extra["system/process_memory_gib"] = rss
        if torch.cuda.is_available():
            s.extra["system/gpu_max_allocated_gib"] = gpu


def add_bucket_histogram(writer, tag: str, counts: torch.Tensor, step: int) -> None:
    """A histogram whose bucket i is expert i and whose height is that expert's token count, so
    TensorBoard's histogram view shows the load over experts at each step."""
    counts = counts.double()
    ids = torch.arange(len(counts), dtype=torch.float64)
    total = float(counts.sum())
    writer.add_histogram_raw(
        tag,
        min=0.0,
        max=float(len(counts)),
        num=total,
        sum=float((ids * counts).sum()),
        sum_squares=float((ids * ids * counts).sum()),
        bucket_limits=[float(i + 1) for i in range(len(counts))],
        bucket_counts=counts.tolist(),
        global_step=step,
    )


class ValidationMeter(LoopPart):
    """Every N steps: token-weighted loss and perplexity over (a bounded part of) the validation
    split, computed by all ranks together. Every rank runs the same number of forward passes,
    padding with fully masked batches, because an expert-parallel forward is a collective."""

    def __init__(
        self,
        engine,
        every_n_steps: int,
        windows: list[torch.Tensor],
        seq_len: int,
        batch_size: int,
        rank: int,
        world: int,
    ):
        self.engine, self.every = engine, every_n_steps
        self.seq_len, self.batch_size = seq_len, batch_size
        self.rank, self.world = rank, world
        self.windows = windows
        self.last: dict | None = None

    def _batches(self):
        per_round = self.batch_size * self.world
        for start in range(0, len(self.windows), per_round):
            mine = self.windows[
                start + self.rank * self.batch_size : start + (self.rank + 1) * self.batch_size
            ]
            inputs = torch.zeros(self.batch_size, self.seq_len, dtype=torch.long)
            targets = torch.full((self.batch_size, self.seq_len), -100, dtype=torch.long)
            for i, (tokens_S, targets_S) in enumerate(mine):
                inputs[i, : len(tokens_S) - 1] = tokens_S[:-1]
                targets[i, : len(targets_S)] = targets_S  # -100 at prompt tokens too
            yield inputs, targets

    @torch.no_grad()
    def evaluate(self) -> dict:
        module = self.engine.module
        device = self.engine.device
        was_training = module.training
        self.engine.eval()
        # Summed on the device and read once (device and comm_device agree: both are CUDA with
        # NCCL, both the CPU with gloo).
        sums = torch.zeros(2, dtype=torch.float64, device=device)
        for inputs, targets in self._batches():
            inputs, targets = inputs.to(device), targets.to(device)
            logits = module(inputs).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
            )
            sums += torch.stack([loss.double(), (targets != -100).sum().double()])
        self.engine.train(was_training)
        if dist.is_initialized():
            dist.all_reduce(sums)
        total, tokens = sums.tolist()
        mean = total / max(tokens, 1.0)
        return {"loss": mean, "perplexity": math.exp(min(mean, 50.0)), "tokens": int(tokens)}

    def after_step(self, s: StepState) -> None:
        if not (self.every and (s.step % self.every == 0 or s.step == s.max_steps)):
            return
        self.last = self.evaluate()
        if self.rank == 0:
            log.info(
                f"step {s.step:>5} | validation loss {self.last['loss']:.4f} | "
                f"perplexity {self.last['perplexity']:.2f} over {self.last['tokens']:,} tokens"
            )
        s.extra.update(
            {"valid/loss": self.last["loss"], "valid/perplexity": self.last["perplexity"]}
        )


def cut_back(path: Path, step: int, keep: Callable[[dict], bool] = lambda record: False) -> None:
    """Keep the JSON lines of ``path`` whose ``step`` is before ``step``, and those ``keep``
    accepts, dropping a line cut short by a kill; the file is replaced with them in one rename
    (a reader sees the old file or the new one). A file that is not there or would not change
    is left alone."""
    if not path.exists():
        return
    text = path.read_text()
    kept = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and (
            (isinstance(record.get("step"), int) and record["step"] < step) or keep(record)
        ):
            kept.append(line + "\n")
    if "".join(kept) == text:
        return
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())  # the rename must not outlive the lines it keeps
    tmp.replace(path)


class StepRecorder(LoopPart):
    """Every rank appends one JSON line per step to its own file: the step, this rank's loss, a
    hash of its token ids, the global sample positions ``[start, end)`` the step consumed
    (every rank's samples of the step) and the number of ranks. Comparing these files shows
    whether a resumed run repeated the uninterrupted one exactly and whether the data stream
    repeated or skipped anything.

    A run resumed from a checkpoint runs the steps after it again (an earlier run logged them
    before it was preempted or killed): at its first step the file is cut back to the steps
    before it, so it holds every step exactly once, as the run that finished computed it. Rank 0
    cuts back the files of the ranks a resume on fewer ranks left out the same way: no one else
    writes them. ``rank``, ``world_size``: torch.distributed's (0 and 1 without it) unless
    given."""

    def __init__(self, path: Path, rank: int | None = None, world_size: int | None = None):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        spread = dist.is_available() and dist.is_initialized()
        self.rank = (dist.get_rank() if spread else 0) if rank is None else rank
        self.world = (dist.get_world_size() if spread else 1) if world_size is None else world_size
        self.file = None  # opened at the first step, once the resumed step is known

    def on_step_end(self, s: StepState) -> None:
        if self.file is None:
            self.file = self._open_from(s.step)
        # repr of a Python float round-trips exactly: equal strings mean bitwise equal losses.
        # samples: the global sample positions [start, end) the step consumed (all ranks').
        samples = [s.consumed_samples - s.samples_per_step, s.consumed_samples]
        self.file.write(
            json.dumps(
                {
                    "step": s.step,
                    "loss": s.local_loss,
                    "tokens_sha256": s.tokens_sha256,
                    "skipped": s.skipped,
                    "samples": samples,
                    "world_size": self.world,
                    "time": time.time(),
                }
            )
            + "\n"
        )
        self.file.flush()

    def on_rollback(self, client: dict) -> None:
        self.close()
        self.file = None  # reopened at the next step, cut back to the steps before it

    def _open_from(self, step: int):
        """Cut this rank's file (rank 0: also those of ranks past the world size) back to the
        steps before ``step``, and append to this rank's from there."""
        cut_back(self.path, step)
        if self.rank == 0:
            rank = self.world  # a run's ranks are 0..N-1: its files are too
            while (other := self.path.with_name(STEP_RECORDS.format(rank=rank))).exists():
                cut_back(other, step)
                rank += 1
        return open(self.path, "a")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def hparams(cfg: RunConfig, counts: dict | None = None) -> dict:
    """The run's scalar settings, flattened, for TensorBoard's hparams view, and ``counts``
    (:func:`~moe.training.finetune.parameter_counts`) under ``params.``."""
    flat: dict = {}

    def walk(prefix: str, node) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        elif isinstance(node, (int, float, str, bool)):
            flat[prefix] = node

    walk(
        "",
        {k: v for k, v in to_dict(cfg).items() if k in ("model", "train", "parallel", "finetune")},
    )
    walk("params", counts or {})
    return flat
