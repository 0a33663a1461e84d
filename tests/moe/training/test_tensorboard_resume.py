"""TensorBoard's history after a resume and after a rollback: each step once, with the values of
the run that finished, and the running counts (loss spikes, skipped steps, rollbacks) as an
uninterrupted run has them. Checked with both of TensorBoard's Python readers: the one tests
use (``event_accumulator``) and the one its data provider uses (``plugin_event_accumulator``,
which takes the first SessionLog START of a run as its start, not as a restart)."""

import copy
import json
import shutil
import time
from types import SimpleNamespace

import pytest
import torch

from moe.checkpoint.files import complete_tags
from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.training.hooks import TensorBoardReporter
from moe.training.resilience.faults import FaultInjector
from moe.training.resilience.spike_guard import SKIPPED_BATCHES
from moe.training.trainer import DistEnv, train
from tests.conftest import rarest_token, tiny_run_dict
from tests.helpers.distributed import run_distributed


def _scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] as TensorBoard reads ``log_dir``, the same from both readers."""
    from tensorboard.backend.event_processing import event_accumulator, plugin_event_accumulator
    from tensorboard.util import tensor_util

    acc = event_accumulator.EventAccumulator(str(log_dir))
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    plugin = plugin_event_accumulator.EventAccumulator(str(log_dir))
    plugin.Reload()
    tensors = {
        tag: [
            (e.step, tensor_util.make_ndarray(e.tensor_proto).item()) for e in plugin.Tensors(tag)
        ]
        for tag in plugin.Tags()["tensors"]
        if tag in scalars
    }
    assert tensors == {tag: [(s, pytest.approx(v)) for s, v in kv] for tag, kv in scalars.items()}
    return scalars


def _step(step, loss, z=None, rollback_to=None, skipped=False):
    return SimpleNamespace(
        step=step,
        loss=loss,
        lm_loss=loss,
        aux_loss=0.0,
        lr=1e-3,
        grad_norm=1.0,
        tokens_per_second=1.0,
        samples_per_step=4,
        step_seconds=1.0,
        is_log_step=True,
        extra={},
        histograms={},
        skipped=skipped or z is not None,
        spike_zscore=z,
        rollback_to=rollback_to,
    )


def _records(path, steps):
    """Rank 0's step records of ``steps``: {step: skipped}."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"step": s, "skipped": k}) + "\n" for s, k in steps.items()))


def test_a_resumed_run_replaces_the_steps_after_its_checkpoint(tmp_path):
    """Killed after step 8 (spikes skipped at steps 3 and 7), resumed from step 5's checkpoint:
    steps 6-8 once, with the resumed run's values; the counts go on from step 5's."""
    tb, records = tmp_path / "tensorboard", tmp_path / "logs" / "steps_rank0.jsonl"
    first = TensorBoardReporter(tb, "config", step_records=records)
    for n in range(1, 9):
        first.on_step_end(_step(n, 10.0 + n, z=9.0 if n in (3, 7) else None))
    first.close()
    _records(records, {n: n in (3, 7) for n in range(1, 9)})
    # What the trainer gives a run resumed from step 5: the event record cut back to step 5.
    events = [{"step": 3, "action": "skip", "zscore": 9.0}]
    second = TensorBoardReporter(tb, "config", start_step=5, events=events, step_records=records)
    for n in range(6, 9):
        second.on_step_end(_step(n, 20.0 + n, z=8.0 if n == 7 else None))
    second.close()

    got = _scalars(tb)
    assert got["train/loss"] == [(n, 10.0 + n) for n in range(1, 6)] + [
        (6, 26.0),
        (7, 27.0),
        (8, 28.0),
    ]
    assert got["train/loss_spikes"] == [(3, 1.0), (7, 2.0)]
    assert got["train/loss_spike_zscore"] == [(3, 9.0), (7, 8.0)]
    assert got["train/skipped_steps"] == [
        (1, 0),
        (2, 0),
        (3, 1),
        (4, 1),
        (5, 1),
        (6, 1),
        (7, 2),
        (8, 2),
    ]


