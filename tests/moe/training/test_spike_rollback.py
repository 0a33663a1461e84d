"""Rolling back for a loss spike, on a real 2-rank run (gloo, expert parallel 2). A test-only
fault injector makes some global sample positions bad data: a step that reads one gets, on rank
1, a batch of one repeated rare token, and (run A) a 300-fold learning rate.

All runs share one pair of processes (starting ranks is most of the cost):

- A: spike at step 10 (samples [36, 40)), checkpoints every 4 steps: rolls back to step 8, runs
  step 9 again and trains steps 10 and on with the samples after the window; killed in step 11.
- A resumed from its newest checkpoint (step 8): skips the same window without a new spike.
- R, the reference: the same config, the window recorded as skipped before it starts.
- B: checkpoints every 10 steps; a spike at step 9, before any checkpoint (skipped instead),
  then bad data at steps 12 and 13's samples with ``max_rollbacks: 1``: a rollback to step 10,
  and the spike at step 12 again (on step 13's samples) stops the run.
"""

import copy
import json
import re

import pytest
import torch

from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.core.errors import ConfigError, TrainingError
from moe.training.resilience.faults import FaultInjector
from moe.training.resilience.spike_guard import SKIPPED_BATCHES
from moe.training.trainer import DistEnv, train
from tests.conftest import rarest_token, tiny_run_dict
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.multiprocess

GLOBAL_BATCH = 4  # micro_batch_size 2 x 2 ranks
BAD_A = range(36, 40)  # the samples of step 10
BAD_B = [*range(32, 36), *range(44, 52)]  # steps 9, 12 and, after the rollback, 12 again


class Killed(Exception):
    pass


class BadData(FaultInjector):
    """Steps whose global samples include a bad position train on bad data (rank 1's batch is
    one repeated token, the training split's rarest) at ``lr_scale`` times the rate; ``kill_step``: raise in that step's
    forward on every rank, as a kill would stop them."""

    def __init__(self, rank, token, bad, lr_scale=1.0, kill_step=None):
        self.rank, self.token = rank, token
        self.bad, self.lr_scale, self.kill_step = set(bad), lr_scale, kill_step
        self.bad_step = None

    def batches(self, step, packed, samples):
        self.bad_step = step if self.bad.intersection(range(*samples)) else None
        if self.bad_step is not None and self.rank == 1:
            for p in packed:
                p.tokens_BS = torch.full_like(p.tokens_BS, self.token)
        return packed

    def before_update(self, step, engine):
        if step == self.bad_step:
            for group in engine.optimizer.param_groups:
                group["lr"] *= self.lr_scale

    def at(self, phase, step):
        if phase == "forward" and step == self.kill_step:
            raise Killed(step)


def _config(tiny_data, out, name, max_steps, every=4, **spike):
    cfg = tiny_run_dict(
        tiny_data,
        out,
        max_steps=max_steps,
        lr=1e-2,
        min_lr=1e-2,
        spike={"action": "rollback", "window": 6, "min_steps": 4, "zscore": 4.0, **spike},
    )
    cfg["name"] = name
    cfg["checkpoint"] = {"every_n_steps": every}
    return cfg


def _worker(rank, world, cfgs, out):
    vocab = rarest_token(cfgs["A"]["data"]["dir"])  # the bad batch's token
    env = DistEnv(rank, world, rank, world)

    def run(name, faults):
        try:
            train(from_dict(RunConfig, copy.deepcopy(cfgs[name])), env, faults=faults)
            return "finished"
        except (Killed, TrainingError) as e:
            return f"{type(e).__name__}: {e}"

    outcome = {"A": run("A", BadData(rank, vocab, BAD_A, 300.0, kill_step=11))}
    outcome["A_steps_before_kill"] = _steps(cfgs["A"], rank)
    outcome["A resumed"] = run("A", BadData(rank, vocab, BAD_A, 300.0))
    outcome["R"] = run("R", BadData(rank, vocab, BAD_A, 300.0))
    outcome["B"] = run("B", BadData(rank, vocab, BAD_B))
    with open(f"{out}.{rank}", "w") as f:
        json.dump(outcome, f)


