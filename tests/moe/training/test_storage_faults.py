"""Checkpoint saves on a real full filesystem: a size-limited tmpfs mounted as the run's
checkpoint directory (as root; skipped otherwise), 2 ranks on gloo. The tmpfs is sized from a
checkpoint of the same config saved on ordinary disk, so that a later save runs out of space in
the middle of writing its files."""

import copy
import json
import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest

from moe.checkpoint.files import MARKER, complete_tags, find_latest, verify_files
from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.core.errors import CheckpointError
from moe.training.checkpoint import resolve_resume
from moe.training.trainer import DistEnv, train
from tests.conftest import tiny_run_dict
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.multiprocess


def run_dict(tiny_data, out_dir, name, **train_kw):
    d = tiny_run_dict(tiny_data, out_dir, **train_kw)
    d["name"] = name
    d["logging"] = {"log_every": 1, "tensorboard": False}
    return d


@contextmanager
def tmpfs(path: Path, size: int):
    """A tmpfs of ``size`` bytes at ``path``, unmounted on leaving."""
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def _worker(rank, world, cfg_dict, result_path, ballast):
    """Train; record how it ended. Rank 0 deletes ``ballast`` (frees space) after the first
    failed save."""
    from moe.training import checkpoint as ckpt_mod

    original = ckpt_mod.Checkpointer._failed

    def failed(self, *args, **kw):
        out = original(self, *args, **kw)
        if out and ballast and rank == 0 and Path(ballast).exists():
            ckpt = Path(ballast).parent
            Path(f"{result_path}.after_failure").write_text(
                json.dumps(
                    {
                        "complete": complete_tags(ckpt),
                        "dirs": sorted(
                            d.name for d in ckpt.iterdir() if d.name.startswith("step_")
                        ),
                    }
                )
            )
            Path(ballast).unlink()
        return out

    ckpt_mod.Checkpointer._failed = failed
    try:
        summary = train(
            from_dict(RunConfig, copy.deepcopy(cfg_dict)), DistEnv(rank, world, rank, world)
        )
        outcome = {"finished": summary["checkpoint"]}
    except CheckpointError as e:
        outcome = {"error": type(e).__name__, "message": str(e)}
    Path(f"{result_path}.{rank}").write_text(json.dumps(outcome))


def _outcomes(tmp_path):
    return [json.loads((tmp_path / f"result.{r}").read_text()) for r in range(2)]


def _steps(run_dir, rank):
    return [json.loads(line) for line in (run_dir / "logs" / f"steps_rank{rank}.jsonl").open()]


@pytest.fixture(scope="module")
def checkpoint_bytes(tiny_data, tmp_path_factory):
    """Bytes one checkpoint of the tiny 2-rank run takes (plus DeepSpeed's scripts beside it)."""
    out = tmp_path_factory.mktemp("size")
    cfg = run_dict(tiny_data, out / "runs", "size", max_steps=2)
    run_distributed(_worker, 2, cfg, str(out / "result"), None)
    ckpt = out / "runs" / "size" / "checkpoints"
    return sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())


def test_full_disk_stops_every_rank_and_keeps_the_previous_checkpoint(
    tiny_data, tmp_path, checkpoint_bytes
):
    """Room for one and a half checkpoints: the step-2 save completes, the step-4 save runs out
    of space; both ranks stop with the path and errno; the step-2 checkpoint still verifies and
    a resumed run (after the disk grew) starts from it."""
    cfg = run_dict(tiny_data, tmp_path / "runs", "full", max_steps=6)
    cfg["checkpoint"] = {"every_n_steps": 2, "keep_last": 1}
    run_dir = tmp_path / "runs" / "full"
    ckpt = run_dir / "checkpoints"
    with tmpfs(ckpt, int(1.5 * checkpoint_bytes)):
        run_distributed(_worker, 2, cfg, str(tmp_path / "result"), None)
        for outcome in _outcomes(tmp_path):
            assert outcome.get("error") == "CheckpointSaveError", outcome
            msg = outcome["message"]
            assert "step_0000004" in msg and "at step 4 failed" in msg
            assert "No space left on device (ENOSPC, errno 28)" in msg
            assert f"still {ckpt / 'step_0000002'}" in msg
        # Training stopped at the failed save: no step after 4 ran.
        assert [r["step"] for r in _steps(run_dir, 0)] == [1, 2, 3, 4]
        assert not (ckpt / "step_0000004").exists()  # the partial save was removed
        assert complete_tags(ckpt) == ["step_0000002"]
        assert verify_files(ckpt / "step_0000002")["step"] == 2
        assert resolve_resume("auto", ckpt) == ckpt / "step_0000002"

        subprocess.run(
            ["mount", "-o", f"remount,size={4 * checkpoint_bytes}", str(ckpt)], check=True
        )
        run_distributed(_worker, 2, cfg, str(tmp_path / "result"), None)
        assert _outcomes(tmp_path)[0] == {"finished": str(ckpt / "step_0000006")}
        assert [r["step"] for r in _steps(run_dir, 0)] == [1, 2, 3, 4, 5, 6]
        assert complete_tags(ckpt) == ["step_0000006"]  # keep_last 1, after it was complete
        verify_files(ckpt / "step_0000006")


