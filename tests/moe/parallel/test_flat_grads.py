"""``train.flat_grad_ops`` (moe/parallel/flat_grads.py) against DeepSpeed's own optimizer
paths, through the trainer's engine (``build_engine``; bf16 at ZeRO 1, DeepSpeed's BF16
optimizer, unless said) on 2 gloo ranks with expert parallelism 2 and 2 micro-batches per step,
so that the non-expert gradients are reduced over a group of two ranks and the expert gradients
over groups of one.

- Without clipping (``train.grad_clip`` 0) the norm is only reported: the losses are bitwise
  those of DeepSpeed's path (the bf16 gradients added into fp32 and the reductions are the same
  operations), with and without ``train.immediate_grad_update``, and the norms agree to float
  rounding (the same squares, summed in another order).
- With clipping active, the losses and norms agree to a relative 1e-5 over three steps.
- The norm is taken once per optimizer group, not once per parameter; the expert gradients are
  not copied through a flat all-reduce buffer over their one-rank groups, the non-expert ones
  still are; over a one-rank group the scaling equals DeepSpeed's, bit for bit.
- A checkpoint saved without the option resumes with it exactly as without.
- Each bf16 gradient is added into fp32 without a cast of its own, after the backward or, with
  ``train.immediate_grad_update``, as it is produced.
- DeepSpeed's ZeRO 1/2 optimizer (bf16 at stage 2, fp32 at stage 1), with clipping active: the
  same norms and losses, bit for bit; one multi-tensor norm, and two all-reduces of the norms a
  step instead of one per group and one per expert group.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from tests.helpers.engine_configs import resumed_losses, tiny_engine_dict, two_rank_results

pytestmark = pytest.mark.multiprocess

VOCAB, SEQ, MB, ACCUM, STEPS, CLIP = 64, 16, 2, 2, 3, 0.05

VARIANTS = {  # name: train options
    "deepspeed": {"grad_clip": 0.0},
    "flat": {"grad_clip": 0.0, "flat_grad_ops": True},
    "deepspeed-immediate": {"grad_clip": 0.0, "immediate_grad_update": True},
    "flat-immediate": {"grad_clip": 0.0, "immediate_grad_update": True, "flat_grad_ops": True},
    "deepspeed-clipped": {"grad_clip": CLIP},
    "flat-clipped": {"grad_clip": CLIP, "flat_grad_ops": True},
    "flat-clip-not-reached": {"grad_clip": 100.0, "flat_grad_ops": True},
    # no MoE layer: DeepSpeed's BF16 step keeps its norm a tensor
    "dense-deepspeed-clipped": {"grad_clip": CLIP, "dense": True},
    "dense-flat-clipped": {"grad_clip": CLIP, "dense": True, "flat_grad_ops": True},
    # DeepSpeed's ZeRO 1/2 optimizer: bf16 at stage 2, fp32 at stage 1.
    "zero2-deepspeed": {"grad_clip": CLIP, "zero_stage": 2},
    "zero2-flat": {"grad_clip": CLIP, "zero_stage": 2, "flat_grad_ops": True},
    "zero1-fp32-deepspeed": {"grad_clip": CLIP, "zero_stage": 1, "precision": "fp32"},
    "zero1-fp32-flat": {
        "grad_clip": CLIP,
        "zero_stage": 1,
        "precision": "fp32",
        "flat_grad_ops": True,
    },
}


def run_config(zero_stage: int = 1, dense: bool = False, **train) -> dict:
    base = {"micro_batch_size": MB, "grad_accum_steps": ACCUM, "seed": 5, "lr": 1e-2}
    base.update({"warmup_steps": 0, "precision": "bf16", **train})
    d = tiny_engine_dict(
        VOCAB,
        SEQ,
        {"num_shared_experts": 1},
        base,
        world_size=2,
        expert_parallel_size=1 if dense else 2,
        zero_stage=zero_stage,
    )
    if dense:
        d["model"]["ffn"] = "dense"
    return d


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _train(engine, batches) -> dict:
    """Steps over ``batches`` (ACCUM micro-batches each): per step the mean loss and the
    gradient norm; the norms taken in the optimizer steps, and the sizes of the groups whose
    gradients went through a flat all-reduce buffer."""
    import deepspeed.comm as ds_dist

    flattened = []
    bucket = engine.allreduce_bucket

    def counted(small_bucket, dp_group, dp_world_size=None):
        flattened.append(ds_dist.get_world_size(group=dp_group))
        return bucket(small_bucket, dp_group, dp_world_size)

    engine.allreduce_bucket = counted
    out = {"losses": [], "norms": [], "step_ops": {}, "to_copy_in_backward": 0, "adamw_reads": 0}
    adamw = engine.optimizer.optimizer  # torch's AdamW, whose own reads are not DeepSpeed's
    adamw_step = adamw.step

    def counted_step(*args, **kwargs):
        inner = _Ops()
        with inner:
            result = adamw_step(*args, **kwargs)
        out["adamw_reads"] += inner.counts.get("_local_scalar_dense", 0)
        return result

    adamw.step = counted_step
    for step in batches:
        losses = []
        for batch in step:
            loss = engine(batch[:, :-1], batch[:, 1:]).loss
            backward = _Ops()
            with backward:
                engine.backward(loss)
            out["to_copy_in_backward"] += backward.counts.get("_to_copy", 0)
            ops = _Ops()
            with ops:
                engine.step()  # DeepSpeed steps the optimizer at the accumulation boundary only
            for name, n in ops.counts.items():
                out["step_ops"][name] = out["step_ops"].get(name, 0) + n
            losses.append(loss.item())
        out["losses"].append(sum(losses) / len(losses))
        out["norms"].append(float(engine.get_global_grad_norm()))
    out["flattened"] = sorted(set(flattened))
    opt = engine.optimizer
    groups = opt.bf16_groups if hasattr(opt, "bf16_groups") else opt.bit16_groups
    out["groups"], out["params"] = len(groups), sum(len(g) for g in groups)
    out["expert_groups"] = sum(getattr(opt, "is_moe_param_group", []))  # ZeRO's
    return out


def _one_rank_scaling(engine) -> bool:
    """Over the (one-rank) expert group with an averaging factor of 3: the replaced
    ``allreduce_no_retain`` leaves what DeepSpeed's leaves, bit for bit."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.utils import groups

    name = next(iter(engine.optimizer.expert_gradients))
    group = groups._get_expert_data_parallel_group(name)
    torch.manual_seed(1)
    ours = [torch.randn(7), torch.randn(5, 3)]
    theirs = [t.clone() for t in ours]
    engine.allreduce_no_retain(ours, group, dp_world_size=3)
    DeepSpeedEngine.allreduce_no_retain(engine, theirs, group, dp_world_size=3)
    return all(torch.equal(a, b) for a, b in zip(ours, theirs)) and not torch.equal(
        ours[0], theirs[0] * 3
    )


