"""The loop's parts share one interface (moe/training/hooks.py, LoopPart): every part is closed
when training ends, also when a step raises; the guards' answers combine by one rule; the states
a checkpoint carries are registered by name."""

from __future__ import annotations

import copy
import signal
from pathlib import Path

import pytest

from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.training import trainer
from moe.training.checkpoint import RESERVED_NAMES, carry
from moe.training.decision import CONTINUE, Rollback, Skip, Stop, decide
from moe.training.hooks import LoopPart, StepState
from moe.training.resilience.faults import FaultInjector
from tests.conftest import tiny_run_dict


class Answer(LoopPart):
    """A guard that gives a fixed answer and records that it was asked."""

    def __init__(self, answer, asked: list):
        self.answer, self.asked = answer, asked

    def decide(self, state, latest):
        self.asked.append(self)
        return self.answer


def step_state() -> StepState:
    return StepState(
        step=3,
        max_steps=9,
        loss=1.0,
        lm_loss=1.0,
        aux_loss=0.0,
        lr=1.0,
        grad_norm=1.0,
        step_seconds=1.0,
        tokens_per_step=1,
        samples_per_step=1,
        is_log_step=False,
    )


def test_the_most_severe_answer_wins_and_a_stop_ends_the_asking(tmp_path):
    asked: list = []
    skip, other_skip = Skip("nan"), Skip("spike")
    rollback, stop = Rollback(2, tmp_path, "spike"), Stop("nan")
    s = step_state()
    assert decide([Answer(skip, asked), Answer(CONTINUE, asked)], s, None) is skip
    assert decide([Answer(skip, asked), Answer(other_skip, asked)], s, None) is other_skip
    assert decide([Answer(skip, asked), Answer(rollback, asked)], s, None) is rollback
    assert s.rollback_to == 2  # marked for the guards after it and the reporters
    asked.clear()
    guards = [Answer(stop, asked), Answer(rollback, asked), LoopPart()]
    assert decide(guards, step_state(), None) is stop
    assert asked == guards[:1]  # the guards after a stop are not asked (collectives)
    assert decide([LoopPart(), LoopPart()], step_state(), None) is CONTINUE


def test_a_state_name_is_registered_once_and_never_a_reserved_one():
    states: dict = {}
    carry(states, "tally", LoopPart())
    with pytest.raises(ValueError, match="'tally' is taken"):
        carry(states, "tally", LoopPart())
    for name in ("step", "module", "optimizer"):
        assert name in RESERVED_NAMES
        with pytest.raises(ValueError, match=f"'{name}' is reserved"):
            carry(states, name, LoopPart())


class RaiseInStep2(FaultInjector):
    def at(self, phase, step):
        if step == 2 and phase == "backward":
            raise RuntimeError("raised inside step 2")


class Extra(LoopPart):
    """A part added through train(parts=...)."""


def test_every_part_is_closed_when_a_step_raises(tiny_data, tmp_path, monkeypatch):
    """A run with every kind of part (validation, memory and throughput meters, the router
    balance, the non-finite, spike and preemption guards, the console, step-record and
    TensorBoard reporters, the hang watchdog, a part added by the caller) raises inside its
    second step: each part is closed once, and what it held is released."""
    d = tiny_run_dict(tiny_data, tmp_path / "runs", max_steps=3)
    d["parallel"] = {"world_size": 1, "expert_parallel_size": 1, "zero_stage": 2}
    d["eval"] = {"every_n_steps": 1, "max_tokens": 200}
    d["train"]["spike"] = {"action": "skip", "window": 2, "min_steps": 2}
    d["logging"] = {"log_every": 1, "tensorboard": True}
    started, closed = [], []
    start_run = trainer.start_run

    def recording_start(*args, **kwargs):
        run = start_run(*args, **kwargs)
        for part in run.parts:
            close = part.close

            def recorded(part=part, close=close):
                closed.append(part)
                close()

            part.close = recorded
        started.append(run)
        return run

    monkeypatch.setattr(trainer, "start_run", recording_start)
    env = trainer.DistEnv(0, 1, 0, 1)
    for key, value in env.torch_env().items():  # a free port, not the default one: other
        monkeypatch.setenv(key, value)  # tests' launches may hold 29500 at the same time
    usr1 = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(RuntimeError, match="raised inside step 2"):
        trainer.train(
            from_dict(RunConfig, copy.deepcopy(d)),
            env,
            resume="none",
            faults=RaiseInStep2(),
            parts=[lambda run: Extra()],
        )
    [run] = started
    kinds = {type(p).__name__ for p in run.parts}
    assert kinds == {
        "ValidationMeter",
        "MemoryMeter",
        "ThroughputMeter",
        "RouterBalance",
        "NonFiniteGuard",
        "LossSpikeGuard",
        "ConsoleReporter",
        "StepRecorder",
        "TensorBoardReporter",
        "PreemptionGuard",
        "HangWatchdog",
        "Extra",
    }
    assert sorted(map(id, closed)) == sorted(map(id, run.parts))  # each once
    by_kind = {type(p).__name__: p for p in run.parts}
    assert by_kind["TensorBoardReporter"].writer.all_writers is None  # flushed and closed
    assert by_kind["StepRecorder"].file.closed
    watchdog = by_kind["HangWatchdog"]
    watchdog._thread.join(timeout=10)
    assert not watchdog._thread.is_alive()
    assert signal.getsignal(signal.SIGUSR1) == usr1  # the preemption guard gave it back
    assert run.loader.inner._thread is None  # the prefetching thread stopped
    assert Path(run.cfg.run_dir / "logs" / "steps_rank0.jsonl").read_text().count("\n") == 1
