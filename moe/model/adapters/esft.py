"""Expert-specialised fine-tuning (ESFT; Wang et al., DeepSeek 2024): score every routed expert
of every MoE layer on the fine-tuning data, then train only the few experts the task uses most
and freeze everything else.

Per MoE layer, with scores s_e >= 0 (``ESFTConfig.score``; the trainer measures them,
moe/training/esft.py), :func:`select_experts` keeps the smallest set of experts whose share of
the layer's total score reaches ``p``: experts sorted by score, highest first (equal scores:
lower expert id first), taken until their cumulative share is >= p. Edge cases, by this rule:
p = 0 selects exactly one expert per layer (the top one: the set is never empty); p = 1
selects every expert up to the last one with a non-zero score (experts that scored 0 add
nothing and stay frozen); a layer whose scores are all 0 (no token seen) is an error.

Expert weights are stacked (E, ...) tensors (moe/model/experts.py), so a stack stays one
trainable parameter and :func:`mask_expert_rows` zeroes the gradient rows of its unselected
experts. Their optimizer state then stays zero and Adam moves them by exactly nothing; decoupled
weight decay would still shrink them, which the trainer rules out (moe/training/esft.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from moe.core.config_schema import fixed
from moe.model.experts import GroupedExperts


@dataclass
class ESFTConfig:
    score: Literal["gate", "token_share"] = fixed("gate")
    """How experts are scored on the fine-tuning data. gate: the expert's average gate score
    over tokens (the router's score for the expert where a token selected it, 0 where it did
    not; ESFT's "average gate score"). token_share: the expert's share of the layer's token
    selections (each token selects top_k experts)."""
    p: float = fixed(0.2)
    """Per MoE layer, train the smallest set of experts whose cumulative score share reaches p
    (0 to 1; p = 0: the single top expert of each layer)."""
    max_batches: int = fixed(8)
    """Micro-batches per rank of the run's training data (its first ones) scored before
    training, with no gradient, on the base model (model.init_from)."""

    def problems(self) -> list[str]:
        out = []
        if not 0 <= self.p <= 1:
            out.append(f"p: must be between 0 and 1, got {self.p}")
        if self.max_batches < 1:
            out.append(f"max_batches: must be >= 1, got {self.max_batches}")
        return out


def select_experts(scores_LE: torch.Tensor, p: float) -> list[list[int]]:
    """Per layer (row of ``scores_LE``), the expert ids the rule of this module's docstring
    selects, in ascending order."""
    out = []
    for layer, s_E in enumerate(scores_LE.double()):
        # Stable sort of -s: highest score first, equal scores in expert-id order.
        order = torch.sort(-s_E, stable=True).indices
        cum = s_E[order].cumsum(0)
        total = cum[-1]
        if not total > 0:
            raise ValueError(f"MoE layer {layer}: every expert scored 0 (no token was routed)")
        n = int(torch.searchsorted(cum, p * total).item()) + 1  # first prefix reaching p
        out.append(sorted(order[: min(n, len(order))].tolist()))
    return out


def mask_expert_rows(experts: GroupedExperts, keep_E: torch.Tensor) -> list[nn.Parameter]:
    """Let only the rows ``keep_E`` (bool, one per expert this module holds) of the stacked
    expert weights receive gradient: every stack (weights and any adapter stacks) gets a hook
    that zeroes the other rows of each gradient before it accumulates (``torch.where``, so a
    non-finite value in a frozen row is dropped too, never spread). Returns the stacks."""
    stacks = list(experts.parameters(recurse=False))
    for w in stacks:
        mask = keep_E.to(w.device).view(-1, *([1] * (w.ndim - 1)))
        w.register_hook(lambda g, mask=mask: torch.where(mask, g, torch.zeros_like(g)))
    return stacks


def freeze_all_but_routed_experts(model: nn.Module) -> None:
    """ESFT's freezing before the selection is known: only the routed experts' stacks keep
    ``requires_grad`` (attention, norms, embeddings, routers, shared experts and dense layers
    are frozen); :func:`mask_expert_rows` then narrows each stack to its selected experts."""
    stacks = {
        id(p)
        for m in model.modules()
        if isinstance(m, GroupedExperts)
        for p in m.parameters(recurse=False)
    }
    for p in model.parameters():
        p.requires_grad_(id(p) in stacks)