def _overflowing_step(engine, step) -> dict:
    """An optimizer step whose fp32 gradients hold an infinity on every rank (put there after
    the backward): what it leaves."""
    opt = engine.optimizer
    weights = [p.detach().clone() for g in opt.bf16_groups for p in g]
    real, ops = opt.step, _Ops()

    def poisoned(*args, **kwargs):
        opt.fp32_groups_gradients_flat[0][0] = float("inf")
        with ops:
            return real(*args, **kwargs)

    opt.step = poisoned
    for batch in step:
        engine.backward(engine(batch[:, :-1], batch[:, 1:]).loss)
        engine.step()
    return {
        "overflow": opt.overflow,
        "norm": float(opt._global_grad_norm),
        "weights_kept": all(
            torch.equal(a, p) for a, p in zip(weights, (p for g in opt.bf16_groups for p in g))
        ),
        "grads_cleared": all(not f.any() for f in opt.fp32_groups_gradients_flat),
        "reads": ops.counts.get("_local_scalar_dense", 0),
    }


def _worker(rank, world, batches, ckpt_dir):
    from moe.parallel import flat_grads
    from moe.parallel.flat_grads import FlatGradOpsError, use_flat_grad_ops
    from moe.training.trainer import DistEnv, build_engine

    env = DistEnv(rank, world, rank, world)
    my = [[b[rank::world] for b in step] for step in batches]  # each rank's share

    def engine_for(**train):
        return build_engine(from_dict(RunConfig, copy.deepcopy(run_config(**train))), env)[0]

    results = {name: _train(engine_for(**train), my) for name, train in VARIANTS.items()}
    flat = engine_for(**VARIANTS["flat"])
    results["one_rank_scaling"] = _one_rank_scaling(flat)
    resuming = engine_for(**VARIANTS["flat"])
    results["resumed"] = resumed_losses(
        engine_for(**VARIANTS["deepspeed"]), resuming, my, ckpt_dir, _train
    )
    results["flat_after_load"] = [  # loading a checkpoint keeps the replaced methods
        getattr(obj, name).__func__ is ours
        for obj, name, ours in (
            (resuming.optimizer, "get_grads_for_norm", flat_grads._flat_grads_for_norm),
            (resuming.optimizer, "update_hp_grads", flat_grads._update_hp_grads_at_once),
            (resuming.optimizer, "accumulate_hp_grads_and_remove_lp", flat_grads._add_and_free),
            (resuming.optimizer, "step", flat_grads._step_with_one_read),
            (resuming, "allreduce_no_retain", flat_grads._allreduce_no_retain),
        )
    ]
    results["overflow"] = {
        name: _overflowing_step(engine_for(**VARIANTS[name]), my[0])
        for name in (
            "deepspeed-clipped",
            "flat-clipped",
            "dense-deepspeed-clipped",
            "dense-flat-clipped",
        )
    }
    stage0 = engine_for(precision="fp32", zero_stage=0)
    try:
        use_flat_grad_ops(stage0)
        results["stage0_refused"] = ""
    except FlatGradOpsError as e:
        results["stage0_refused"] = str(e)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flat_grads")
    return two_rank_results(_worker, tmp, VOCAB, 2 * MB, SEQ, ACCUM, STEPS)


