"""Exact resume after a crash, with the real launcher and a real signal: rank 1 of a 2-rank
expert-parallel run is killed with SIGKILL mid-training; running the same command again resumes
from the newest complete checkpoint and must reproduce the uninterrupted run's per-step losses
bit for bit (CPU, fp32) on the same token ids (the data stream neither repeats nor skips)."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from moe.checkpoint.files import complete_tags
from moe.training.hooks import StepRecordHook
from tests.conftest import tiny_run_dict
from tests.integration.launch_checks import kill_rank_after, steps

pytestmark = pytest.mark.integration

MAX_STEPS = 12


def write_config(tiny_data, tmp_path, name) -> Path:
    d = tiny_run_dict(tiny_data, tmp_path / "runs", max_steps=MAX_STEPS)
    d["name"] = name
    d["checkpoint"] = {"every_n_steps": 3, "keep_last": 2}
    d["logging"] = {"log_every": 1, "tensorboard": False}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


def launch(config: Path, **kw):
    # launch.max_restarts 0: this test resumes by hand (tests/integration/test_restarts.py
    # tests the automatic restart).
    return subprocess.Popen([sys.executable, "-m", "launch.launch", str(config), "--no-eval",
                             "launch.max_restarts=0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **kw)


def test_sigkill_one_rank_then_resume_reproduces_the_uninterrupted_run(tiny_data, tmp_path):
    reference = launch(write_config(tiny_data, tmp_path, "reference"))
    out, _ = reference.communicate(timeout=600)
    assert reference.returncode == 0, out[-3000:]

    config = write_config(tiny_data, tmp_path, "crashed")
    run_dir = tmp_path / "runs" / "crashed"
    kill_rank_after(launch(config), run_dir, 5)
    killed_at = max(steps(run_dir, 1))
    assert killed_at < MAX_STEPS
    tags = complete_tags(run_dir / "checkpoints")
    assert tags and len(tags) <= 2  # keep_last

    resumed = launch(config)
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / tags[-1]}" in out

    hashes = set()
    for rank in (0, 1):
        # The resumed run cut its step log back to its checkpoint: every step exactly once.
        lines = (run_dir / "logs" / f"steps_rank{rank}.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == list(range(1, MAX_STEPS + 1))
        want, got = steps(tmp_path / "runs" / "reference", rank), steps(run_dir, rank)
        assert sorted(got) == list(range(1, MAX_STEPS + 1))
        for step in want:
            # Bitwise: the JSON floats round-trip exactly.
            assert got[step]["loss"] == want[step]["loss"], (rank, step)
            assert got[step]["tokens_sha256"] == want[step]["tokens_sha256"], (rank, step)
            hashes.add(got[step]["tokens_sha256"])
    assert len(hashes) == 2 * MAX_STEPS  # no batch was read twice
    assert complete_tags(run_dir / "checkpoints") == ["step_0000009", "step_0000012"]


def test_step_log_is_cut_back_to_the_resumed_step(tmp_path):
    """The writer's side on its own: a log that ran to step 8 before a kill (the last line cut
    short) and a run resumed from step 5's checkpoint: steps 1-5 kept, 6 onward once."""
    path = tmp_path / "logs" / "steps_rank0.jsonl"
    path.parent.mkdir()
    old = [json.dumps({"step": i, "loss": float(i), "tokens_sha256": "old", "skipped": False})
           for i in range(1, 9)]
    path.write_text("\n".join(old) + '\n{"step": 9, "lo')
    hook = StepRecordHook(path)
    assert path.read_text().startswith(old[0])  # nothing changes before the first step
    for step in (6, 7):
        hook.on_step_end(SimpleNamespace(step=step, local_loss=0.5, tokens_sha256="new",
                                         consumed_samples=4 * step, samples_per_step=4,
                                         skipped=False))
    hook.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7]
    assert [r["tokens_sha256"] for r in rows] == ["old"] * 5 + ["new"] * 2
    assert [r["samples"] for r in rows[5:]] == [[20, 24], [24, 28]]
