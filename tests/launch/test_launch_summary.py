"""moe-launch's final summary names only what the run wrote: a TensorBoard command only when
event files exist."""

import json
import sys

from launch.launch import run_to_end
from launch.plan import Plan


def _finish(run_dir, tensorboard: bool, capsys) -> str:
    # What a finished training run leaves behind; the "ranks" are a process that does nothing.
    (run_dir / "train_summary.json").write_text(json.dumps({"checkpoint": "CKPT", "history": []}))
    if tensorboard:
        (run_dir / "tensorboard").mkdir()
    plan = Plan(scheduler="local", command=[sys.executable, "-c", "pass"], run_dir=str(run_dir),
                world_size=1)
    run_to_end(plan, run_dir, evaluate=False)
    return capsys.readouterr().out


def test_summary_without_tensorboard_names_no_logdir(tmp_path, capsys):
    out = _finish(tmp_path, tensorboard=False, capsys=capsys)
    assert "--logdir" not in out
    assert "tensorboard     none written (logging.tensorboard: false)" in out


def test_summary_with_tensorboard_names_the_existing_logdir(tmp_path, capsys):
    out = _finish(tmp_path, tensorboard=True, capsys=capsys)
    assert f"tensorboard     tensorboard --logdir {tmp_path / 'tensorboard'}" in out
