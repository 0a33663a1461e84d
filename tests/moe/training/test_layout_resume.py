"""Resuming on another parallel layout: a checkpoint saved with expert parallelism 2 on 2 ranks
continues on 1 rank, and a 1-rank checkpoint continues on 2 ranks with expert parallelism 2. The
steps after resuming must match continuing on the original layout (same global batch: 2 ranks x 1
micro-batch or 1 rank x 2 micro-batches read the same samples), which needs the weights, both Adam
moments of expert and non-expert parameters, the LR schedule and the router's score_bias."""

import copy
import json
import shutil

import pytest
import torch

from moe.config_schema import from_dict
from moe.training.checkpoint import MAIN_STATES, load_file
from moe.training.config import RunConfig
from moe.training.layout import read_layout_free
from moe.training.trainer import DistEnv, train
from tests.conftest import tiny_run_dict
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.multiprocess


def _train_worker(rank, world, cfg_dict, resume):
    cfg = from_dict(RunConfig, copy.deepcopy(cfg_dict))
    train(cfg, DistEnv(rank, world, rank, world), resume=resume)


def layout_dict(tiny_data, out_dir, name, world, max_steps):
    d = tiny_run_dict(tiny_data, out_dir, max_steps=max_steps, grad_accum_steps=2 // world,
                      warmup_steps=1, lr=3e-3)
    d["name"] = name
    d["parallel"] = {"world_size": world, "expert_parallel_size": world, "zero_stage": 2}
    d["checkpoint"] = {"every_n_steps": 3}
    d["logging"] = {"log_every": 1, "tensorboard": False}
    # Auxiliary-loss-free balancing: the router's score_bias buffer changes every step and
    # steers the expert choice, so it must be carried over too.
    d["model"]["moe"]["router"]["bias_update_rate"] = 0.01
    return d


def global_losses(run_dir, world) -> dict[int, float]:
    """The global batch's mean loss per step: the mean of the ranks' own losses."""
    per_rank = []
    for r in range(world):
        rows = [json.loads(line) for line in (run_dir / "logs" / f"steps_rank{r}.jsonl").open()]
        per_rank.append({row["step"]: row["loss"] for row in rows})
    return {s: sum(p[s] for p in per_rank) / world for s in per_rank[0]}


@pytest.mark.parametrize("saved_world,resumed_world", [(2, 1), (1, 2)], ids=["ep2-to-ep1", "ep1-to-ep2"])
def test_resume_on_another_layout_matches_the_original_layout(tiny_data, tmp_path, saved_world,
                                                               resumed_world):
    runs = tmp_path / "runs"
    first = layout_dict(tiny_data, runs, "first", saved_world, max_steps=3)
    run_distributed(_train_worker, saved_world, first, "auto")
    ckpt = runs / "first" / "checkpoints" / "step_0000003"
    saved_bias = {k: v for k, v in load_file(ckpt / MAIN_STATES)["module"].items()
                  if k.endswith("score_bias")}
    assert any(v.abs().sum() > 0 for v in saved_bias.values())  # the check has teeth
    check_layout_free_state(ckpt, tmp_path)

    # Continue on the saving layout: copy the run directory, train to step 5.
    shutil.copytree(runs / "first", runs / "same")
    same = layout_dict(tiny_data, runs, "same", saved_world, max_steps=5)
    run_distributed(_train_worker, saved_world, same, "auto")

    other = layout_dict(tiny_data, runs, "other", resumed_world, max_steps=5)
    run_distributed(_train_worker, resumed_world, other, str(ckpt))

    expected = global_losses(runs / "same", saved_world)
    got = global_losses(runs / "other", resumed_world)
    assert sorted(got) == [4, 5]
    for step in (4, 5):
        assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-5), step

    # The resumed run's own checkpoint (new layout) holds the same state as the original's.
    a = read_layout_free(runs / "same" / "checkpoints" / "step_0000005")
    b = read_layout_free(runs / "other" / "checkpoints" / "step_0000005")
    assert a["params"].keys() == b["params"].keys()
    for key in ("params", "exp_avg", "exp_avg_sq"):
        for name in a[key]:
            torch.testing.assert_close(b[key][name], a[key][name], rtol=1e-4, atol=1e-6,
                                       msg=f"{key} of {name}")
    assert a["step"] == b["step"]
    bias_a = load_file(runs / "same" / "checkpoints" / "step_0000005" / MAIN_STATES)["module"]
    bias_b = load_file(runs / "other" / "checkpoints" / "step_0000005" / MAIN_STATES)["module"]
    for name in saved_bias:
        torch.testing.assert_close(bias_b[name], bias_a[name], rtol=0, atol=1e-6)


def check_layout_free_state(tag_dir, tmp_path):
    """The fp32 master weights rebuilt from the ZeRO partitions equal the module weights that
    DeepSpeed saved (non-expert file and per-expert files), and the moments are non-zero. On a
    1-rank checkpoint, DeepSpeed's own zero_to_fp32 agrees too. (Its file glob also picks up the
    per-expert files, which it cannot parse, so it reads a view without them; with expert
    parallelism > 1 it would merge different ranks' experts as data-parallel partitions, which is
    why layout conversion and export use read_layout_free.)"""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from moe.evaluation import load_model
    from moe.training.layout import single_device_name

    state = read_layout_free(tag_dir)
    model, _, _ = load_model(tag_dir)
    params = dict(model.named_parameters())
    assert state["params"].keys() == params.keys()
    for name, p in params.items():
        torch.testing.assert_close(state["params"][name], p.detach(), rtol=0, atol=0, msg=name)
        assert state["exp_avg_sq"][name].abs().sum() > 0, name
    assert set(state["step"].values()) == {3.0}
    marker = json.loads((tag_dir / "checkpoint.json").read_text())
    if marker["world_size"] == 1:
        view = tmp_path / "zero_view" / tag_dir.name
        view.mkdir(parents=True)
        for f in tag_dir.iterdir():
            if f.name.startswith(("mp_rank_", "zero_pp_rank_")):
                (view / f.name).symlink_to(f)
        theirs = get_fp32_state_dict_from_zero_checkpoint(str(view.parent), tag_dir.name)
        theirs = {single_device_name(k): v for k, v in theirs.items()}
        for name, p in params.items():
            torch.testing.assert_close(theirs[name], p.detach(), rtol=0, atol=0, msg=name)
