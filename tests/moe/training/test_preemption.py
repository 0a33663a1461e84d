"""The preemption guard: a signal on any rank makes every rank save the same step and exit 75."""

import json
import os
import signal

import pytest

from moe.training.decision import Continue, Stop
from moe.training.hooks import StepState
from moe.training.resilience.preemption import (
    PREEMPTED_EXIT_CODE,
    Preempted,
    PreemptionGuard,
    exit_for_requeue,
)
from tests.helpers.distributed import run_distributed


class RecordingCheckpoint:
    """Stands in for the loop's save (which needs a DeepSpeed engine): records saved steps."""

    def __init__(self):
        self.saved = []

    def save(self, step: int) -> None:
        self.saved.append(step)


def end_of_step(guard: PreemptionGuard, ckpt: RecordingCheckpoint, s: StepState) -> None:
    """What the loop does with the guard's decision: save the step it names, then exit; its
    parts are closed however training ends."""
    decision = guard.decide(s, None)
    if isinstance(decision, Stop):
        ckpt.save(decision.step)
        try:
            exit_for_requeue(guard.marker, guard.rank, decision)
        finally:
            guard.close()
    assert isinstance(decision, Continue)


def state(step: int, max_steps: int = 10) -> StepState:
    return StepState(
        step=step,
        max_steps=max_steps,
        loss=1.0,
        lm_loss=1.0,
        aux_loss=0.0,
        lr=1e-3,
        grad_norm=None,
        step_seconds=0.1,
        tokens_per_step=1,
        samples_per_step=1,
        is_log_step=False,
    )


def test_sigusr1_saves_at_the_next_step_boundary_and_exits_75(tmp_path):
    ckpt = RecordingCheckpoint()
    previous = signal.getsignal(signal.SIGUSR1)
    hook = PreemptionGuard(tmp_path / "preempted.json", rank=0)
    end_of_step(hook, ckpt, state(3))
    assert ckpt.saved == []
    os.kill(os.getpid(), signal.SIGUSR1)  # handled, not fatal
    with pytest.raises(Preempted) as e:
        end_of_step(hook, ckpt, state(4))
    assert e.value.code == PREEMPTED_EXIT_CODE and e.value.step == 4
    assert ckpt.saved == [4]
    assert json.loads((tmp_path / "preempted.json").read_text())["step"] == 4
    assert signal.getsignal(signal.SIGUSR1) == previous  # handler given back


def test_a_signal_at_a_step_that_rolls_back_exits_on_the_checkpoint_it_rolls_back_to(tmp_path):
    """The step is undone (a loss spike, spike_guard.py): nothing of it is saved, and the job
    resumes from the checkpoint the rollback restores (the loop's save returns at once for the
    step of its newest checkpoint)."""
    ckpt = RecordingCheckpoint()
    hook = PreemptionGuard(tmp_path / "preempted.json", rank=0)
    os.kill(os.getpid(), signal.SIGUSR1)
    s = state(7)
    s.rollback_to = 4
    with pytest.raises(Preempted) as e:
        end_of_step(hook, ckpt, s)
    assert e.value.step == 4 and ckpt.saved == [4]
    assert json.loads((tmp_path / "preempted.json").read_text())["step"] == 4


def test_first_sigterm_saves_and_a_second_would_end_the_process(tmp_path):
    """With TERM in save_on_signals: the first SIGTERM is handled like USR1; the handler is then
    given back at once, so a second SIGTERM gets the old disposition (death by default)."""
    ckpt = RecordingCheckpoint()
    previous = signal.getsignal(signal.SIGTERM)
    hook = PreemptionGuard(
        tmp_path / "preempted.json", rank=0, signals=(signal.SIGUSR1, signal.SIGTERM)
    )
    assert signal.getsignal(signal.SIGTERM) == hook._on_signal
    os.kill(os.getpid(), signal.SIGTERM)  # handled, not fatal
    assert signal.getsignal(signal.SIGTERM) == previous
    with pytest.raises(Preempted) as e:
        end_of_step(hook, ckpt, state(5))
    assert e.value.code == PREEMPTED_EXIT_CODE and ckpt.saved == [5]
    assert json.loads((tmp_path / "preempted.json").read_text()) == {"step": 5, "signal": "SIGTERM"}
    assert signal.getsignal(signal.SIGUSR1) != hook._on_signal  # all handlers given back


def test_unknown_signal_in_the_config_is_named():
    from moe.config.run import CheckpointConfig

    problems = CheckpointConfig(save_on_signals=["USR1", "KILL"]).problems()
    assert problems == ["save_on_signals: 'KILL' is not one of ['TERM', 'USR1', 'USR2']"]


def test_a_signal_at_the_last_step_leaves_the_ordinary_final_save(tmp_path):
    ckpt = RecordingCheckpoint()
    hook = PreemptionGuard(tmp_path / "preempted.json", rank=0)
    os.kill(os.getpid(), signal.SIGUSR1)
    end_of_step(hook, ckpt, state(10, max_steps=10))
    hook.close()
    assert ckpt.saved == [] and not (tmp_path / "preempted.json").exists()


def _one_rank_signalled(rank, world_size, marker_dir, signum):
    ckpt = RecordingCheckpoint()
    hook = PreemptionGuard(
        marker_dir / "preempted.json", rank, signals=(signal.SIGUSR1, signal.SIGTERM)
    )
    end_of_step(hook, ckpt, state(1))
    if rank == 1:
        os.kill(os.getpid(), signum)
    try:
        end_of_step(hook, ckpt, state(2))
    except Preempted as e:
        assert e.step == 2 and ckpt.saved == [2]
        (marker_dir / f"exited{rank}").write_text("")
        return
    raise AssertionError(f"rank {rank} went on training")


@pytest.mark.multiprocess
@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM])
def test_ranks_agree_when_only_one_is_signalled(tmp_path, signum):
    run_distributed(_one_rank_signalled, 2, tmp_path, signum)
    assert (tmp_path / "exited0").exists() and (tmp_path / "exited1").exists()
    # Rank 0 writes the marker and names the signal that rank 1 got.
    assert json.loads((tmp_path / "preempted.json").read_text()) == {
        "step": 2,
        "signal": signal.Signals(signum).name,
    }