@pytest.mark.parametrize("immediate", ["", "-immediate"])
def test_without_clipping_the_losses_are_deepspeeds_bitwise(results, immediate):
    ds, flat = results[f"deepspeed{immediate}"], results[f"flat{immediate}"]
    assert torch.equal(torch.tensor(flat["losses"]), torch.tensor(ds["losses"]))
    torch.testing.assert_close(
        torch.tensor(flat["norms"]), torch.tensor(ds["norms"]), rtol=1e-5, atol=0
    )
    assert ds["losses"][-1] < ds["losses"][0]  # it trains


def test_gradients_are_added_without_a_cast_each(results):
    """A cast per parameter and micro-batch fewer in the backward with
    train.immediate_grad_update (its hooks add each gradient), and in the epilogue that adds them
    after the backward without it."""
    for immediate in ("", "-immediate"):
        ds, flat = results[f"deepspeed{immediate}"], results[f"flat{immediate}"]
        fewer = ds["to_copy_in_backward"] - flat["to_copy_in_backward"]
        assert fewer == STEPS * ACCUM * ds["params"], (immediate, fewer)


def test_with_clipping_the_losses_and_norms_agree(results):
    ds, flat = results["deepspeed-clipped"], results["flat-clipped"]
    assert min(ds["norms"]) > 2 * CLIP  # every step was clipped
    assert ds["losses"] != results["deepspeed"]["losses"]  # and clipping changed the steps
    for key in ("losses", "norms"):
        torch.testing.assert_close(
            torch.tensor(flat[key]), torch.tensor(ds[key]), rtol=1e-5, atol=0
        )


@pytest.mark.parametrize("variant", ["zero2", "zero1-fp32"])
def test_zero_optimizer_norms_and_losses_are_deepspeeds_bitwise(results, variant):
    """DeepSpeed's ZeRO 1/2 optimizer: the same norms, so the same clipped steps, bit for bit;
    one multi-tensor norm a step instead of one per gradient, and the per-group all-reduces of
    the norms made together (one for every group, one for the expert groups' averaging)."""
    ds, flat = results[f"{variant}-deepspeed"], results[f"{variant}-flat"]
    assert min(ds["norms"]) > 2 * CLIP  # every step was clipped
    for key in ("losses", "norms"):
        assert torch.equal(torch.tensor(flat[key]), torch.tensor(ds[key])), key
    assert flat["step_ops"]["_foreach_norm"] == STEPS and "_foreach_norm" not in ds["step_ops"]
    assert flat["step_ops"]["linalg_vector_norm"] == STEPS  # combining the groups' norms
    assert ds["step_ops"]["linalg_vector_norm"] > 2 * STEPS
    collectives = ds["groups"] + ds["expert_groups"]  # one per group, one per expert group
    assert ds["expert_groups"] > 0
    assert ds["step_ops"]["allreduce_"] - flat["step_ops"]["allreduce_"] == STEPS * (
        collectives - 2
    )


