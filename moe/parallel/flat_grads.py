"""``train.flat_grad_ops``: DeepSpeed's ZeRO optimizers do their per-parameter gradient
bookkeeping by group instead of parameter by parameter.

**DeepSpeed's BF16 optimizer** (bf16, ZeRO 1, fp32 gradient accumulation; DeepSpeed 0.19.8,
``runtime/bf16_optimizer.py``, ``runtime/engine.py``) keeps one flat fp32 gradient buffer per
optimizer group (``fp32_groups_gradients_flat``; every parameter's fp32 gradient is a view into
it, the alignment padding is zero) and then, every step:

- after the backward, adds each bf16 gradient into its fp32 view: a cast and an add per
  parameter, from a Python loop (``update_hp_grads``; not with ``train.immediate_grad_update``,
  whose hooks add each as it is produced);
- reduces the buffers over their data-parallel groups by copying all of them into one new flat
  tensor, all-reducing it and copying it back (``allreduce_no_retain``), also over a group of
  one rank (one GPU; the expert groups when expert parallelism equals the world size), where
  the sum changes nothing: two copies of every fp32 gradient and a temporary as large;
- takes the gradient norm as one norm per parameter, and clips with one multiply per parameter
  (``get_grads_for_norm`` hands both the per-parameter views).

Its ``step`` reads the device's values on the host several times: each group's gradient norm
(``float()``, in ``get_norm_with_moe_layers``), their validity and their combination, the
tensor it makes for the "invalid" value (a copy to the device, per group), and whether to clip
(``clip_coef < 1``): ten host synchronisations a step for moe-125m on a GPU, four for a dense
model, each stalling the host until the device has caught up.

Here, per engine, five methods are replaced (the class and other engines keep DeepSpeed's):

- ``get_grads_for_norm`` hands DeepSpeed's own norm and clipping the flat buffers: one norm and
  one multiply per group. The sum of squares is the same sum in another order (its rounding
  differs in the last bits); the zeros of the padding and of parameters without a gradient add
  nothing.
- ``update_hp_grads`` adds every bf16 gradient into its fp32 view with one multi-tensor call
  (``torch._foreach_add_``, which promotes bf16 to fp32 as the cast did): the same additions,
  bit for bit. With ``train.immediate_grad_update``, the hook that adds each gradient as it is
  produced (``accumulate_hp_grads_and_remove_lp``) adds it by one mixed-dtype add instead of a
  cast and an add: the same addition, bit for bit.
- ``step`` takes the same norms, with the same arithmetic, on the device (each group's norm as
  DeepSpeed's ``get_global_norm_of_tensors``, the expert groups' summed over their expert-
  parallel group; with MoE layers, their squares summed in fp32 and the square root taken in
  fp64, as DeepSpeed's Python float is), reads on the host only whether the norm is finite
  and whether to clip, in one transfer (one synchronisation: a non-finite norm skips the step,
  as DeepSpeed's does), and clips, where DeepSpeed would, by multiplying every buffer by
  DeepSpeed's factor ``clip / (norm + 1e-6)`` formed on the device. The rest of the step is
  DeepSpeed's. The engine's gradient norm is then a tensor on the device (DeepSpeed's is a
  Python float with MoE layers), read by the trainer in its one read of the step's figures.
- ``allreduce_no_retain``, over a group of one rank and without a change of dtype for the
  communication, only scales the buffers in place as DeepSpeed's ``allreduce_bucket`` would (by
  the averaging factors, none on one GPU): the same values, bit for bit, without the copies.

**DeepSpeed's ZeRO 1/2 optimizer** (``runtime/zero/stage_1_and_2.py``: fp32, bf16 at stage 2,
bf16 with bf16 gradient reduction) takes the gradient norm group by group
(``scaled_global_norm``): for each group, a copy of every parameter's gradient in fp64 (on
devices that have it) and its norm, then an all-reduce of the group's squared norm, and for an
expert group another all-reduce to average it over its expert-data-parallel group: two
collectives per group, also on one GPU. ``scaled_global_norm`` is replaced: every gradient's
norm by one multi-tensor call (``torch._foreach_norm``, in the same dtype, without the copies),
the groups' squared norms all-reduced together (one collective), the expert groups' averaged
together per expert-data-parallel group. The same norms, combined the same way.

The optimizer's state, its checkpoints and the steps taken are unchanged; a run may switch the
option between restarts. ``tests/moe/parallel/test_flat_grads.py`` checks both against
DeepSpeed's own paths, with expert parallelism on two ranks.
"""

from __future__ import annotations

import types

