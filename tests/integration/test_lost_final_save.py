"""checkpoint.on_save_error: continue with the run's last save failing, through the real
launcher (2 ranks): moe-launch does not end as a success, the ranks name the steps left unsaved,
and train_summary.json points evaluation at no checkpoint (not at an older one)."""

import json

import pytest

from moe.checkpoint.files import complete_tags
from tests.conftest import tiny_run_dict
from tests.helpers import fault_runs as fr

pytestmark = pytest.mark.integration


def test_a_run_whose_final_save_failed_ends_non_zero_and_names_the_unsaved_steps(
    tiny_data, tmp_path
):
    d = tiny_run_dict(tiny_data, tmp_path / "runs", max_steps=4)
    d.update(
        name="lost",
        checkpoint={"every_n_steps": 2, "on_save_error": "continue"},
        launch={"max_restarts": 0},
    )
    config = fr.write_run_config(tmp_path / "lost.yaml", d)
    # Rank 0's first checkpoint write of step 4 fails, at the periodic save and at the final one.
    fault = {"kind": "save_error", "phase": "save", "rank": 0, "step": 4}
    plan = {
        "fired_dir": str(tmp_path / "fired"),
        "faults": [{"id": 0, **fault}, {"id": 1, **fault}],
    }
    proc = fr.launch(config, plan=plan, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    run_dir = tmp_path / "runs" / "lost"
    ckpt = run_dir / "checkpoints"
    assert complete_tags(ckpt) == ["step_0000002"]
    assert "final checkpoint is missing" in out and "steps 3 to 4 are not saved" in out, out
    summary = json.loads((run_dir / "train_summary.json").read_text())
    assert summary["checkpoint"] is None and summary["unsaved_steps"] == [3, 4]
    assert summary["newest_checkpoint"] == str(ckpt / "step_0000002")
    assert f"checkpoint      {ckpt / 'step_0000002'}" not in out  # not named as the result
