"""Crash-safe saving, integrity checks on load, bad input and the NaN/Inf guard, on real 2-rank
runs (gloo). One run is shared by most tests: it saves at step 2, and rank 1 is killed with
SIGKILL in the middle of the step-4 save, after DeepSpeed wrote its files and before the
checkpoint was published."""

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from moe.checkpoint.files import (
    MARKER,
    complete_tags,
    find_latest,
    rng_file,
    verify_checkpoint,
    verify_files,
)
from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.core.errors import CheckpointError, TrainingError
from moe.training.trainer import DistEnv, train
from tests.conftest import tiny_run_dict
from tests.helpers.distributed import run_distributed
from tests.helpers.other_tokenizer import copy_with_other_tokenizer

pytestmark = pytest.mark.multiprocess


def _killed_in_save_worker(rank, world, cfg_dict):
    import deepspeed

    original = deepspeed.DeepSpeedEngine.save_checkpoint

    def save_then_die(self, save_dir, tag=None, **kw):
        original(self, save_dir, tag=tag, **kw)
        if tag == "step_0000004" and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    deepspeed.DeepSpeedEngine.save_checkpoint = save_then_die
    train(from_dict(RunConfig, copy.deepcopy(cfg_dict)), DistEnv(rank, world, rank, world))


def run_dict(tiny_data, out_dir, name, **train_kw):
    d = tiny_run_dict(tiny_data, out_dir, **train_kw)
    d["name"] = name
    d["logging"] = {"log_every": 1, "tensorboard": False}
    return d