def test_full_disk_with_continue_keeps_training_and_saves_once_space_is_freed(
    tiny_data, tmp_path, checkpoint_bytes
):
    """on_save_error: continue. A ballast file leaves room for one checkpoint only: the step-4
    save fails and is removed, training goes on, rank 0 deletes the ballast, and the step-6 save
    succeeds. keep_last 1 never deleted step 2 while step 4 failed."""
    cfg = run_dict(tiny_data, tmp_path / "runs", "cont", max_steps=6)
    cfg["checkpoint"] = {"every_n_steps": 2, "keep_last": 1, "on_save_error": "continue"}
    run_dir = tmp_path / "runs" / "cont"
    ckpt = run_dir / "checkpoints"
    with tmpfs(ckpt, int(2.5 * checkpoint_bytes)):
        ballast = ckpt / "ballast"
        ballast.write_bytes(b"\0" * checkpoint_bytes)
        run_distributed(_worker, 2, cfg, str(tmp_path / "result"), str(ballast))
        assert not ballast.exists(), "no save failed: the tmpfs was not small enough"
        # Right after the failed step-4 save: step 2 complete, nothing of step 4 left.
        assert json.loads((tmp_path / "result.after_failure").read_text()) == {
            "complete": ["step_0000002"],
            "dirs": ["step_0000002"],
        }
        for outcome in _outcomes(tmp_path):
            assert outcome == {"finished": str(ckpt / "step_0000006")}
        steps = _steps(run_dir, 1)
        assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
        assert not any(r["skipped"] for r in steps)
        assert complete_tags(ckpt) == ["step_0000006"]
        assert not (ckpt / "step_0000004").exists()
        assert verify_files(ckpt / "step_0000006")["step"] == 6
        assert find_latest(ckpt) == "step_0000006"
        assert not any(
            (d / MARKER).exists() for d in ckpt.iterdir() if d.is_dir() and d.name != "step_0000006"
        )


def _planned_worker(rank, world, cfg_dict, result_path, plan):
    """Train with a test fault plan (moe/training/resilience/faults.py); record how it ended."""
    from moe.training.resilience.faults import PlannedFaults

    try:
        summary = train(
            from_dict(RunConfig, copy.deepcopy(cfg_dict)),
            DistEnv(rank, world, rank, world),
            faults=PlannedFaults(plan, rank),
        )
        outcome = {"finished": summary["checkpoint"]}
    except CheckpointError as e:
        outcome = {"error": type(e).__name__, "message": str(e)}
    Path(f"{result_path}.{rank}").write_text(json.dumps(outcome))


def test_continue_with_a_failed_final_save_ends_in_error_and_names_the_unsaved_steps(
    tiny_data, tmp_path
):
    """on_save_error: continue, and every save of the last step fails (rank 1's first checkpoint
    write, at the periodic save and again at the final one): the run does not end as a success,
    every rank names the unsaved steps and the newest checkpoint, and train_summary.json points
    evaluation at no checkpoint."""
    cfg = run_dict(tiny_data, tmp_path / "runs", "lost", max_steps=4)
    cfg["checkpoint"] = {"every_n_steps": 2, "on_save_error": "continue"}
    run_dir = tmp_path / "runs" / "lost"
    ckpt = run_dir / "checkpoints"
    fault = {"kind": "save_error", "phase": "save", "rank": 1, "step": 4}
    plan = {
        "fired_dir": str(tmp_path / "fired"),
        "faults": [{"id": 0, **fault}, {"id": 1, **fault}],
    }
    (tmp_path / "fired").mkdir()
    run_distributed(_planned_worker, 2, cfg, str(tmp_path / "result"), plan)
    assert sorted(p.name for p in (tmp_path / "fired").iterdir()) == ["fault_0", "fault_1"]
    for outcome in _outcomes(tmp_path):
        assert outcome.get("error") == "CheckpointSaveError", outcome
        msg = outcome["message"]
        assert "final checkpoint is missing" in msg
        assert "saves at step(s) 4 failed" in msg and "steps 3 to 4 are not saved" in msg
        assert f"newest complete checkpoint is {ckpt / 'step_0000002'} (step 2)" in msg
    assert [r["step"] for r in _steps(run_dir, 0)] == [1, 2, 3, 4]  # it trained to the end
    assert complete_tags(ckpt) == ["step_0000002"]
    summary = json.loads((run_dir / "train_summary.json").read_text())
    assert summary["checkpoint"] is None
    assert summary["unsaved_steps"] == [3, 4] and summary["failed_saves"] == [4]
    assert summary["newest_checkpoint"] == str(ckpt / "step_0000002")
