"""The run's records after a resume: each step appears exactly once in the per-rank step logs
(those of ranks a resume on fewer ranks left out included), each event once in the skipped-batch
record. The end-to-end resume after a SIGKILL (bitwise losses, same token ids) is checked with
the real launcher in tests/integration/test_s3_training.py (resumed by hand) and
test_fault_campaign.py (restarted automatically); on fewer ranks in
tests/moe/training/test_spike_guard.py."""

import json
from types import SimpleNamespace

from moe.training.hooks import StepRecorder
from moe.training.resilience.spike_guard import SKIPPED_BATCHES, cut_back_events


def _killed_log(path, steps=8):
    """A log that ran to step ``steps`` before a kill, its last line cut short."""
    lines = [
        json.dumps({"step": i, "loss": float(i), "tokens_sha256": "old", "skipped": False})
        for i in range(1, steps + 1)
    ]
    path.parent.mkdir(exist_ok=True)
    path.write_text("\n".join(lines) + f'\n{{"step": {steps + 1}, "lo')
    return lines


def _step(step, **fields):
    return SimpleNamespace(
        step=step,
        local_loss=0.5,
        tokens_sha256="new",
        consumed_samples=4 * step,
        samples_per_step=4,
        skipped=False,
        **fields,
    )


def test_step_log_is_cut_back_to_the_resumed_step(tmp_path):
    """The writer's side on its own: a log that ran to step 8 before a kill (the last line cut
    short) and a run resumed from step 5's checkpoint: steps 1-5 kept, 6 onward once."""
    path = tmp_path / "logs" / "steps_rank0.jsonl"
    old = _killed_log(path)
    hook = StepRecorder(path)
    assert path.read_text().startswith(old[0])  # nothing changes before the first step
    for step in (6, 7):
        hook.on_step_end(_step(step))
    hook.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7]
    assert [r["tokens_sha256"] for r in rows] == ["old"] * 5 + ["new"] * 2
    assert [r["samples"] for r in rows[5:]] == [[20, 24], [24, 28]]


def test_rank_0_cuts_back_the_step_logs_of_ranks_a_resume_left_out(tmp_path):
    """Killed at step 8 on 3 ranks, resumed from step 5 on 2: rank 2's log, which no rank
    writes any more, keeps steps 1-5 like the others; rank 1 touches only its own."""
    logs = tmp_path / "logs"
    old = {r: _killed_log(logs / f"steps_rank{r}.jsonl") for r in range(3)}
    rank1 = StepRecorder(logs / "steps_rank1.jsonl", rank=1, world_size=2)
    rank1.on_step_end(_step(6))
    rank1.close()
    assert (logs / "steps_rank2.jsonl").read_text().startswith("\n".join(old[2]))
    rank0 = StepRecorder(logs / "steps_rank0.jsonl", rank=0, world_size=2)
    rank0.on_step_end(_step(6))
    rank0.close()
    for r in range(3):
        rows = [json.loads(line) for line in (logs / f"steps_rank{r}.jsonl").open()]
        assert [row["step"] for row in rows] == [1, 2, 3, 4, 5] + ([6] if r < 2 else []), r
        assert [row["tokens_sha256"] for row in rows[:5]] == ["old"] * 5
        assert rows[5:] == [] or rows[5]["world_size"] == 2


class _Cursor:
    consumed = 24

    def state_dict(self):
        return {"consumed_samples": self.consumed}


def test_the_skip_record_is_cut_back_to_the_resumed_step_keeping_rollbacks(tmp_path):
    """An earlier run recorded skips at steps 3 and 7 and a rollback at step 8, and was killed
    while writing step 9's; the run resumed from step 5 decides steps 6 on again: the skip at 7
    goes (the resumed run records it again if it spikes again), the rollback stays (this run
    skips its samples and so never meets that spike again), the cut line goes. A record that
    would not change is not rewritten, and none is made where there was none."""
    path = tmp_path / SKIPPED_BATCHES
    events = [
        {"step": 3, "action": "skip"},
        {"step": 7, "action": "skip"},
        {"step": 8, "action": "rollback", "skipped_samples": [[28, 32]]},
    ]
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + '{"step": 9, "act')
    cut_back_events(tmp_path, 6)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [events[0], events[2]]
    before = path.stat().st_mtime_ns
    cut_back_events(tmp_path, 6)
    assert path.stat().st_mtime_ns == before
    cut_back_events(tmp_path / "elsewhere", 6)
    assert not (tmp_path / "elsewhere").exists()