def _run_dir(cfg):
    from pathlib import Path

    return Path(cfg["output_dir"]) / cfg["name"]


def _steps(cfg, rank):
    path = _run_dir(cfg) / "logs" / f"steps_rank{rank}.jsonl"
    return [json.loads(line) for line in path.open()]


def _events(cfg):
    return [json.loads(line) for line in (_run_dir(cfg) / SKIPPED_BATCHES).open()]


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rollback")
    cfgs = {
        "A": _config(tiny_data, tmp / "runs", "A", 12),
        "R": _config(tiny_data, tmp / "runs", "R", 12),
        "B": _config(tiny_data, tmp / "runs", "B", 13, every=10, max_rollbacks=1),
    }
    (_run_dir(cfgs["R"])).mkdir(parents=True)
    (_run_dir(cfgs["R"]) / SKIPPED_BATCHES).write_text(
        json.dumps({"step": 10, "action": "rollback", "skipped_samples": [[36, 40]]}) + "\n"
    )
    run_distributed(_worker, 2, cfgs, str(tmp / "outcome"))
    outcomes = [json.loads((tmp / f"outcome.{r}").read_text()) for r in range(2)]
    return cfgs, outcomes


def _comparable(records):
    return [(r["step"], r["loss"], r["tokens_sha256"], r["samples"], r["skipped"]) for r in records]


