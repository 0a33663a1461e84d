"""``train.flat_grad_ops``: DeepSpeed's BF16 optimizer (bf16, ZeRO 1, fp32 gradient
accumulation) does its gradient bookkeeping over each parameter group's flat fp32 gradient
buffer instead of parameter by parameter.

DeepSpeed 0.19.8 (``runtime/bf16_optimizer.py``, ``runtime/engine.py``) keeps one flat fp32
gradient buffer per optimizer group (``fp32_groups_gradients_flat``; every parameter's fp32
gradient is a view into it, the alignment padding is zero) and then, every step:

- after the backward, adds each bf16 gradient into its fp32 view: a cast and an add per
  parameter, from a Python loop (``update_hp_grads``; not with ``train.immediate_grad_update``,
  whose hooks add each as it is produced);
- reduces the buffers over their data-parallel groups by copying all of them into one new flat
  tensor, all-reducing it and copying it back (``allreduce_no_retain``), also over a group of
  one rank (one GPU; the expert groups when expert parallelism equals the world size), where
  the sum changes nothing: two copies of every fp32 gradient and a temporary as large;
- takes the gradient norm as one norm per parameter, and clips with one multiply per parameter
  (``get_grads_for_norm`` hands both the per-parameter views).

Here, per engine, three methods are replaced (the class and other engines keep DeepSpeed's):

- ``get_grads_for_norm`` hands DeepSpeed's own norm and clipping the flat buffers: one norm and
  one multiply per group. The sum of squares is the same sum in another order (its rounding
  differs in the last bits); the zeros of the padding and of parameters without a gradient add
  nothing.
- ``update_hp_grads`` adds every bf16 gradient into its fp32 view with one multi-tensor call
  (``torch._foreach_add_``, which promotes bf16 to fp32 as the cast did): the same additions,
  bit for bit.
- ``allreduce_no_retain``, over a group of one rank and without a change of dtype for the
  communication, only scales the buffers in place as DeepSpeed's ``allreduce_bucket`` would (by
  the averaging factors, none on one GPU): the same values, bit for bit, without the copies.

The optimizer's state, its checkpoints and the steps taken are unchanged; a run may switch the
option between restarts. ``tests/moe/parallel/test_flat_grads.py`` checks each against
DeepSpeed's own path, on one rank and with expert parallelism on two.
"""

from __future__ import annotations

import types

import deepspeed.comm as ds_dist
import torch
from deepspeed.moe.utils import is_moe_param_group
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.engine import DeepSpeedEngine

from moe.core.errors import MoEError


class FlatGradOpsError(MoEError):
    """``train.flat_grad_ops`` asked of an engine whose optimizer it does not fit."""


def use_flat_grad_ops(engine: DeepSpeedEngine) -> None:
    """Replace the engine's and its BF16 optimizer's per-parameter gradient work (see the
    module's docstring). Raises :class:`FlatGradOpsError`, changing nothing, when the engine's
    optimizer is not DeepSpeed's BF16 optimizer with fp32 accumulation, or uses a feature whose
    gradient handling these replacements do not reproduce."""
    opt = engine.optimizer
    if not isinstance(opt, BF16_Optimizer):
        raise FlatGradOpsError(
            "train.flat_grad_ops: needs DeepSpeed's BF16 optimizer (train.precision bf16, "
            "parallel.zero_stage 1, train.grad_reduce_dtype fp32); this engine's optimizer is "
            f"{type(opt).__name__}"
        )
    unsupported = [
        name
        for name, present in (
            ("fp32 gradient accumulation", opt.grad_acc_dtype != torch.float32),
            ("no model-parallel unit", opt.mpu is not None),
            ("no Muon", opt._uses_muon),
            ("no AutoEP folding", opt.autoep_folding_tp_group is not None),
            ("the 2-norm", opt.norm_type != 2),
            ("no pipeline parallelism", engine.pipeline_parallelism),
        )
        if present
    ]
    if unsupported:
        raise FlatGradOpsError(
            f"train.flat_grad_ops: needs {', '.join(unsupported)} in DeepSpeed's BF16 optimizer"
        )
    opt.get_grads_for_norm = types.MethodType(_flat_grads_for_norm, opt)
    opt.update_hp_grads = types.MethodType(_update_hp_grads_at_once, opt)
    engine.allreduce_no_retain = types.MethodType(_allreduce_no_retain, engine)


@torch.no_grad()
def _flat_grads_for_norm(self: BF16_Optimizer, for_clipping: bool = False):
    """What ``BF16_Optimizer.get_grads_for_norm`` returns, with each group's flat fp32 gradient
    buffer in place of its parameters' views: for clipping, every buffer; for the norm, the
    non-expert buffers and the expert buffers by expert-parallel group name."""
    if for_clipping:
        return list(self.fp32_groups_gradients_flat)
    non_expert, expert = [], {}
    for group, flat in zip(self.optimizer.param_groups, self.fp32_groups_gradients_flat):
        if self.has_moe_layers and is_moe_param_group(group):
            expert.setdefault(group["name"], []).append(flat)
        else:
            non_expert.append(flat)
    return non_expert, expert


@torch.no_grad()
def _update_hp_grads_at_once(self: BF16_Optimizer, clear_lp_grads: bool = False) -> None:
    """``BF16_Optimizer.update_hp_grads``: each bf16 gradient added into its fp32 view, by one
    multi-tensor call."""
    if self.immediate_grad_update:  # the hooks have added each already
        return
    hp, lp = [], []
    for i, group in enumerate(self.bf16_groups):
        for j, param in enumerate(group):
            if param.grad is None:
                continue
            hp_grad = self.fp32_groups_gradients[i][j]
            hp.append(hp_grad.view(param.grad.shape))
            lp.append(param.grad)
            param._hp_grad = hp_grad  # as DeepSpeed links them (safe_get_full_grad reads it)
            self.fp32_groups_has_gradients[i][j] = True
    if hp:
        torch._foreach_add_(hp, lp)
        if clear_lp_grads:
            torch._foreach_zero_(lp)


def _allreduce_no_retain(
    self: DeepSpeedEngine, bucket, dp_group, numel_per_bucket=500000000, dp_world_size=None
) -> None:
    """``DeepSpeedEngine.allreduce_no_retain``, without the copies over a group of one rank."""
    alone = ds_dist.get_world_size(group=dp_group) == 1
    if not alone or any(t.dtype != self.communication_data_type for t in bucket):
        DeepSpeedEngine.allreduce_no_retain(self, bucket, dp_group, numel_per_bucket, dp_world_size)
        return
    # allreduce_bucket's scaling around its all-reduce, which over one rank is the identity.
    if dp_world_size is None:
        dp_world_size = 1
    if not self.gradient_average:
        return
    scales = []
    if self.postscale_gradients():
        predivide = self.gradient_predivide_factor()
        if predivide != 1.0:
            scales.append(1.0 / predivide)
        if predivide != dp_world_size:
            scales.append(predivide / dp_world_size)
    else:
        scales.append(1.0 / dp_world_size)
    with torch.no_grad():
        for scale in scales:
            torch._foreach_mul_(list(bucket), scale)
