"""The loss spike guard on a real 2-rank run (gloo): a test-only fault injector feeds rank 1 a
batch of one repeated rare token at one step and inflates that step's learning rate 300-fold;
the spike is detected, the update is skipped on every rank, the event is recorded."""

import copy
import json
import shutil

import pytest
import torch

from launch.slurm.jobs import last_steps
from moe.checkpoint.files import complete_tags
from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.core.errors import ConfigError
from moe.training.resilience.faults import FaultInjector
from moe.training.resilience.spike_guard import SKIPPED_BATCHES
from moe.training.trainer import DistEnv, train
from tests.conftest import rarest_token, tiny_run_dict
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.multiprocess

BAD_STEP = 9


class BadBatch(FaultInjector):
    def __init__(self, rank: int, token: int):
        self.rank, self.token = rank, token

    def batches(self, step, packed, samples):
        if step == BAD_STEP and self.rank == 1:
            for p in packed:
                p.tokens_BS = torch.full_like(p.tokens_BS, self.token)
        return packed

    def before_update(self, step, engine):
        if step == BAD_STEP:  # the schedule sets the next step's rate again
            for group in engine.optimizer.param_groups:
                group["lr"] *= 300


def _worker(rank, world, cfg_dict):
    cfg = from_dict(RunConfig, copy.deepcopy(cfg_dict))
    train(
        cfg,
        DistEnv(rank, world, rank, world),
        faults=BadBatch(rank, rarest_token(cfg_dict["data"]["dir"])),
    )


def _steps(run_dir, rank):
    return [json.loads(line) for line in (run_dir / "logs" / f"steps_rank{rank}.jsonl").open()]


def _config(tiny_data, tmp_path, name, action):
    cfg = tiny_run_dict(
        tiny_data,
        tmp_path / "runs",
        max_steps=BAD_STEP + 1,
        lr=1e-2,
        min_lr=1e-2,
        spike={"action": action, "window": 6, "min_steps": 4, "zscore": 4.0},
    )
    cfg["name"] = name
    cfg["checkpoint"] = {"every_n_steps": 1}
    return cfg


def _run(tiny_data, tmp_path, name, action):
    run_distributed(_worker, 2, _config(tiny_data, tmp_path, name, action))
    return tmp_path / "runs" / name


def _params(ckpt, step):
    from moe.parallel.layout import read_layout_free

    return read_layout_free(ckpt / f"step_{step:07d}")["params"]


def test_a_loss_spike_skips_the_update_on_every_rank_and_is_recorded(tiny_data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = _run(tiny_data, tmp_path, "spike", "skip")
    for rank in range(2):
        skipped = [r["step"] for r in _steps(run_dir, rank) if r["skipped"]]
        assert skipped == [BAD_STEP], skipped
    # Parameters unchanged by the bad step (despite its 300x learning rate), changed by the next.
    ckpt = run_dir / "checkpoints"
    before, after, next_ = (_params(ckpt, s) for s in (BAD_STEP - 1, BAD_STEP, BAD_STEP + 1))
    for name in before:
        assert torch.equal(before[name], after[name]), name
    assert any(not torch.equal(after[n], next_[n]) for n in after)

    events = [json.loads(line) for line in (run_dir / SKIPPED_BATCHES).open()]
    assert len(events) == 1
    e = events[0]
    global_batch = 2 * 1 * 2  # micro_batch_size * grad_accum_steps * world size
    assert e["step"] == BAD_STEP and e["reason"] == "loss_spike" and not e["applied"]
    assert e["samples"] == [(BAD_STEP - 1) * global_batch, BAD_STEP * global_batch]
    assert e["zscore"] > 4.0

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    z = acc.Scalars("train/loss_spike_zscore")
    assert [(s.step, round(s.value, 3)) for s in z] == [(BAD_STEP, round(e["zscore"], 3))]


def test_without_the_guard_the_bad_step_is_applied(tiny_data, tmp_path):
    """The same fault with train.spike.action off: the step is applied, the weights move (the
    test above would fail if the guard did nothing), and nothing is recorded."""
    run_dir = _run(tiny_data, tmp_path, "nospike", "off")
    assert not any(r["skipped"] for r in _steps(run_dir, 0))
    ckpt = run_dir / "checkpoints"
    before, after = _params(ckpt, BAD_STEP - 1), _params(ckpt, BAD_STEP)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    assert not (run_dir / SKIPPED_BATCHES).exists()
    assert complete_tags(ckpt)[-1] == f"step_{BAD_STEP + 1:07d}"


def _resume_worker(rank, world, cfg_dict):
    train(from_dict(RunConfig, copy.deepcopy(cfg_dict)), DistEnv(rank, world, rank, world))


def test_a_resume_on_fewer_ranks_keeps_one_history(tiny_data, tmp_path):
    """The run above, its checkpoints after step 7 lost, resumed on 1 rank with the same global
    batch (launch.elastic's restart) and the guard off: steps 8-10 run again, without the bad
    batch (rank 1's). The skip of step 9 leaves the record (also with no guard to write it) and
    rank 1's log, which no rank writes any more, is cut back to step 7: each step and each
    sample once in the history."""
    run_dir = _run(tiny_data, tmp_path, "shrunk", "skip")
    assert [e["step"] for e in map(json.loads, (run_dir / SKIPPED_BATCHES).open())] == [BAD_STEP]
    for tag in complete_tags(run_dir / "checkpoints")[7:]:
        shutil.rmtree(run_dir / "checkpoints" / tag)
    cfg = _config(tiny_data, tmp_path, "shrunk", "off")
    cfg["parallel"].update(world_size=1, expert_parallel_size=1)
    cfg["train"]["grad_accum_steps"] = 2
    run_distributed(_resume_worker, 1, cfg)

    assert (run_dir / SKIPPED_BATCHES).read_text() == ""
    assert [r["step"] for r in _steps(run_dir, 1)] == list(range(1, 8))
    final = _steps(run_dir, 0)
    assert [r["step"] for r in final] == list(range(1, BAD_STEP + 2))
    assert [r["world_size"] for r in final] == [2] * 7 + [1] * 3
    positions = sorted(i for r in final for i in range(*r["samples"]))
    assert positions == list(range((BAD_STEP + 1) * 4))  # a global batch of 4 sequences
    assert last_steps(run_dir)["step"] == BAD_STEP + 1


def test_spike_settings_are_validated(tiny_data, tmp_path):
    cfg = tiny_run_dict(
        tiny_data, tmp_path, spike={"action": "rollback", "window": 3, "min_steps": 5, "zscore": 0}
    )
    cfg["parallel"]["zero_stage"] = 0
    with pytest.raises(ConfigError) as e:
        from_dict(RunConfig, cfg)
    msg = str(e.value)
    assert "min_steps: 5 exceeds window (3)" in msg
    assert "zscore: must be > 0" in msg
    assert "needs ZeRO stage 1 or 2" in msg
