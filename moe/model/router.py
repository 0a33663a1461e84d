"""Top-k token router: scores, expert selection, combine weights and balancing losses.

The router is computed in fp32 (or wider) whatever the model dtype. The balancing losses are computed from
the very selection that dispatch uses (``indices_TK``), never from a second top-k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from moe.core.config_schema import arch, runtime
from moe.model.dispatcher import count_ids


@dataclass
class RouterConfig:
    top_k: int = arch(2)
    """Experts per token (1 to 8, at most the number of experts)."""
    score_func: Literal["softmax", "sigmoid"] = arch("softmax")
    """How logits become scores: softmax over experts (Switch, Mixtral) or per-expert sigmoid
    (DeepSeek-V3)."""
    order: Literal["softmax_then_topk", "topk_then_softmax"] = arch("softmax_then_topk")
    """``softmax_then_topk``: scores over all experts, the selected scores are the weights.
    ``topk_then_softmax`` (Mixtral): softmax over the selected logits only (softmax scores only)."""
    renormalize: bool = arch(False)
    """Rescale the selected weights of each token to sum to 1."""
    scaling_factor: float = arch(1.0)
    """Routed scaling factor multiplied into the combine weights (DeepSeek-V3 uses 2.5)."""
    jitter_eps: float = runtime(0.0)
    """Switch-style multiplicative jitter: the router input is scaled by U(1-eps, 1+eps) in
    training."""
    logit_noise_std: float = runtime(0.0)
    """Standard deviation of Gaussian noise added to the router logits in training."""
    aux_loss_coef: float = runtime(0.01)
    """Coefficient of the Switch/GShard load-balancing loss E * sum_e f_e * P_e."""
    aux_loss_type: Literal["batch", "sequence"] = runtime("batch")
    """Balance over the whole micro-batch, or per sequence and averaged (DeepSeek-V3)."""
    aux_loss_scope: Literal["micro_batch", "global_batch"] = runtime("micro_batch")
    """Where the token fractions f_e of the aux loss are counted. ``micro_batch``: in the
    micro-batch itself. ``global_batch``: in the whole global batch of the optimizer step (all
    micro-batches of gradient accumulation on all data-parallel ranks), counted before the step
    by a no-gradient forward pass of every micro-batch (the trainer's routing pre-pass, about a
    third more compute), so that each micro-batch's loss is ``E * sum_e f_e(global) * P_e(micro)``.
    f has no gradient and P is a mean over tokens, so the mean of these losses over micro-batches
    and ranks is exactly the loss of the global batch taken as one micro-batch: its value and
    gradient do not depend on how the batch is split. Needs ``aux_loss_type: batch``. A training
    forward without a pre-pass (outside the trainer) counts its own micro-batch."""
    z_loss_coef: float = runtime(0.0)
    """Coefficient of the ST-MoE router z-loss mean(logsumexp(logits)^2)."""
    init_std: float = runtime(0.02)
    """Standard deviation of the router weight's normal initialization (small: near-uniform
    routing at the start)."""
    bias_update_rate: float = arch(0.0)
    """DeepSeek-V3 auxiliary-loss-free balancing: if > 0, a per-expert bias is added to the scores
    for selection only and moved by ``rate * sign(mean_load - load)`` after each step."""

    def problems(self, num_experts: int | None = None) -> list[str]:
        out = []
        if not 1 <= self.top_k <= 8:
            out.append(f"top_k: {self.top_k} must be between 1 and 8")
        if num_experts is not None and self.top_k > num_experts:
            out.append(f"top_k: {self.top_k} must be at most the number of experts ({num_experts})")
        if self.order == "topk_then_softmax" and self.score_func != "softmax":
            out.append("order: 'topk_then_softmax' needs score_func 'softmax'")
        if self.init_std <= 0:
            out.append(f"init_std: must be > 0, got {self.init_std}")
        for name in (
            "jitter_eps",
            "logit_noise_std",
            "aux_loss_coef",
            "z_loss_coef",
            "bias_update_rate",
        ):
            if getattr(self, name) < 0:
                out.append(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.aux_loss_scope == "global_batch" and self.aux_loss_type != "batch":
            out.append(
                "aux_loss_scope: 'global_batch' needs aux_loss_type 'batch' (per-sequence "
                "balancing has no global-batch form)"
            )
        if self.jitter_eps >= 1:
            out.append(f"jitter_eps: must be < 1, got {self.jitter_eps}")
        if self.scaling_factor <= 0:
            out.append(f"scaling_factor: must be > 0, got {self.scaling_factor}")
        return out


@dataclass
class Routing:
    """One routing decision for T tokens."""

    indices_TK: torch.Tensor  # int64 expert ids, the selection dispatch uses
    weights_TK: torch.Tensor  # fp32 combine weights
    scores_TE: torch.Tensor  # fp32 scores over all experts (before any bias)
    aux_loss: torch.Tensor  # scalar, unscaled Switch/GShard loss
    z_loss: torch.Tensor  # scalar, unscaled router z-loss
    entropy: torch.Tensor  # scalar, mean over tokens of the routing distribution's entropy


class TopKRouter(nn.Module):
    def __init__(self, d_model: int, num_experts: int, cfg: RouterConfig):
        super().__init__()
        self.cfg = cfg
        self.num_experts = num_experts
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        # Selection-only bias for auxiliary-loss-free balancing; a buffer, never trained by SGD.
        self.register_buffer("score_bias", torch.zeros(num_experts))
        nn.init.normal_(self.weight, std=cfg.init_std)

    def _apply(self, fn, recurse=True):
        # Every cast (model.bfloat16(), .to(dtype)) passes here: the bias stays fp32, since
        # bf16 (8-bit mantissa) would round away updates smaller than 2^-8 of its size.
        super()._apply(fn, recurse)
        self.score_bias = at_least_fp32(self.score_bias)
        return self

    def forward(
        self,
        x_TD: torch.Tensor,
        seq_len: int | None = None,
        batch_counts_E: torch.Tensor | None = None,
    ) -> Routing:
        """``batch_counts_E``: routed copies per expert over a larger batch this micro-batch
        belongs to; when given (and not all zero), the aux loss takes its f_e from them."""
        cfg = self.cfg
        # At least fp32 whatever the model dtype (bf16 logits make top-k selection unstable).
        x_TD = at_least_fp32(x_TD)
        if self.training and cfg.jitter_eps > 0:
            x_TD = x_TD * torch.empty_like(x_TD).uniform_(1 - cfg.jitter_eps, 1 + cfg.jitter_eps)
        logits_TE = self.logits(x_TD)
        if self.training and cfg.logit_noise_std > 0:
            logits_TE = logits_TE + torch.randn_like(logits_TE) * cfg.logit_noise_std

        if cfg.score_func == "softmax":
            scores_TE = logits_TE.softmax(dim=-1)
        else:
            scores_TE = logits_TE.sigmoid()

        select_TE = scores_TE
        if cfg.bias_update_rate > 0:
            select_TE = scores_TE + self.score_bias.to(scores_TE.dtype)
        indices_TK = select_TE.topk(cfg.top_k, dim=-1, sorted=False).indices

        if cfg.order == "topk_then_softmax":
            weights_TK = logits_TE.gather(-1, indices_TK).softmax(dim=-1)
        else:
            weights_TK = scores_TE.gather(-1, indices_TK)
        if cfg.renormalize:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        if cfg.scaling_factor != 1.0:
            weights_TK = weights_TK * cfg.scaling_factor

        probs_TE = (
            scores_TE
            if cfg.score_func == "softmax"
            else (scores_TE / scores_TE.sum(dim=-1, keepdim=True).clamp_min(1e-20))
        )
        return Routing(
            indices_TK=indices_TK,
            weights_TK=weights_TK,
            scores_TE=scores_TE,
            aux_loss=load_balancing_loss(
                probs_TE,
                indices_TK,
                self.num_experts,
                seq_len if cfg.aux_loss_type == "sequence" else None,
                batch_counts_E,
            ),
            z_loss=torch.logsumexp(logits_TE, dim=-1).pow(2).mean(),
            entropy=-(probs_TE * probs_TE.clamp_min(1e-20).log()).sum(-1).mean().detach(),
        )

    def logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        """(T, E) router logits of at-least-fp32 inputs (adapters add to them)."""
        return F.linear(x_TD, self.weight.to(x_TD.dtype))

    @torch.no_grad()
    def update_bias(self, load_E: torch.Tensor) -> None:
        """Auxiliary-loss-free step: raise the bias of under-loaded experts, lower over-loaded."""
        if self.cfg.bias_update_rate > 0:
            load_E = load_E.float()
            self.score_bias += self.cfg.bias_update_rate * torch.sign(load_E.mean() - load_E)


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def load_balancing_loss(
    probs_TE: torch.Tensor,
    indices_TK: torch.Tensor,
    num_experts: int,
    seq_len: int | None = None,
    batch_counts_E: torch.Tensor | None = None,
) -> torch.Tensor:
    """Switch/GShard loss ``E * sum_e f_e * P_e``.

    ``f_e`` is the fraction of the T*K routed copies sent to expert e (from the actual
    selection, so it has no gradient) and ``P_e`` the mean router probability of e. With
    ``seq_len`` the loss is computed per sequence and averaged (sequence-level balancing).
    With ``batch_counts_E`` (routed copies per expert over the global batch), f_e is their
    fraction instead, unless they are all zero (nothing was counted). Perfect balance gives 1.0
    for any E and K.
    """
    T, K = indices_TK.shape
    if batch_counts_E is not None:
        local_E = count_ids(indices_TK.flatten(), num_experts).to(probs_TE.dtype)
        total = batch_counts_E.sum()
        # torch.where, not an if: no host read of the counts inside the forward.
        f_E = torch.where(
            total > 0, batch_counts_E.to(probs_TE.dtype) / total.clamp_min(1), local_E / (T * K)
        )
        return num_experts * (f_E * probs_TE.mean(dim=0)).sum()
    groups = 1 if seq_len is None else T // seq_len
    counts_GE = torch.zeros(groups, num_experts, device=probs_TE.device, dtype=probs_TE.dtype)
    counts_GE.scatter_add_(
        1,
        indices_TK.reshape(groups, -1),
        torch.ones(groups, (T // groups) * K, device=probs_TE.device, dtype=probs_TE.dtype),
    )
    f_GE = counts_GE / ((T // groups) * K)
    p_GE = probs_TE.reshape(groups, T // groups, num_experts).mean(dim=1)
    return num_experts * (f_GE * p_GE).sum(dim=-1).mean()


def capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Token copies one expert accepts: ceil(capacity_factor * T * K / E)."""
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))
