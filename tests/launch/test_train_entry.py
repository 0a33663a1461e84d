"""moe-train's entry point: after DeepSpeed's start-up every rank removes its shared-memory file
name (after a barrier); it tears the process group down on every rank before the interpreter
exits, after a finished and after a preempted run, and leaves it alone after an error."""

import pytest
import torch.distributed as dist

import launch.train as train_entry
from moe.errors import MoEError
from moe.training.preemption import PREEMPTED_EXIT_CODE, Preempted


@pytest.fixture
def calls(monkeypatch, tiny_config_file):
    """Run ``main`` with the distributed calls and ``train`` replaced by recorders."""
    seen: list[str] = []
    import deepspeed

    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: seen.append("init"))
    monkeypatch.setattr(dist, "is_initialized", lambda: "init" in seen and "destroy" not in seen)
    monkeypatch.setattr(dist, "barrier", lambda *a, **kw: seen.append("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **kw: seen.append("destroy"))
    # main's process-wide settings stay out of this test process
    monkeypatch.setattr(train_entry, "setup_logging", lambda *a, **kw: None)
    monkeypatch.setattr(train_entry, "keep_freed_memory", lambda: True)
    monkeypatch.setattr(train_entry.torch, "set_num_threads", lambda n: None)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)

    def run(outcome):
        def fake_train(cfg, env, resume):
            seen.append("train")
            if outcome is not None:
                raise outcome

        monkeypatch.setattr(train_entry, "train", fake_train)
        return train_entry.main(["--config", str(tiny_config_file)])

    return seen, run


def test_finished_run_destroys_the_process_group(calls):
    seen, run = calls
    run(None)
    assert seen == ["init", "barrier", "train", "barrier", "destroy"]


def test_preempted_run_destroys_the_group_and_keeps_its_exit_code(calls):
    seen, run = calls
    with pytest.raises(SystemExit) as info:
        run(Preempted(3))
    assert info.value.code == PREEMPTED_EXIT_CODE
    assert seen == ["init", "barrier", "train", "barrier", "destroy"]


@pytest.mark.parametrize("error", [MoEError("bad shard"), RuntimeError("boom")])
def test_failed_run_leaves_the_group_alone(calls, error):
    seen, run = calls
    with pytest.raises((SystemExit, RuntimeError)):
        run(error)
    assert seen == ["init", "barrier", "train"]
