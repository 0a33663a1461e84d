"""DeepSpeed's own ``zero_to_fp32`` on our checkpoints: the script DeepSpeed copies next to the
checkpoints, run as a user runs it, must rebuild exactly the weights our checkpoint holds (the
single-device model that ``moe-export`` / ``load_model`` builds from it), or refuse; it must
never write a state dict that silently mixes up experts.

Layouts: expert parallelism 2 on 2 ranks (the default demo's layout), expert parallelism 1 on
2 ranks, and 1 rank. With expert parallelism 2 on 4 ranks each expert's optimizer state is
itself split over 2 ranks, in an order ``zero_to_fp32``'s rank-order concatenation cannot undo:
there it must fail, and ``moe-export --format fp32`` is the way."""

import copy
import subprocess
import sys

import pytest
import torch

from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.parallel.layout import single_device_name
from moe.training.trainer import DistEnv, train
from tests.conftest import tiny_run_dict
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.multiprocess


def _train_worker(rank, world, cfg_dict):
    train(from_dict(RunConfig, copy.deepcopy(cfg_dict)), DistEnv(rank, world, rank, world))


def _run(tiny_data, out_dir, name, world, ep):
    d = tiny_run_dict(tiny_data, out_dir, max_steps=2, grad_accum_steps=max(1, 2 // world))
    d["name"] = name
    d["parallel"] = {"world_size": world, "expert_parallel_size": ep, "zero_stage": 2}
    d["logging"] = {"log_every": 1, "tensorboard": False}
    run_distributed(_train_worker, world, d)
    return out_dir / name / "checkpoints"


def zero_to_fp32(ckpt_dir, out_dir) -> subprocess.CompletedProcess:
    """The script DeepSpeed saved beside the checkpoints, on the tag named in ``latest``."""
    return subprocess.run(
        [sys.executable, str(ckpt_dir / "zero_to_fp32.py"), str(ckpt_dir), str(out_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _assert_equals_our_model(ckpt_dir, out_dir):
    from moe.evaluation.evaluate import load_model

    theirs = torch.load(out_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
    theirs = {single_device_name(k): v for k, v in theirs.items()}
    model, _, _ = load_model(ckpt_dir)
    ours = model.state_dict()
    assert theirs.keys() == ours.keys()
    for name, value in ours.items():
        assert theirs[name].shape == value.shape, name
        torch.testing.assert_close(theirs[name], value, rtol=0, atol=0, msg=name)
    # The check has teeth: the experts differ from each other.
    w_in = ours["blocks.0.ffn.experts.w_in"]
    assert not torch.equal(w_in[0], w_in[-1])


@pytest.fixture(scope="module")
def w4ep2(tiny_data, tmp_path_factory):
    """EP 2 on 4 ranks, trained once for the two tests that need it."""
    return _run(tiny_data, tmp_path_factory.mktemp("w4ep2"), "w4ep2", 4, 2)


@pytest.mark.parametrize("world,ep", [(2, 2), (2, 1), (1, 1)])
def test_zero_to_fp32_rebuilds_the_model(tiny_data, tmp_path, world, ep):
    ckpt_dir = _run(tiny_data, tmp_path / "runs", f"w{world}ep{ep}", world, ep)
    result = zero_to_fp32(ckpt_dir, tmp_path / "fp32")
    assert result.returncode == 0, result.stdout + result.stderr
    _assert_equals_our_model(ckpt_dir, tmp_path / "fp32")


def test_zero_to_fp32_refuses_expert_partitions_it_cannot_order(w4ep2, tmp_path):
    """EP 2 on 4 ranks: the experts' ZeRO partitions are split over expert-data-parallel pairs;
    zero_to_fp32 stops with an error and writes nothing, and our export still works."""
    from moe.tools.export import consolidated_fp32

    ckpt_dir = w4ep2
    result = zero_to_fp32(ckpt_dir, tmp_path / "fp32")
    assert result.returncode != 0
    assert "numels" in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "fp32" / "pytorch_model.bin").exists()
    state, _, _ = consolidated_fp32(ckpt_dir.parent)
    assert state["blocks.0.ffn.experts.w_in"].shape[0] == 4


def test_moe_export_deepspeed_makes_any_layout_readable_by_zero_to_fp32(w4ep2, tmp_path):
    """Where zero_to_fp32 refuses (EP 2 on 4 ranks), `moe-export --format deepspeed` re-saves
    the training state on one rank; zero_to_fp32 then rebuilds exactly our model, and the
    converted checkpoint holds the same weights and Adam moments as the original."""
    from moe.parallel.layout import read_layout_free

    ckpt_dir = w4ep2
    out = tmp_path / "converted"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.export",
            str(ckpt_dir.parent),
            str(out),
            "--format",
            "deepspeed",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (out / "latest").read_text() == "step_0000002"
    original, converted = (read_layout_free(d / "step_0000002") for d in (ckpt_dir, out))
    for key in ("params", "exp_avg", "exp_avg_sq"):
        assert original[key].keys() == converted[key].keys()
        for name, value in original[key].items():
            torch.testing.assert_close(
                converted[key][name], value, rtol=0, atol=0, msg=f"{key} {name}"
            )
    z = zero_to_fp32(out, tmp_path / "fp32")
    assert z.returncode == 0, z.stdout + z.stderr
    _assert_equals_our_model(out, tmp_path / "fp32")
