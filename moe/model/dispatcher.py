"""Permutation-based token dispatch: group token copies by expert, and combine them back.

No one-hot (tokens x experts x capacity) tensors: token copies are sorted by expert id, gathered
into one contiguous (N, D) block that grouped GEMMs consume, and scattered back with the combine
weights. Dropped copies (over capacity) are sorted into a sentinel bucket past the last expert and
cut off, so they cost nothing in the experts and contribute zero to the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe.model.compile import eager_under_compile, mark_rows_dynamic


@dataclass
class DispatchPlan:
    copy_N: torch.Tensor  # index of each kept copy in the flattened (T*K) routing, expert-sorted
    token_N: torch.Tensor  # source token of each kept copy
    counts_E: torch.Tensor  # kept copies per expert (int64)
    num_tokens: int
    counts_host: list[int] | None = None  # counts_E on the host, where already read


def capacity_keep_mask(indices_TK: torch.Tensor, weights_TK: torch.Tensor, num_experts: int,
                       capacity: int) -> torch.Tensor:
    """Boolean (T, K) mask of copies each expert keeps: at most ``capacity`` per expert, the
    copies with the highest router weight first (ties: earlier token first)."""
    flat_e = indices_TK.reshape(-1)
    by_weight = torch.argsort(weights_TK.reshape(-1).detach(), descending=True, stable=True)
    order = by_weight[torch.argsort(flat_e[by_weight], stable=True)]
    counts_E = count_ids(flat_e, num_experts)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    sorted_e = flat_e[order]
    rank_in_expert = torch.arange(order.numel(), device=order.device) - starts_E[sorted_e]
    keep = torch.empty_like(flat_e, dtype=torch.bool)
    keep[order] = rank_in_expert < capacity
    return keep.view_as(indices_TK)


def count_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    """How often each of 0..n-1 occurs in ``ids`` (int64). Not ``torch.bincount``: its output
    length depends on the largest id, which a compiled graph cannot know (a graph break), and on
    CUDA it reads that maximum back to the host, a sync per call; this one's length is fixed."""
    return torch.zeros(n, dtype=torch.long, device=ids.device).scatter_add_(
        0, ids, torch.ones_like(ids))


@eager_under_compile
def _kept_copies(order: torch.Tensor, counts_E: torch.Tensor, top_k: int):
    """The first sum(counts_E) entries of ``order``, their tokens, and counts_E on the host.
    Their number is data dependent: one host sync per layer, only when dropping (the default,
    dropless, has none here); the per-expert counts come with it, for the experts' loop
    fallback. Under compile this runs eagerly (a graph break), after which the row count is a
    dynamic size, not a new compile for each count (moe/model/compile.py)."""
    counts_host = counts_E.tolist()
    kept_N = order[: sum(counts_host)]
    return mark_rows_dynamic(kept_N), mark_rows_dynamic(kept_N // top_k), counts_host


class LocalDispatcher:
    """Dispatch for experts that all live on this device."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def plan(self, indices_TK: torch.Tensor, keep_TK: torch.Tensor | None) -> DispatchPlan:
        T, K = indices_TK.shape
        flat_e = indices_TK.reshape(-1)
        if keep_TK is not None:
            flat_e = torch.where(keep_TK.reshape(-1), flat_e, self.num_experts)
        counts = count_ids(flat_e, self.num_experts + 1)
        order = torch.argsort(flat_e, stable=True)
        counts_host = None
        if keep_TK is not None:
            order, token_N, counts_host = _kept_copies(order, counts[: self.num_experts], K)
        else:
            token_N = order // K
        return DispatchPlan(copy_N=order, token_N=token_N, counts_E=counts[: self.num_experts],
                            num_tokens=T, counts_host=counts_host)

    def dispatch(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, plan: DispatchPlan):
        """Expert-sorted inputs, their combine weights, and the copies per (local) expert.

        The weights travel with the copies so the experts can apply them where the activation
        is narrowest (see GroupedExperts.forward)."""
        x_ND = x_TD.index_select(0, plan.token_N)
        w_N = weights_TK.reshape(-1).index_select(0, plan.copy_N)
        return x_ND, w_N, plan.counts_E

    def combine(self, y_ND: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """Sum each token's (already weighted) expert outputs back into token order."""
        out_TD = y_ND.new_zeros(plan.num_tokens, y_ND.shape[-1])
        return out_TD.index_add(0, plan.token_N, y_ND)
