"""What a finished training run ends with, whichever scheduler ran it: the summary of the run
and, unless asked not to, the evaluation of its final checkpoint on one process.

moe-launch calls :func:`finish` after a local, hostfile or mpi run; a SLURM job script runs
``python -m launch.finish RUN_DIR`` as one task of its allocation once training has finished
(never after a preemption, which requeues the job instead).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
from pathlib import Path

import torch

from launch.cli import exits_cleanly
from launch.evaluate import evaluate_checkpoint
from moe.core.errors import LaunchError
from moe.core.run_dir import RunDir


def finish(run_dir: Path, evaluate: bool) -> list[str]:
    """The closing lines of a finished run: where everything is, the evaluation's results, where
    its report is and the command that compares the run's checkpoints."""
    files = RunDir(run_dir)
    try:
        summary = json.loads(files.summary.read_text())
    except FileNotFoundError:
        raise LaunchError(
            f"{files.summary} is missing: training did not finish (per-rank logs in {files.logs})"
        ) from None
    if summary["checkpoint"] is None:  # the last save failed (checkpoint.on_save_error: continue)
        first, last = summary.get("unsaved_steps") or ("?", "?")
        raise LaunchError(
            f"{run_dir}: training ended without a checkpoint of its last step: "
            f"steps {first} to {last} are not saved (the newest complete "
            f"checkpoint is {summary.get('newest_checkpoint')}); resume once the "
            "storage is fixed"
        )
    tb_dir = files.tensorboard
    # Only point at event files that exist (logging.tensorboard: false writes none).
    tensorboard = (
        f"tensorboard --logdir {shlex.quote(str(tb_dir))}"
        if tb_dir.is_dir()
        else "none written (logging.tensorboard: false)"
    )
    lines = [
        f"run directory   {run_dir}",
        f"tensorboard     {tensorboard}",
        f"checkpoint      {summary['checkpoint']}",
    ]
    if summary["history"] and summary["history"][0]["step"] == 1:
        lines.append(f"step-1 loss     {summary['history'][0]['loss']:.4f}")
    if evaluate:
        with torch_threads(summary.get("threads_per_rank")):
            r = evaluate_checkpoint(summary["checkpoint"])
        lines += [
            f"valid loss      {r['loss']:.4f} nats/token over {r['tokens']:,} tokens "
            f"(uniform guess {r['uniform_loss']:.4f})",
            f"perplexity      {r['perplexity']:.2f}",
            f"evaluation      {r['output']}",
            f"eval report     {r['report']}",
            f"compare         moe-eval --all {shlex.quote(str(run_dir))}   (every checkpoint of "
            "the run, one table)",
        ]
    else:
        lines.append(
            f"evaluate        moe-eval {shlex.quote(str(summary['checkpoint']))}   "
            "(skipped: --no-eval)"
        )
    return lines


@contextlib.contextmanager
def torch_threads(n: int | None):
    """torch's intra-op threads set to ``n`` (None: unchanged) for the block. The evaluation
    after training runs with a rank's threads (train.threads_per_rank, else the cores shared by
    the ranks of a machine, launch/train.py): on cores that other processes keep busy, one
    thread per core in use spins against them and ran several times slower."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@exits_cleanly
def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m launch.finish", description=__doc__)
    p.add_argument("run_dir", help="the run directory of a finished training run")
    p.add_argument("--no-eval", action="store_true", help="skip evaluating the final checkpoint")
    args = p.parse_args(argv)
    print("\n".join(finish(Path(args.run_dir), evaluate=not args.no_eval)), flush=True)


if __name__ == "__main__":
    main()
