"""Permutation-based token dispatch: group token copies by expert, and combine them back.

No one-hot (tokens x experts x capacity) tensors: token copies are sorted by expert id, gathered
into one contiguous (N, D) block that grouped GEMMs consume, and scattered back with the combine
weights. Dropped copies (over capacity) are sorted into a sentinel bucket past the last expert and
cut off, so they cost nothing in the experts and contribute zero to the output.

How a copy's rows move (``model.moe.permute``): ``index_add`` gathers the copies with
``index_select`` and sums them back with ``index_add`` (the backward of each is the other, so
both directions hold one scatter-add: atomic adds on CUDA, in the rows' dtype); ``gather`` moves
rows by gathers only, in both directions: a token's K outputs are gathered through the inverse of
the sort (:func:`copy_slots`) and summed in the same kernel (in fp32 for bf16 rows, rounded
once, and deterministic), and the dispatch's gradient is formed the same way
(:class:`_CopyRows`); the combine weights' gather and, under expert parallelism, the regrouping
of the received rows take the gather through the inverse as their gradient (:class:`_Gather`).

Two dispatchers with one interface (``plan``, ``dispatch``, ``combine``): :class:`LocalDispatcher`
for experts that all live on this device, and :class:`ExpertParallelDispatcher`, which moves the
copies to the ranks of an expert-parallel group that hold their experts (all-to-all). The model
is built with the local one; the parallel adapter (moe/parallel/deepspeed_adapter.py) swaps in
the other, with the process group it made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe.model.compile import eager_under_compile, is_compiling, mark_rows_dynamic

PermuteImpl = Literal["auto", "index_add", "gather"]
PERMUTE_IMPLS: tuple[str, ...] = get_args(PermuteImpl)
"""``auto`` is the run's to choose by device (RunConfig.for_device); a layer built with it
permutes as ``index_add``."""


@dataclass
class DispatchPlan:
    copy_N: torch.Tensor  # index of each kept copy in the flattened (T*K) routing, expert-sorted
    token_N: torch.Tensor  # source token of each kept copy
    counts_E: torch.Tensor  # kept copies per expert (int64)
    num_tokens: int
    counts_host: list[int] | None = None  # counts_E on the host, where already read
    slots_TK: torch.Tensor | None = None  # permute "gather": see copy_slots
    dropping: bool = False  # some copies may have been dropped (a capacity factor)


def copy_slots(copy_N: torch.Tensor, num_copies: int, top_k: int, dropping: bool) -> torch.Tensor:
    """(T, K) position of each routed copy among the kept, expert-sorted copies ``copy_N``: the
    inverse of the sort. A dropped copy (``dropping``) points one past the last kept copy, at a
    zero row that :func:`sum_copies` appends."""
    n = copy_N.numel()
    positions = torch.arange(n, device=copy_N.device)
    if dropping:
        slots = torch.full((num_copies,), n, dtype=copy_N.dtype, device=copy_N.device)
        slots = slots.index_copy(0, copy_N, positions)
    else:  # every copy kept: copy_N is a permutation of all of them
        slots = torch.empty_like(copy_N).index_copy_(0, copy_N, positions)
    return slots.view(-1, top_k)


def sum_copies(y_ND: torch.Tensor, slots_TK: torch.Tensor, dropping: bool) -> torch.Tensor:
    """(T, D): row t is the sum of the rows of ``y_ND`` at ``slots_TK[t]``, no scatter.

    Eagerly, gathered and summed in one kernel, ``embedding_bag``'s sum with the rows as its
    table (nothing of (T, K, D) is materialised; on CUDA it accumulates bf16 rows in fp32). In a
    compiled graph, and for bf16 and fp16 rows on the CPU, a gather and a sum over K: inductor
    fuses the two into one reduction (where it would call ``embedding_bag`` as an opaque kernel),
    and the CPU's ``embedding_bag`` rounds along the way (about 1 sum in 10 of two bf16 rows is
    not the rounded exact sum), where the sum accumulates in fp32 and rounds once."""
    if dropping:
        y_ND = torch.cat([y_ND, y_ND.new_zeros(1, y_ND.shape[-1])])
    low_precision_cpu = y_ND.device.type == "cpu" and y_ND.dtype in (torch.bfloat16, torch.float16)
    if is_compiling() or low_precision_cpu:
        T, K = slots_TK.shape
        return y_ND.index_select(0, slots_TK.reshape(-1)).view(T, K, -1).sum(1)
    return F.embedding_bag(slots_TK, y_ND, mode="sum")


class _CopyRows(torch.autograd.Function):
    """The dispatch's gather of token rows into expert order; its gradient sums each token's
    copies by gathers (:func:`sum_copies`), where ``index_select``'s would scatter-add."""

    @staticmethod
    def forward(ctx, x_TD, token_N, slots_TK, dropping):
        ctx.save_for_backward(slots_TK)
        ctx.dropping = dropping
        return x_TD.index_select(0, token_N)

    @staticmethod
    def backward(ctx, grad_ND):
        (slots_TK,) = ctx.saved_tensors
        return sum_copies(grad_ND, slots_TK, ctx.dropping), None, None, None


