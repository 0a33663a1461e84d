"""``train_summary.json``'s history across resumes: every checkpoint carries the logged steps'
losses (``moe/training/run.py``, :class:`History`), so a resumed run's summary covers the whole
run, as an uninterrupted run's does, and a resume with nothing left to train keeps it."""

import json
import shutil

import pytest

from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.training.run import History, TrainState
from tests.conftest import tiny_run_dict
from tests.helpers.distributed import run_distributed


def _train(rank, world, runs, tiny_data):
    from moe.training.trainer import DistEnv, resolve_vocab, train

    env = DistEnv(0, 1, 0, 1)

    def cfg(name, max_steps):
        d = tiny_run_dict(tiny_data, runs, max_steps=max_steps)
        d["name"] = name
        d["logging"] = {"log_every": 2, "tensorboard": False}
        d["parallel"] = {"world_size": 1, "expert_parallel_size": 1}
        d["checkpoint"] = {"every_n_steps": 3}
        return resolve_vocab(from_dict(RunConfig, d))

    train(cfg("resumed", 3), env)  # stops at step 3 (its checkpoint)
    shutil.copy(f"{runs}/resumed/train_summary.json", f"{runs}/resumed_first.json")
    train(cfg("resumed", 6), env)  # resumes from step 3
    shutil.copy(f"{runs}/resumed/train_summary.json", f"{runs}/resumed_once.json")
    train(cfg("resumed", 6), env)  # nothing left to train


def _history(summary):
    return [(h["step"], h["loss"], h["lm_loss"]) for h in summary["history"]]


@pytest.mark.multiprocess
def test_a_resumed_runs_summary_holds_the_whole_history(tiny_data, tmp_path):
    runs = tmp_path / "runs"
    run_distributed(_train, 1, str(runs), tiny_data)
    first = json.loads((runs / "resumed_first.json").read_text())
    resumed = json.loads((runs / "resumed_once.json").read_text())
    again = json.loads((runs / "resumed" / "train_summary.json").read_text())
    assert [h[0] for h in _history(first)] == [1, 2, 3]  # the last step is logged too
    # The first attempt's entries as it logged them, then the resumed attempt's.
    assert _history(resumed)[:3] == _history(first)
    assert [h[0] for h in _history(resumed)] == [1, 2, 3, 4, 6]
    assert _history(again) == _history(resumed) and again["steps"] == 6


def test_a_checkpoint_without_a_history_keeps_the_entries_up_to_its_step():
    """A checkpoint saved before the history was carried: a resume starts with none, a
    rollback keeps what the run logged up to the step it restores."""
    state = TrainState(step=4, history=[{"step": s, "loss": float(s)} for s in (2, 4, 6)])
    History(state).load_state_dict(None)
    assert [h["step"] for h in state.history] == [2, 4]
    saved = History(state).state_dict()
    state.history.append({"step": 6, "loss": 6.0})
    History(state).load_state_dict(saved)
    assert [h["step"] for h in state.history] == [2, 4]