def test_rollback_restores_the_checkpoint_and_skips_the_window(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfgs, outcomes = runs
    a = cfgs["A"]
    for o in outcomes:
        assert o["A"] == "Killed: 11" and o["A resumed"] == "finished", o
    # One event, recorded once: the resumed run passed the window without a new spike.
    [e] = _events(a)
    assert e["step"] == 10 and e["action"] == "rollback" and e["rolled_back_to"] == 8
    assert e["checkpoint"].endswith("step_0000008") and e["zscore"] > 4.0
    assert e["samples"] == e["skipped_samples"][0] == [36, 40]
    assert e["skipped_samples"] == [[36, 40]]

    # Before the kill: step 9 ran again, step 10 trained on the samples after the window, and
    # both equal the reference's steps, which never saw the window (bitwise losses).
    for rank, o in enumerate(outcomes):
        ref = _comparable(_steps(cfgs["R"], rank))
        assert [r[0] for r in ref] == list(range(1, 13))
        assert _comparable(o["A_steps_before_kill"]) == ref[:10]
        # After the kill and the resume from step 8: every step as in the reference.
        final = _steps(a, rank)
        assert _comparable(final) == ref
        # Each global sample exactly once: trained on by a step, or recorded as skipped.
        ranges = [r["samples"] for r in final] + e["skipped_samples"]
        positions = sorted(i for lo, hi in ranges for i in range(lo, hi))
        assert positions == list(range(12 * GLOBAL_BATCH + 4))

    acc = EventAccumulator(str(_run_dir(a) / "tensorboard"))
    acc.Reload()
    assert [(s.step, s.value) for s in acc.Scalars("train/loss_rollbacks")] == [(10, 1.0)]
    assert [(s.step, s.value) for s in acc.Scalars("train/loss_rollback_to_step")] == [(10, 8.0)]


def test_no_checkpoint_yet_skips_and_a_recurring_spike_stops(runs):
    cfgs, outcomes = runs
    for o in outcomes:
        assert o["B"].startswith("TrainingError: step 12: loss spike"), o["B"]
        assert "after 1 rollback(s) for spikes at step 12 (train.spike.max_rollbacks 1)" in o["B"]
    first, second = _events(cfgs["B"])
    # Step 9: no checkpoint to roll back to: skipped like train.spike.action skip.
    assert first["step"] == 9 and first["action"] == "skip" and not first["applied"]
    assert first["samples"] == [32, 36]
    # Step 12: rolled back to step 10; step 11 ran again, step 12 read step 13's samples.
    assert second["step"] == 12 and second["action"] == "rollback"
    assert second["rolled_back_to"] == 10 and second["skipped_samples"] == [[44, 48]]
    for rank in range(2):
        steps = _steps(cfgs["B"], rank)
        assert [r["skipped"] for r in steps] == [False] * 8 + [True] + [False] * 2 + [True]
        assert [r["samples"][0] for r in steps] == [*range(0, 44, 4), 48]


def test_rollback_settings_are_validated(tiny_data, tmp_path):
    cfg = tiny_run_dict(
        tiny_data,
        tmp_path,
        spike={"action": "rollback", "rollback_skip_steps": 0, "max_rollbacks": 0},
    )
    cfg["checkpoint"] = {"every_n_steps": 0}
    with pytest.raises(ConfigError) as e:
        from_dict(RunConfig, cfg)
    msg = str(e.value)
    assert "train.spike.rollback_skip_steps: must be >= 1" in msg
    assert "train.spike.max_rollbacks: must be >= 1" in msg
    assert "checkpoint.every_n_steps: train.spike.action rollback restores the newest" in msg
    cfg = tiny_run_dict(tiny_data, tmp_path, spike={"action": "restart"})
    with pytest.raises(ConfigError, match="train.spike.action: 'restart' is not allowed"):
        from_dict(RunConfig, cfg)


class _Cursor:
    def __init__(self):
        self.consumed, self.skipped = 0, []

    def state_dict(self):
        return {"consumed_samples": self.consumed}

    def skip(self, ranges):
        self.skipped += ranges


def test_the_skipped_window_holds_the_last_steps_after_the_checkpoint_only(tmp_path):
    """rollback_skip_steps 3 at a spike in step 7 with the checkpoint at step 5: steps 6 and 7
    (step 5 is in the checkpoint), as ranges of the samples they read (step 7's start after a
    skipped range); a second spike at step 7 goes past max_rollbacks, counted with the events
    of the run's record."""
    from moe.training.decision import Rollback, Stop
    from moe.training.hooks import StepState
    from moe.training.resilience.spike_guard import LossSpikeGuard, SpikeConfig

    cfg = SpikeConfig(
        action="rollback", window=4, min_steps=2, rollback_skip_steps=3, max_rollbacks=2
    )
    cursor = _Cursor()
    guard = LossSpikeGuard(cfg, tmp_path, cursor, 0, 1, events=[{"step": 7, "action": "rollback"}])

    def step(n, start, z=None):
        cursor.consumed = start + 4
        s = StepState(
            step=n,
            max_steps=9,
            loss=1.0,
            lm_loss=1.0,
            aux_loss=0.0,
            lr=1.0,
            grad_norm=1.0,
            step_seconds=1.0,
            tokens_per_step=1,
            samples_per_step=4,
            is_log_step=False,
            spike_zscore=z,
            skipped=z is not None,
        )
        return guard.decide(s, (5, tmp_path / "step_5"))

    for n in range(1, 7):
        step(n, 4 * (n - 1))
    decision = step(7, 28, z=9.0)  # samples [24, 28) were skipped earlier
    assert isinstance(decision, Rollback)
    assert decision.step == 5 and decision.checkpoint == tmp_path / "step_5"
    assert guard.pending == [[20, 24], [28, 32]]
    [e] = [json.loads(line) for line in (tmp_path / SKIPPED_BATCHES).open()]
    assert e["skipped_samples"] == [[20, 24], [28, 32]] and e["rollback"] == 2
    # The loop restores every registered state (the window among them), then the hooks run.
    client = {"step": 5, guard.state_key: {"losses": [1.0, 1.0]}}
    guard.load_state_dict(client[guard.state_key])
    guard.on_rollback(client)
    assert cursor.skipped == [[20, 24], [28, 32]] and list(guard.losses) == [1.0, 1.0]
    decision = step(7, 32, z=9.0)
    assert isinstance(decision, Stop) and decision.signal is None  # the loop raises TrainingError
    assert re.search("step 7: loss spike .* after 2 rollback", decision.reason)
