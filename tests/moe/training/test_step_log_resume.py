"""The per-rank step log after a resume: each step appears exactly once. The end-to-end resume
after a SIGKILL (bitwise losses, same token ids) is checked with the real launcher in
tests/integration/test_s3_training.py (resumed by hand) and test_fault_campaign.py (restarted
automatically)."""

import json
from types import SimpleNamespace

from moe.training.hooks import StepRecorder


def test_step_log_is_cut_back_to_the_resumed_step(tmp_path):
    """The writer's side on its own: a log that ran to step 8 before a kill (the last line cut
    short) and a run resumed from step 5's checkpoint: steps 1-5 kept, 6 onward once."""
    path = tmp_path / "logs" / "steps_rank0.jsonl"
    path.parent.mkdir()
    old = [
        json.dumps({"step": i, "loss": float(i), "tokens_sha256": "old", "skipped": False})
        for i in range(1, 9)
    ]
    path.write_text("\n".join(old) + '\n{"step": 9, "lo')
    hook = StepRecorder(path)
    assert path.read_text().startswith(old[0])  # nothing changes before the first step
    for step in (6, 7):
        hook.on_step_end(
            SimpleNamespace(
                step=step,
                local_loss=0.5,
                tokens_sha256="new",
                consumed_samples=4 * step,
                samples_per_step=4,
                skipped=False,
            )
        )
    hook.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7]
    assert [r["tokens_sha256"] for r in rows] == ["old"] * 5 + ["new"] * 2
    assert [r["samples"] for r in rows[5:]] == [[20, 24], [24, 28]]