class _SumCopies(torch.autograd.Function):
    """The combine's sum of each token's expert outputs (:func:`sum_copies`); its gradient is
    the gather of the token gradients into expert order."""

    @staticmethod
    def forward(ctx, y_ND, token_N, slots_TK, dropping):
        ctx.save_for_backward(token_N)
        return sum_copies(y_ND, slots_TK, dropping)

    @staticmethod
    def backward(ctx, grad_TD):
        (token_N,) = ctx.saved_tensors
        return grad_TD.index_select(0, token_N), None, None, None


def capacity_keep_mask(
    indices_TK: torch.Tensor, weights_TK: torch.Tensor, num_experts: int, capacity: int
) -> torch.Tensor:
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
        0, ids, torch.ones_like(ids)
    )


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


class _Gather(torch.autograd.Function):
    """``x.index_select(0, index)`` where no index repeats; its gradient is the gather through
    ``inverse`` (each row of ``x``: where it went, or, with ``pad``, one past the last row for a
    row not taken, which gets zero), where ``index_select``'s would scatter-add."""

    @staticmethod
    def forward(ctx, x, index, inverse, pad):
        ctx.save_for_backward(inverse)
        ctx.pad = pad
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        if ctx.pad:
            grad = torch.cat([grad, grad.new_zeros(1, *grad.shape[1:])])
        return grad.index_select(0, inverse), None, None, None