import deepspeed.comm as ds_dist
import torch
from deepspeed.moe.utils import is_moe_param_group
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.utils import (
    combine_grad_norm_groups,
    is_model_parallel_parameter,
    mask_nan_or_inf_with_val_inplace,
)
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.runtime.zero.utils import get_norm_dtype
from deepspeed.utils import groups

from moe.core.errors import MoEError


class FlatGradOpsError(MoEError):
    """``train.flat_grad_ops`` asked of an engine whose optimizer it does not fit."""


def use_flat_grad_ops(engine: DeepSpeedEngine) -> None:
    """Replace the engine's and its ZeRO optimizer's per-parameter gradient work (see the
    module's docstring). Raises :class:`FlatGradOpsError`, changing nothing, when the engine
    has no ZeRO 1/2 optimizer, or one using a feature whose gradient handling these
    replacements do not reproduce."""
    opt = engine.optimizer
    if isinstance(opt, BF16_Optimizer):
        _refuse_unsupported(
            ("fp32 gradient accumulation", opt.grad_acc_dtype != torch.float32),
            ("no model-parallel unit", opt.mpu is not None),
            ("no Muon", opt._uses_muon),
            ("no AutoEP folding", opt.autoep_folding_tp_group is not None),
            ("the 2-norm", opt.norm_type != 2),
            ("no pipeline parallelism", engine.pipeline_parallelism),
        )
        opt.get_grads_for_norm = types.MethodType(_flat_grads_for_norm, opt)
        opt.update_hp_grads = types.MethodType(_update_hp_grads_at_once, opt)
        opt.accumulate_hp_grads_and_remove_lp = types.MethodType(_add_and_free, opt)
        opt.step = types.MethodType(_step_with_one_read, opt)
        engine.allreduce_no_retain = types.MethodType(_allreduce_no_retain, engine)
    elif isinstance(opt, DeepSpeedZeroOptimizer):
        _refuse_unsupported(
            ("no optimizer offload", opt.cpu_offload),
            ("a loss scale of 1 (bf16 or fp32)", opt.loss_scale != 1.0),
            ("no pipeline parallelism", engine.pipeline_parallelism),
        )
        opt.scaled_global_norm = types.MethodType(_scaled_global_norm, opt)
    else:
        raise FlatGradOpsError(
            "train.flat_grad_ops: needs one of DeepSpeed's ZeRO optimizers "
            f"(parallel.zero_stage 1 or 2); this engine's optimizer is {type(opt).__name__}"
        )


def _refuse_unsupported(*conditions: tuple[str, bool]) -> None:
    missing = [name for name, violated in conditions if violated]
    if missing:
        raise FlatGradOpsError(
            f"train.flat_grad_ops: needs {', '.join(missing)} in DeepSpeed's ZeRO optimizer"
        )


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


@torch.no_grad()
def _add_and_free(self: BF16_Optimizer, lp_param, group_idx: int, param_idx: int) -> None:
    """``BF16_Optimizer.accumulate_hp_grads_and_remove_lp`` (``train.immediate_grad_update``'s
    hook, as the backward produces each gradient): the bf16 gradient added into its fp32 view by
    one mixed-dtype add instead of a cast and an add, then freed."""
    if lp_param.grad is None:
        return
    hp_grad = self.fp32_groups_gradients[group_idx][param_idx]
    hp_grad.view(lp_param.grad.shape).add_(lp_param.grad)
    lp_param._hp_grad = hp_grad
    self.fp32_groups_has_gradients[group_idx][param_idx] = True
    lp_param.grad = None


def _group_norm(tensors: list[torch.Tensor], device: torch.device, ep_group=None) -> torch.Tensor:
    """DeepSpeed's ``get_global_norm_of_tensors`` (2-norm, no model-parallel unit) before its
    masking of non-finite values: each tensor's fp32 norm, their squares summed, the sum
    all-reduced over an expert-parallel group of more than one rank, its square root. No
    tensors (every non-expert weight frozen): 0, where DeepSpeed's stack of nothing fails."""
    if tensors:
        squares = torch.stack([t.detach().float().norm(2.0) for t in tensors]).pow(2.0).sum()
    else:
        squares = torch.zeros((), dtype=torch.float32, device=device)
    if ep_group is not None and ds_dist.get_world_size(group=ep_group) > 1:
        ds_dist.all_reduce(squares, op=ds_dist.ReduceOp.SUM, group=ep_group)
    return squares.pow(1.0 / 2)