@pytest.fixture(scope="module")
def killed_run(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt")
    cfg = run_dict(tiny_data, out / "runs", "killed", max_steps=4)
    with pytest.raises((mp.ProcessExitedException, mp.ProcessRaisedException)):  # rank 1 SIGKILLed
        run_distributed(_killed_in_save_worker, 2, cfg)
    return out / "runs" / "killed", cfg


def test_interrupted_save_leaves_the_previous_checkpoint_latest(killed_run):
    run_dir, _ = killed_run
    ckpt_dir = run_dir / "checkpoints"
    partial = ckpt_dir / "step_0000004"
    assert (partial / "experts" / "layer_1_expert_3_mp_rank_00_model_states.pt").exists()
    assert not (partial / MARKER).exists()
    assert find_latest(ckpt_dir) == "step_0000002"
    assert complete_tags(ckpt_dir) == ["step_0000002"]
    assert (ckpt_dir / "latest").read_text() == "step_0000002"  # DeepSpeed's pointer too
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        verify_files(partial)
    marker = verify_files(ckpt_dir / "step_0000002")
    assert marker["step"] == 2 and marker["world_size"] == 2
    for rank in range(2):
        assert rng_file(rank) in marker["files"]


def test_previous_checkpoint_loads_and_evaluates(killed_run):
    from moe.evaluation.evaluate import load_model

    run_dir, _ = killed_run
    model, cfg, tag_dir = load_model(run_dir)  # a run directory: its newest complete checkpoint
    assert tag_dir.name == "step_0000002"
    logits = model(torch.randint(0, cfg.model.vocab_size, (1, 8))).logits
    assert torch.isfinite(logits).all()


def test_the_planner_sizes_a_saved_checkpoint(killed_run):
    """moe-plan's figure for a checkpoint (what a full disk is measured against before the
    first save) against the files two ranks wrote, ZeRO 2 and expert parallelism 2: their
    tensors, less the RNG states, config, tokenizer copy and file framing it leaves out."""
    from moe.evaluation.evaluate import load_model
    from moe.tools.planning import checkpoint_bytes

    run_dir, _ = killed_run
    _, cfg, tag_dir = load_model(run_dir)
    written = sum(f.stat().st_size for f in tag_dir.rglob("*") if f.is_file())
    planned = checkpoint_bytes(
        cfg.model, cfg.train.precision, cfg.parallel.zero_stage, cfg.parallel.expert_parallel_size
    )
    assert 0.95 * written < planned <= written, (planned, written)


def _copy_checkpoint(run_dir, tmp_path):
    dst = tmp_path / "step_0000002"
    shutil.copytree(run_dir / "checkpoints" / "step_0000002", dst)
    return dst


def _snapshot(path):
    return {
        p.relative_to(path).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in path.rglob("*")
    }


def test_truncated_file_is_named(killed_run, tmp_path):
    from moe.evaluation.evaluate import load_model

    ckpt = _copy_checkpoint(killed_run[0], tmp_path)
    victim = ckpt / "experts" / "layer_0_expert_2_mp_rank_00_model_states.pt"
    victim.write_bytes(victim.read_bytes()[:1000])
    with pytest.raises(
        CheckpointError,
        match=r"layer_0_expert_2_mp_rank_00_model_states\.pt: "
        r"truncated",
    ):
        load_model(ckpt)
    (ckpt / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(
        CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt: missing"
    ):
        verify_files(ckpt)


def _save_as_expert(src, dst, src_id, dst_id, ckpt):
    """Expert ``src_id``'s weights saved again as expert ``dst_id`` (keys renamed), with the
    marker's recorded size updated so that only the content is wrong."""
    state = torch.load(src, weights_only=True)
    torch.save(
        {
            k.replace(f"deepspeed_experts.{src_id}.", f"deepspeed_experts.{dst_id}."): v
            for k, v in state.items()
        },
        dst,
    )
    marker = json.loads((ckpt / MARKER).read_text())
    marker["files"][f"experts/{dst.name}"] = dst.stat().st_size
    (ckpt / MARKER).write_text(json.dumps(marker))
    return marker


def test_expert_saved_twice_or_under_the_wrong_id_is_refused(killed_run, tmp_path):
    from moe.evaluation.evaluate import load_model

    ckpt = _copy_checkpoint(killed_run[0], tmp_path)
    e0, e1 = (ckpt / "experts" / f"layer_1_expert_{i}_mp_rank_00_model_states.pt" for i in (0, 1))
    # The same file under another expert's name (same size: the size check cannot see it).
    shutil.copy(e0, e1)
    with pytest.raises(CheckpointError, match="MoE layer 1, expert 1: holds expert 0"):
        load_model(ckpt)
    # Expert 0's weights saved again as expert 1 (keys renamed): the fingerprints recorded at
    # save time say which expert the file really holds.
    marker = _save_as_expert(e0, e1, 0, 1, ckpt)
    with pytest.raises(
        CheckpointError,
        match=r"blocks\.1\.ffn\.experts\.w_in: expert 1 holds "
        r"the weights saved as expert 0",
    ):
        load_model(ckpt)
    # A checkpoint without fingerprints (older format): bitwise duplicates are refused.
    del marker["expert_fingerprints"]
    (ckpt / MARKER).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match=r"experts \[\(0, 1\)\] hold identical weights"):
        load_model(ckpt)


def test_experts_identical_when_saved_are_accepted(killed_run, tmp_path):
    """A freshly upcycled model has identical experts; its checkpoint recorded equal
    fingerprints for them, so identical weights are what the load must find."""
    from moe.evaluation.evaluate import load_model

    ckpt = _copy_checkpoint(killed_run[0], tmp_path)
    e0, e1 = (ckpt / "experts" / f"layer_1_expert_{i}_mp_rank_00_model_states.pt" for i in (0, 1))
    marker = _save_as_expert(e0, e1, 0, 1, ckpt)
    for name in ("w_in", "w_out"):
        saved = marker["expert_fingerprints"][f"blocks.1.ffn.experts.{name}"]
        assert saved[0] != saved[1]  # the run's experts differed ...
        saved[1] = saved[0]  # ... as if they had been saved identical
    (ckpt / MARKER).write_text(json.dumps(marker))
    model, _, _ = load_model(ckpt)
    w = model.blocks[1].ffn.experts.w_in
    assert torch.equal(w[0], w[1])


def test_missing_checkpoint_directory_exits_with_a_clear_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "launch.evaluate", str(tmp_path / "nowhere")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert f"{tmp_path / 'nowhere'}: no such checkpoint directory" in proc.stderr


def test_config_and_tokenizer_mismatch_are_refused_before_anything_is_written(
    killed_run, tiny_data, tmp_path
):
    run_dir, cfg_dict = killed_run
    ckpt = run_dir / "checkpoints" / "step_0000002"
    before = _snapshot(ckpt)
    bad = copy.deepcopy(cfg_dict)
    bad["model"]["moe"]["num_experts"] = 8
    bad["model"]["n_layers"] = 3
    with pytest.raises(CheckpointError) as err:
        train(from_dict(RunConfig, bad), DistEnv(0, 1, 0, 1), resume=str(ckpt))
    msg = str(err.value)
    assert "model.moe.num_experts: the checkpoint has 4, the config has 8" in msg
    assert "model.n_layers: the checkpoint has 2, the config has 3" in msg
    assert str(ckpt / "run_config.yaml") in msg

    # Same data, but a manifest naming another tokenizer.
    data_copy = copy_with_other_tokenizer(tiny_data.dir, tmp_path / "data")
    other = copy.deepcopy(cfg_dict)
    other["data"]["dir"] = str(data_copy)
    with pytest.raises(
        CheckpointError, match="tokenizer: the checkpoint was trained with tokenizer.model"
    ):
        train(from_dict(RunConfig, other), DistEnv(0, 1, 0, 1), resume=str(ckpt))
    # --resume none in a run directory that has checkpoints would overwrite them.
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        train(from_dict(RunConfig, copy.deepcopy(cfg_dict)), DistEnv(0, 1, 0, 1), resume="none")
    assert _snapshot(ckpt) == before
    assert complete_tags(run_dir / "checkpoints") == ["step_0000002"]


def test_verify_checkpoint_accepts_the_matching_config(killed_run, tiny_data):
    run_dir, cfg_dict = killed_run
    cfg = from_dict(RunConfig, copy.deepcopy(cfg_dict))
    cfg.model.vocab_size = tiny_data.tokenizer.vocab_size
    from data_pipeline.shards import read_manifest

    sha = read_manifest(tiny_data.dir).tokenizer["sha256"]
    assert verify_checkpoint(run_dir / "checkpoints" / "step_0000002", cfg, sha)["step"] == 2


def test_resume_refuses_any_function_changing_setting_by_name(killed_run):
    """Every field declared with arch() is checked, not a hand-kept list: position, norm,
    capacity and router weighting were missing from that list and resumed silently."""
    run_dir, cfg_dict = killed_run
    ckpt = run_dir / "checkpoints" / "step_0000002"
    bad = copy.deepcopy(cfg_dict)
    bad["model"].update(position="alibi", norm="layernorm")
    bad["model"]["moe"]["capacity_factor"] = 1.25
    bad["model"]["moe"]["router"] = {"renormalize": True}
    with pytest.raises(CheckpointError) as err:
        train(from_dict(RunConfig, bad), DistEnv(0, 1, 0, 1), resume=str(ckpt))
    msg = str(err.value)
    for line in (
        "model.position: the checkpoint has 'rope', the config has 'alibi'",
        "model.norm: the checkpoint has 'rmsnorm', the config has 'layernorm'",
        "model.moe.capacity_factor: the checkpoint has None, the config has 1.25",
        "model.moe.router.renormalize: the checkpoint has False, the config has True",
    ):
        assert line in msg
    assert "set model.init_from to the checkpoint in a new run" in msg


def test_resume_accepts_changed_settings_that_keep_the_function(killed_run, tiny_data):
    run_dir, cfg_dict = killed_run
    d = copy.deepcopy(cfg_dict)
    d["model"].update(init_std=0.01, attention_backend="reference", upcycle_noise_std=0.1)
    d["model"]["moe"]["router"] = {"aux_loss_coef": 0.1, "z_loss_coef": 0.001, "jitter_eps": 0.1}
    cfg = from_dict(RunConfig, d)
    cfg.model.vocab_size = tiny_data.tokenizer.vocab_size
    assert verify_checkpoint(run_dir / "checkpoints" / "step_0000002", cfg)["step"] == 2


# --- NaN/Inf guard ------------------------------------------------------------------------------


def _nan_worker(rank, world, cfg_dict, nan_steps, result_path):
    """Rank 1's loss is NaN on the given steps (micro-batch = step here)."""
    from moe.model.transformer import MoETransformer

    original = MoETransformer.forward
    calls = {"n": 0}

    def forward(self, ids, targets=None, **kwargs):
        out = original(self, ids, targets, **kwargs)
        if targets is not None and self.training:
            calls["n"] += 1
            if rank == 1 and calls["n"] in nan_steps:
                out = out._replace(loss=out.loss * float("nan"))
        return out

    MoETransformer.forward = forward
    try:
        train(from_dict(RunConfig, copy.deepcopy(cfg_dict)), DistEnv(rank, world, rank, world))
        outcome = "finished"
    except TrainingError as e:
        outcome = str(e)
    with open(f"{result_path}.{rank}", "w") as f:
        f.write(outcome)


def _steps(run_dir, rank):
    return [json.loads(line) for line in (run_dir / "logs" / f"steps_rank{rank}.jsonl").open()]


def test_nan_loss_on_one_rank_skips_the_step_everywhere_and_persistent_nan_stops(
    tiny_data, tmp_path
):
    """Rank 1's loss is NaN at step 3 (one skip), finite at 4, NaN from 5 on: with at most 2
    consecutive skips the run stops at step 6, and nothing of step 6 is saved."""
    from moe.parallel.layout import read_layout_free

    cfg = run_dict(tiny_data, tmp_path / "runs", "nan", max_steps=8, max_consecutive_skips=2)
    cfg["checkpoint"] = {"every_n_steps": 1}
    run_distributed(_nan_worker, 2, cfg, {3, 5, 6, 7, 8}, str(tmp_path / "result"))
    run_dir = tmp_path / "runs" / "nan"
    for rank in range(2):
        msg = (tmp_path / f"result.{rank}").read_text()
        assert "step 6: 2 consecutive steps had a non-finite loss or gradient norm" in msg
        assert [r["skipped"] for r in _steps(run_dir, rank)] == [
            False,
            False,
            True,
            False,
            True,
            True,
        ]
    # A skipped step changes nothing: weights, Adam moments and Adam's step count stay.
    ckpt = run_dir / "checkpoints"
    s = {step: read_layout_free(ckpt / f"step_{step:07d}") for step in (2, 3, 4, 5)}
    for before, after in ((2, 3), (4, 5)):
        for key in ("params", "exp_avg", "exp_avg_sq"):
            for name in s[before][key]:
                assert torch.equal(s[before][key][name], s[after][key][name]), (key, name)
    assert {k: set(v["step"].values()) for k, v in s.items()} == {
        2: {2.0},
        3: {2.0},
        4: {3.0},
        5: {3.0},
    }
    assert any(not torch.equal(s[3]["params"][n], s[4]["params"][n]) for n in s[3]["params"])
    # The run stopped at step 6 before saving it: the last checkpoint is the last good state.
    assert complete_tags(ckpt)[-1] == "step_0000005"


def _train_worker(rank, world, cfg_dict):
    train(from_dict(RunConfig, copy.deepcopy(cfg_dict)), DistEnv(rank, world, rank, world))


def test_a_lowered_max_steps_trains_and_saves_nothing(tiny_data, tmp_path):
    """A finished 4-step run resumed with max_steps 2: nothing trains, nothing is saved (no
    step-2 checkpoint holding step 4's weights in place of the real one), ``latest`` stays at
    step 4, and the summary gives the step the weights are at."""
    cfg = run_dict(tiny_data, tmp_path / "runs", "lowered", max_steps=4)
    cfg["parallel"] = {"world_size": 1, "expert_parallel_size": 1, "zero_stage": 2}
    run_distributed(_train_worker, 1, cfg)
    ckpt = tmp_path / "runs" / "lowered" / "checkpoints"
    before = {tag: _snapshot(ckpt / tag) for tag in complete_tags(ckpt)}
    assert list(before) == ["step_0000002", "step_0000004"]
    cfg["train"]["max_steps"] = 2
    run_distributed(_train_worker, 1, cfg)
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == list(before)
    assert {tag: _snapshot(ckpt / tag) for tag in before} == before
    assert find_latest(ckpt) == "step_0000004"
    summary = json.loads((tmp_path / "runs" / "lowered" / "train_summary.json").read_text())
    assert summary["steps"] == 4 and summary["checkpoint"].endswith("step_0000004")


def _resume_worker(rank, world, cfg_dict, ckpt, result):
    try:
        train(
            from_dict(RunConfig, copy.deepcopy(cfg_dict)), DistEnv(rank, world, rank, world), ckpt
        )
    except Exception as e:
        Path(f"{result}.{rank}").write_text(f"{type(e).__name__}: {e}")


def test_a_file_altered_at_its_recorded_size_is_a_damaged_checkpoint(killed_run, tmp_path):
    """Eight bytes of the optimizer states flipped (their size, which the marker records, kept):
    DeepSpeed's load fails inside torch.load, and the error is a damaged checkpoint naming it,
    which the supervisor does not restart, not a bare deserialization error."""
    run_dir, cfg_dict = killed_run
    ckpt = _copy_checkpoint(run_dir, tmp_path)
    for rank in range(2):  # both ranks fail alike (one alone would leave the other waiting)
        state = ckpt / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        data = bytearray(state.read_bytes())
        data[-100:-92] = bytes(b ^ 0xFF for b in data[-100:-92])
        state.write_bytes(data)
    verify_files(ckpt)  # the sizes agree
    cfg = copy.deepcopy(cfg_dict)
    cfg["name"] = "damaged"
    run_distributed(_resume_worker, 2, cfg, str(ckpt), str(tmp_path / "result"))
    got = (tmp_path / "result.1").read_text()
    assert got.startswith(
        f"DamagedCheckpointError: {ckpt}: a file of this checkpoint cannot be read"
    )


def test_a_file_holding_python_objects_is_refused_in_one_line(tmp_path):
    """torch's weights-only refusal runs to paragraphs and suggests ``weights_only=False``: the
    error says in one line that the file's objects are never unpickled; a file that is not a
    torch file at all names the first line of torch's cause."""
    from fractions import Fraction

    from moe.checkpoint.files import load_file

    foreign = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.zeros(2)}, "note": Fraction(1, 3)}, foreign)
    with pytest.raises(CheckpointError) as e:
        load_file(foreign)
    message = str(e.value)
    assert message.startswith(f"{foreign}: holds Python objects other than tensors")
    assert "(fractions.Fraction)" in message
    assert "\n" not in message and "weights_only" not in message and "\x1b" not in message
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a torch file\n" * 10)
    with pytest.raises(CheckpointError, match=r"garbage\.pt: unreadable checkpoint file") as e:
        load_file(garbage)
    assert "\n" not in str(e.value)