def inverse_permutation(perm_N: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(perm_N.numel(), device=perm_N.device)
    return torch.empty_like(perm_N).index_copy_(0, perm_N, positions)


class LocalDispatcher:
    """Dispatch for experts that all live on this device; ``permute``: how rows move (the
    module's docstring)."""

    def __init__(self, num_experts: int, permute: PermuteImpl = "index_add"):
        if permute not in PERMUTE_IMPLS:
            raise ValueError(f"permute: one of {', '.join(PERMUTE_IMPLS)}, got {permute!r}")
        self.num_experts = num_experts
        self.permute = permute

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
        dropping = keep_TK is not None
        return DispatchPlan(
            copy_N=order,
            token_N=token_N,
            counts_E=counts[: self.num_experts],
            num_tokens=T,
            counts_host=counts_host,
            slots_TK=copy_slots(order, T * K, K, dropping) if self.permute == "gather" else None,
            dropping=dropping,
        )

    def dispatch(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, plan: DispatchPlan):
        """Expert-sorted inputs, their combine weights, and the copies per (local) expert.

        The weights travel with the copies so the experts can apply them where the activation
        is narrowest (see GroupedExperts.forward)."""
        if plan.slots_TK is None:
            x_ND = x_TD.index_select(0, plan.token_N)
            w_N = weights_TK.reshape(-1).index_select(0, plan.copy_N)
            return x_ND, w_N, plan.counts_E
        x_ND = _CopyRows.apply(x_TD, plan.token_N, plan.slots_TK, plan.dropping)
        w_N = _Gather.apply(
            weights_TK.reshape(-1), plan.copy_N, plan.slots_TK.reshape(-1), plan.dropping
        )
        return x_ND, w_N, plan.counts_E

    def combine(self, y_ND: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """Sum each token's (already weighted) expert outputs back into token order."""
        if plan.slots_TK is not None:
            return _SumCopies.apply(y_ND, plan.token_N, plan.slots_TK, plan.dropping)
        out_TD = y_ND.new_zeros(plan.num_tokens, y_ND.shape[-1])
        return out_TD.index_add(0, plan.token_N, y_ND)


class _AllToAll(torch.autograd.Function):
    """Variable-sized all-to-all of rows; its gradient is the all-to-all back."""

    @staticmethod
    def forward(ctx, x_ND, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x_ND.new_empty(sum(out_splits), x_ND.shape[-1])
        dist.all_to_all_single(out, x_ND.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        out_splits, in_splits = ctx.splits
        grad_in = grad_out.new_empty(sum(in_splits), grad_out.shape[-1])
        dist.all_to_all_single(
            grad_in, grad_out.contiguous(), in_splits, out_splits, group=ctx.group
        )
        return grad_in, None, None, None


class ExpertParallelDispatcher(LocalDispatcher):
    """Dispatch across the expert-parallel group. Rank r owns global experts
    [r * E_local, (r + 1) * E_local). Token counts are exchanged first (one small all-to-all and
    one host sync for the split sizes), then the variable-sized token blocks.

    Under ``train.compile`` plan, dispatch and combine run eagerly (graph breaks): the split
    sizes are host integers that change every step, and gloo's all-to-all is not traceable.
    The received rows are marked as a dynamic size, so the compiled experts between dispatch
    and combine are compiled once for every row count (moe/model/compile.py)."""

    def __init__(self, num_experts: int, group, ep_size: int, permute: PermuteImpl = "index_add"):
        super().__init__(num_experts, permute)
        self.group, self.ep_size = group, ep_size
        self.num_local = num_experts // ep_size

    @eager_under_compile
    def plan(self, indices_TK, keep_TK):
        local = super().plan(indices_TK, keep_TK)
        send_counts = local.counts_E.view(self.ep_size, self.num_local)  # [dest rank, its expert]
        recv_counts = torch.empty_like(send_counts)  # [source rank, my expert]
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.group)
        local_counts = recv_counts.sum(0)
        # The one host sync of an expert-parallel MoE layer (per forward): all_to_all_single
        # takes its split sizes as Python ints. The same read brings the local experts' counts,
        # which the loop fallback of the expert GEMMs needs (the grouped kernel does not).
        sizes = torch.cat([send_counts.sum(1), recv_counts.sum(1), local_counts]).tolist()
        send, recv = sizes[: self.ep_size], sizes[self.ep_size : 2 * self.ep_size]
        # Received rows arrive ordered (source, my expert); experts need them ordered (expert, source).
        block_expert = torch.arange(self.num_local, device=recv_counts.device).repeat(self.ep_size)
        row_expert = torch.repeat_interleave(
            block_expert, recv_counts.reshape(-1), output_size=sum(recv)
        )
        regroup = torch.argsort(row_expert, stable=True)
        inverse = inverse_permutation(regroup) if self.permute == "gather" else None
        return _EPPlan(local, send, recv, regroup, local_counts, sizes[2 * self.ep_size :], inverse)

    @eager_under_compile
    def dispatch(self, x_TD, weights_TK, plan):
        x_ND, w_N, _ = super().dispatch(x_TD, weights_TK, plan.local)
        x_recv = _AllToAll.apply(x_ND, plan.recv_splits, plan.send_splits, self.group)
        # The combine weights go with their copies (one float per row; the experts apply them).
        w_recv = _AllToAll.apply(w_N[:, None], plan.recv_splits, plan.send_splits, self.group)
        if plan.inverse is not None:  # permute "gather": the regrouping's gradient a gather too
            x_recv = _Gather.apply(x_recv, plan.regroup, plan.inverse, False)
            w_recv = _Gather.apply(w_recv, plan.regroup, plan.inverse, False)
        else:
            x_recv, w_recv = (
                x_recv.index_select(0, plan.regroup),
                w_recv.index_select(0, plan.regroup),
            )
        return mark_rows_dynamic(x_recv), mark_rows_dynamic(w_recv[:, 0]), plan.local_counts

    @eager_under_compile
    def combine(self, y_ND, plan):
        y_recv = torch.empty_like(y_ND).index_copy(0, plan.regroup, y_ND)
        y_back = _AllToAll.apply(y_recv, plan.send_splits, plan.recv_splits, self.group)
        return super().combine(y_back, plan.local)


class _EPPlan:
    def __init__(
        self,
        local: DispatchPlan,
        send_splits,
        recv_splits,
        regroup,
        local_counts,
        counts_host,
        inverse=None,
    ):
        self.local, self.send_splits, self.recv_splits = local, send_splits, recv_splits
        self.regroup, self.local_counts = regroup, local_counts
        self.counts_host = counts_host  # local_counts on the host
        self.inverse = inverse  # of regroup, for permute "gather"

    @property
    def counts_E(self):
        return self.local.counts_E