def test_a_rollback_purges_the_steps_it_undoes_and_stands_after_a_resume(tmp_path):
    """A spike at step 10 rolls back to step 8's checkpoint; steps 9 and 10 run again, and the
    run is killed after step 11. In process: steps 9 and 10 once, as run again; the rollback's
    scalars stand. Resumed from step 8 (the record keeps the rollback, whose samples the run
    skips: it never meets that spike again): the same, and the counts go on."""
    tb, records = tmp_path / "tensorboard", tmp_path / "logs" / "steps_rank0.jsonl"
    first = TensorBoardReporter(tb, "config", step_records=records)
    for n in range(1, 10):
        first.on_step_end(_step(n, 10.0 + n))
    first.on_step_end(_step(10, 99.0, z=9.0, rollback_to=8))
    first.on_rollback({"step": 8})
    for n in range(9, 12):
        first.on_step_end(_step(n, 30.0 + n))
    first.writer.flush()  # killed: never closed

    once = [(n, 10.0 + n) for n in range(1, 9)]
    got = _scalars(tb)
    assert got["train/loss"] == once + [(n, 30.0 + n) for n in range(9, 12)]
    assert got["train/loss_rollbacks"] == [(10, 1.0)]
    assert got["train/loss_rollback_to_step"] == [(10, 8.0)]
    assert got["train/loss_spikes"] == [(10, 1.0)]
    assert got["train/skipped_steps"][-1] == (11, 1.0)  # the rolled-back attempt of step 10

    _records(records, {n: False for n in range(1, 12)})
    events = [{"step": 10, "action": "rollback", "zscore": 9.0, "rolled_back_to": 8}]
    second = TensorBoardReporter(tb, "config", start_step=8, events=events, step_records=records)
    for n in range(9, 13):
        second.on_step_end(_step(n, 40.0 + n))
    second.close()
    got = _scalars(tb)
    assert got["train/loss"] == once + [(n, 40.0 + n) for n in range(9, 13)]
    assert got["train/loss_rollbacks"] == [(10, 1.0)]
    assert got["train/loss_rollback_to_step"] == [(10, 8.0)]
    assert got["train/loss_spikes"] == [(10, 1.0)]
    assert got["train/loss_spike_zscore"] == [(10, 9.0)]
    assert [v for _, v in got["train/skipped_steps"]] == [0] * 8 + [1] * 4


BAD_STEPS = (7, 11)  # loss spikes, skipped: one before the checkpoint resumed from, one after
COMPARED = ("train/loss", "train/lr", "train/skipped_steps", "train/loss_spikes")


class Killed(Exception):
    pass


class BadBatches(FaultInjector):
    """The batches of ``BAD_STEPS`` hold one repeated rare token (a loss spike); ``kill_step``:
    raise in that step's forward, as a kill would stop the rank."""

    def __init__(self, token, kill_step=None):
        self.token, self.kill_step = token, kill_step

    def batches(self, step, packed, samples):
        if step in BAD_STEPS:
            for p in packed:
                p.tokens_BS = torch.full_like(p.tokens_BS, self.token)
        return packed

    def at(self, phase, step):
        if phase == "forward" and step == self.kill_step:
            raise Killed(step)


def _run_dir(cfg):
    from pathlib import Path

    return Path(cfg["output_dir"]) / cfg["name"]


def _worker(rank, world, cfgs, out):
    token = rarest_token(cfgs["u"]["data"]["dir"])
    env = DistEnv(rank, world, rank, world)

    def run(name, faults):
        train(from_dict(RunConfig, copy.deepcopy(cfgs[name])), env, faults=faults)

    run("u", BadBatches(token))
    try:
        run("i", BadBatches(token, kill_step=12))
    except Killed:
        pass
    ckpt = _run_dir(cfgs["i"]) / "checkpoints"
    for tag in complete_tags(ckpt):  # as if killed before its step 10 save: resumes from 8
        if int(tag.removeprefix("step_")) > 8:
            shutil.rmtree(ckpt / tag)
    resumed_at = time.time()
    run("i", BadBatches(token))
    with open(out, "w") as f:
        json.dump({"resumed_at": resumed_at}, f)


@pytest.mark.multiprocess
def test_tensorboard_after_a_kill_and_a_resume_is_the_uninterrupted_runs(tiny_data, tmp_path):
    """A 12-step run (spikes skipped at steps 7 and 11, checkpoints every 2 steps) killed in step
    12 and resumed from step 8 has in TensorBoard each step once, the resumed run's from step 9
    on, and the uninterrupted run's losses, skipped-step and spike counts."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfgs = {}
    for name in ("u", "i"):
        cfg = tiny_run_dict(
            tiny_data,
            tmp_path / "runs",
            max_steps=12,
            lr=1e-2,
            min_lr=1e-2,
            spike={"action": "skip", "window": 6, "min_steps": 4, "zscore": 4.0},
        )
        cfg["name"] = name
        cfg["parallel"] = {"world_size": 1, "expert_parallel_size": 1, "zero_stage": 2}
        cfgs[name] = cfg
    run_distributed(_worker, 1, cfgs, str(tmp_path / "out.json"))
    resumed_at = json.loads((tmp_path / "out.json").read_text())["resumed_at"]

    steps = [json.loads(line)["step"] for line in (_run_dir(cfgs["i"]) / SKIPPED_BATCHES).open()]
    assert steps == list(BAD_STEPS)  # the guard saw both spikes, each recorded once
    want, got = (_scalars(_run_dir(cfgs[n]) / "tensorboard") for n in ("u", "i"))
    assert [s for s, _ in want["train/loss"]] == list(range(1, 13))
    for tag in COMPARED:
        assert got[tag] == want[tag], tag
    assert want["train/loss_spikes"] == [(7, 1.0), (11, 2.0)]
    assert want["train/skipped_steps"][-1] == (12, 2.0)
    acc = EventAccumulator(str(_run_dir(cfgs["i"]) / "tensorboard"))
    acc.Reload()
    for tag in COMPARED:
        assert all(e.wall_time >= resumed_at for e in acc.Scalars(tag) if e.step > 8), tag