@torch.no_grad()
def _step_with_one_read(self: BF16_Optimizer, closure=None) -> None:
    """``BF16_Optimizer.step`` with its gradient norm and clipping on the device and one host
    read (is the norm finite?) instead of DeepSpeed's several (see the module's docstring)."""
    if closure is not None:
        raise NotImplementedError(f"{type(self).__name__} does not support closure.")
    self.overflow = False
    non_expert, expert = self.get_grads_for_norm()
    device = self.fp32_groups_gradients_flat[0].device
    norm = _group_norm(non_expert, device)
    if self.has_moe_layers:
        norms = [norm] + [
            _group_norm(tensors, device, groups._get_expert_parallel_group(name))
            for name, tensors in expert.items()
        ]
        # get_norm_with_moe_layers: the fp32 norms' squares summed in fp32, the square root of
        # that sum taken in Python (fp64).
        squares = torch.stack(norms).pow(2.0).sum()
        finite = torch.isfinite(squares)
        norm = squares.double().sqrt()
    else:
        finite = torch.isfinite(norm)
    # clip_tensors_by_global_norm's factor, formed as it is (fp32 for a tensor norm, fp64 for
    # the Python float); whether to clip is read together with whether the norm is finite.
    coef = (self.clip_grad / (norm + 1e-6)).float() if self.clip_grad > 0.0 else None
    flags = finite.int() if coef is None else finite.int() + 2 * (coef < 1).int()
    flags = flags.item()  # the step's one read: bit 0 finite, bit 1 clip
    if not flags & 1:  # a non-finite norm skips the step, as DeepSpeed's
        self.overflow = True
        self._global_grad_norm = float("inf")
        self.clear_hp_grads()
        self.clear_lp_grads()
        return
    self._global_grad_norm = norm
    if flags & 2:
        torch._foreach_mul_(self.get_grads_for_norm(for_clipping=True), coef)
    for param_partition, grad_partition in zip(
        self.fp32_groups_flat_partition, self.fp32_groups_gradient_flat_partition
    ):
        param_partition.grad = grad_partition  # fp32 accumulation: no cast (use_flat_grad_ops)
    self.optimizer.step()
    self._lazy_init_hp_params_optimizer_state()
    self.update_lp_params()
    self.clear_hp_grads()


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


@torch.no_grad()
def _scaled_global_norm(self: DeepSpeedZeroOptimizer, norm_type=2):
    """``DeepSpeedZeroOptimizer.scaled_global_norm`` (its ``get_grad_norm_direct`` for each
    group, the expert groups' averaging, ``combine_grad_norm_groups``), with one multi-tensor
    norm over every gradient and the per-group all-reduces made together."""
    assert norm_type == 2, "only L2 norm supported"
    kept = [_kept_gradients(self, i) for i in range(len(self.bit16_groups))]
    norms = iter(torch._foreach_norm([g for k in kept for g in k], 2.0, dtype=get_norm_dtype()))
    squares = []
    for grads in kept:  # as get_grad_norm_direct: the sum in the norm dtype, then float
        group = [next(norms) for _ in grads]
        squares.append(
            torch.stack(group).pow(2.0).sum().float()
            if group
            else torch.tensor(0.0, dtype=torch.float32).to(self.device)
        )
    squares_G = torch.stack(squares)
    ds_dist.all_reduce(squares_G, op=ds_dist.ReduceOp.SUM, group=self.dp_process_group)
    self._model_parallel_all_reduce(tensor=squares_G, op=ds_dist.ReduceOp.SUM)
    norms_G = squares_G.pow(1.0 / 2)
    mask_nan_or_inf_with_val_inplace(norms_G, device=self.device)
    if self.has_moe_layers:  # _average_expert_grad_norms, one all-reduce per group of ranks
        by_group: dict = {}
        for i, is_moe in enumerate(self.is_moe_param_group):
            if is_moe:
                by_group.setdefault(self.real_dp_process_group[i], []).append(i)
        for group, idx in by_group.items():
            scaled = norms_G[idx] * 1.0 / ds_dist.get_world_size(group=group)
            ds_dist.all_reduce(scaled, group=group)
            norms_G[idx] = scaled
    return combine_grad_norm_groups(list(norms_G.unbind()), norm_type=norm_type)


def _kept_gradients(self: DeepSpeedZeroOptimizer, i: int) -> list[torch.Tensor]:
    """The gradients of group ``i`` that ``get_grad_norm_direct`` counts: no alignment padding,
    no pipeline replica, and on tensor-parallel rank 0 or tensor-parallel parameters."""
    grads = (g for g in self.averaged_gradients[i] if not getattr(g, "_zero_padding", False))
    return [
        g.data.detach()
        for g, p in zip(grads, self.params_in_partition[i])
        if not getattr(p, "ds_pipe_replicated", False)
        and (is_model_parallel_parameter(p) or self.model_parallel_rank == 0)
    ]