def test_the_dense_step_with_clipping_agrees(results):
    ds, flat = results["dense-deepspeed-clipped"], results["dense-flat-clipped"]
    assert min(ds["norms"]) > 2 * CLIP and ds["expert_groups"] == 0
    for key in ("losses", "norms"):
        torch.testing.assert_close(
            torch.tensor(flat[key]), torch.tensor(ds[key]), rtol=1e-5, atol=0
        )


@pytest.mark.parametrize("model, clip", [("", ""), ("", "-clipped"), ("dense-", "-clipped")])
def test_the_bf16_step_reads_one_value_on_the_host(results, model, clip):
    """DeepSpeed's BF16 step reads values of the device on the host (a synchronisation each on
    a GPU): with MoE layers each group's norm (here 2), their validity and their combination;
    without, the norm's validity and, clipping, whether to clip. Replaced: only whether the norm
    is finite, once per optimizer step. (torch's AdamW reads its step counts, kept on the host
    on a GPU too; they are left out.)"""
    ds, flat = results[f"{model}deepspeed{clip}"], results[f"{model}flat{clip}"]

    def reads(r):
        return r["step_ops"]["_local_scalar_dense"] - r["adamw_reads"]

    assert reads(flat) == STEPS
    assert reads(ds) == STEPS * (2 if model else 4), ds["step_ops"]


def test_gradients_are_multiplied_only_where_deepspeed_clips(results):
    """Whether to clip is read with the finiteness, so a norm below the limit costs no pass
    over the gradients: the same steps, bit for bit, as without clipping."""
    flat, loose = results["flat"], results["flat-clip-not-reached"]
    clipped = results["flat-clipped"]
    assert max(loose["norms"]) < 100.0
    assert torch.equal(torch.tensor(loose["losses"]), torch.tensor(flat["losses"]))
    muls = {
        k: r["step_ops"].get("_foreach_mul_", 0)
        for k, r in (("flat", flat), ("loose", loose), ("clipped", clipped))
    }
    assert muls["loose"] == muls["flat"] and muls["clipped"] == muls["flat"] + STEPS, muls


def test_a_non_finite_norm_skips_the_step_as_deepspeeds_does(results):
    for model in ("", "dense-"):
        ds = results["overflow"][f"{model}deepspeed-clipped"]
        flat = results["overflow"][f"{model}flat-clipped"]
        assert ds["overflow"] and ds["weights_kept"] and ds["grads_cleared"], ds
        assert {k: v for k, v in flat.items() if k != "reads"} == {
            k: v for k, v in ds.items() if k != "reads"
        }
        assert flat["norm"] == float("inf") and flat["reads"] == 1


def test_one_norm_per_group_not_per_parameter(results):
    ds, flat = results["deepspeed-clipped"], results["flat-clipped"]
    assert flat["groups"] < flat["params"]
    assert flat["step_ops"]["linalg_vector_norm"] == STEPS * flat["groups"]
    assert ds["step_ops"]["linalg_vector_norm"] == STEPS * ds["params"]


def test_only_groups_of_several_ranks_go_through_a_flat_buffer(results):
    assert results["deepspeed"]["flattened"] == [1, 2]  # the expert groups have one rank each
    assert results["flat"]["flattened"] == [2]
    assert results["one_rank_scaling"]


def test_a_checkpoint_saved_without_it_resumes_with_it(results):
    assert results["flat_after_load"] == [True] * 5
    assert torch.equal(
        torch.tensor(results["resumed"]), torch.tensor(results["deepspeed"]["losses"][2:])
    )


def test_an_engine_without_a_zero_optimizer_is_refused(results):
    assert "needs one of DeepSpeed's ZeRO optimizers" in results["stage0_refused"]


def test_a_group_norm_is_deepspeeds_and_zero_without_gradients():
    """Each group's norm as DeepSpeed's get_global_norm_of_tensors takes it, bit for bit; a
    group with nothing to count (every non-expert weight frozen) has norm 0 (DeepSpeed's own
    fails on stacking nothing)."""
    from deepspeed.runtime.utils import get_global_norm_of_tensors

    from moe.parallel.flat_grads import _group_norm

    torch.manual_seed(0)
    tensors = [torch.randn(1000) * 3, torch.randn(7, 5), torch.randn(3).bfloat16()]
    assert torch.equal(
        _group_norm(tensors, torch.device("cpu")), get_global_norm_of_tensors(tensors)
    )
    zero = _group_norm([], torch.device("cpu"))
    assert zero.dtype == torch.float32 and zero.item() == 0.0
