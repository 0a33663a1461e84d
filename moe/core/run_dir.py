"""The names of a run directory (``output_dir/name``), spelled once: the trainer writes there, the
launchers, the SLURM job and the evaluation read there (a foundation: it imports nothing of the
project).

What a run directory holds besides these: ``run_config.yaml`` and the launch plan
(launch/run_plan.py), ``esft_selection.json`` (moe/training/esft.py),
``skipped_batches.jsonl`` (moe/training/resilience/spike_guard.py), ``slurm_jobs.json``
(launch/slurm/jobs.py), and in ``logs/`` the per-rank exit, hang and final-failure records
(launch/rank.py, moe/training/resilience/watchdog.py, launch/restarts.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

STEP_RECORDS = "steps_rank{rank}.jsonl"


@dataclass(frozen=True)
class RunDir:
    """``RunDir(path).checkpoints`` and so on: the paths of one run directory's files."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @property
    def checkpoints(self) -> Path:
        """One ``step_NNNNNNN`` directory per checkpoint (moe/checkpoint/files.py)."""
        return self.path / "checkpoints"

    @property
    def logs(self) -> Path:
        """Every rank's log and records, the job logs."""
        return self.path / "logs"

    @property
    def tensorboard(self) -> Path:
        """TensorBoard's event files (rank 0, ``logging.tensorboard``)."""
        return self.path / "tensorboard"

    @property
    def summary(self) -> Path:
        """What a finished training run leaves: steps, loss history, its last checkpoint."""
        return self.path / "train_summary.json"

    @property
    def preempted(self) -> Path:
        """The marker a preempted run leaves for the job script: the step saved, the signal."""
        return self.path / "preempted.json"

    def rank_log(self, rank: int) -> Path:
        """Rank ``rank``'s console log."""
        return self.logs / f"rank{rank}.log"

    def step_records(self, rank: int) -> Path:
        """One JSON line per step of rank ``rank``: loss, token hash, samples consumed."""
        return self.logs / STEP_RECORDS.format(rank=rank)

    def all_step_records(self) -> list[Path]:
        """Every rank's step records."""
        return sorted(self.logs.glob(STEP_RECORDS.format(rank="*")))
