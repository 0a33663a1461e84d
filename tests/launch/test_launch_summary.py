"""moe-launch's final summary names only what the run wrote: a TensorBoard command only when
event files exist."""

import json
import sys

import pytest

from launch.finish import finish
from launch.launch import run_to_end
from launch.run_plan import Plan
from moe.core.errors import LaunchError


def _finish(run_dir, tensorboard: bool, capsys) -> str:
    # What a finished training run leaves behind; the "ranks" are a process that does nothing.
    (run_dir / "train_summary.json").write_text(json.dumps({"checkpoint": "CKPT", "history": []}))
    if tensorboard:
        (run_dir / "tensorboard").mkdir()
    plan = Plan(
        scheduler="local",
        command=[sys.executable, "-c", "pass"],
        run_dir=str(run_dir),
        world_size=1,
    )
    run_to_end(plan, run_dir, evaluate=False)
    return capsys.readouterr().out


def test_summary_without_tensorboard_names_no_logdir(tmp_path, capsys):
    out = _finish(tmp_path, tensorboard=False, capsys=capsys)
    assert "--logdir" not in out
    assert "tensorboard     none written (logging.tensorboard: false)" in out


def test_summary_with_tensorboard_names_the_existing_logdir(tmp_path, capsys):
    out = _finish(tmp_path, tensorboard=True, capsys=capsys)
    assert f"tensorboard     tensorboard --logdir {tmp_path / 'tensorboard'}" in out


def test_the_commands_it_prints_quote_their_paths(tmp_path, capsys):
    """A run directory whose name holds shell syntax: the printed commands, pasted, run
    tensorboard and moe-eval on it and nothing else."""
    import shlex

    run_dir = tmp_path / "x$(touch pwned)'; y"
    run_dir.mkdir()
    out = _finish(run_dir, tensorboard=True, capsys=capsys)
    command = next(line for line in out.splitlines() if "--logdir" in line).split(None, 1)[1]
    assert shlex.split(command) == ["tensorboard", "--logdir", str(run_dir / "tensorboard")]
    evaluate = next(line for line in out.splitlines() if line.startswith("evaluate"))
    assert shlex.split(evaluate)[1:3] == ["moe-eval", "CKPT"]


def test_a_run_without_its_final_checkpoint_is_not_finished_with_an_older_one(tmp_path):
    """A summary whose last save failed (checkpoint.on_save_error: continue) names no
    checkpoint: finishing it names the unsaved steps instead of evaluating an older one."""
    (tmp_path / "train_summary.json").write_text(
        json.dumps(
            {
                "checkpoint": None,
                "history": [],
                "unsaved_steps": [11, 40],
                "newest_checkpoint": "RUN/checkpoints/step_0000010",
            }
        )
    )
    with pytest.raises(LaunchError, match="steps 11 to 40 are not saved .*step_0000010"):
        finish(tmp_path, evaluate=True)


def test_the_evaluation_after_training_runs_with_the_ranks_threads(tmp_path, monkeypatch):
    """A rank's torch threads (recorded by the trainer in its summary), not every core: on cores
    others keep busy, one spinning thread per core ran the demo's evaluation several times slower."""
    import torch

    import launch.finish as finish_module

    before = torch.get_num_threads()
    ranks = 1 if before > 1 else 2
    seen = []

    def evaluate_checkpoint(path):
        seen.append((path, torch.get_num_threads()))
        return {
            "loss": 1.0,
            "tokens": 10,
            "uniform_loss": 2.0,
            "perplexity": 2.7,
            "output": "eval.json",
            "report": "report.md",
        }

    monkeypatch.setattr(finish_module, "evaluate_checkpoint", evaluate_checkpoint)
    (tmp_path / "train_summary.json").write_text(
        json.dumps({"checkpoint": "CKPT", "history": [], "threads_per_rank": ranks})
    )
    lines = finish(tmp_path, evaluate=True)
    assert seen == [("CKPT", ranks)] and "perplexity      2.70" in lines
    assert torch.get_num_threads() == before  # this process's setting comes back
