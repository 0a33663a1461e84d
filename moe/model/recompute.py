"""Activation recompute: drop activations in the forward, recompute them in the backward.

Modes (``train.recompute``), applied to the model from outside by :func:`apply_recompute`:

- ``none``: every activation a backward needs is kept.
- ``full``: every block keeps only its inputs. A block whose feed-forward is dense is one
  checkpointed region. A block around an MoE layer is split: the norms + attention + residual
  are one region, the routed experts another, the shared experts a third; the router, the
  capacity mask, the dispatch plan and the token dispatch and combine (the expert-parallel
  all-to-alls) run once, in the forward, and are never inside a region.
- ``selective``: keep what is expensive to recompute (matmul outputs, attention projections,
  routing) and recompute what is large and cheap: each norm, the activation function of every
  routed expert, shared expert and dense FFN (SwiGLU / GELU and the combine weight), the
  attention core (``CausalSelfAttention.recompute_core``) and the query and key norms
  (``model.qk_norm``; ``recompute_qk_norms``).

Why routing and dispatch stay outside every region. A checkpointed region runs twice: in the
forward, and again in the backward to rebuild what it dropped. Anything inside it with a side
effect would happen twice: an all-to-all would be a second collective (every rank must reach it
in the same order, and it would move the backward's tokens on ranks that are elsewhere), the
routing could pick other experts (jitter or noise, or a loss-free bias changed in between), and
the MoE layer's step counters (tokens per expert, drops, aux and z losses, the load that drives
the loss-free bias update) would count the micro-batch twice. So the regions hold only local
compute whose inputs are tensors: the MoE layer's forward routes, plans, dispatches, records its
statistics and combines outside them, and its experts' region starts from the dispatched rows,
the routed token layout of the forward, which the region keeps as its input. This is enforced,
not just arranged: :func:`outside_recompute` raises if an MoE layer runs inside a region, so
a change that moved routing into one fails at its first forward.

What a region keeps is its inputs (held by ``torch.utils.checkpoint``, non-reentrant); a
region's output, when a later op saves it, is kept as well. :func:`saved_activation_bytes`
measures both.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any, Literal, cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

RecomputeMode = Literal["none", "full", "selective"]

_state = (
    threading.local()
)  # depth: checkpointed regions entered; observers: see saved_activation_bytes


def _depth() -> int:
    return getattr(_state, "depth", 0)


def recompute(fn: Callable, *args, enabled: bool = True):
    """``fn(*args)``, as a checkpointed region when ``enabled`` and gradients are being
    recorded (evaluation and generation, under no_grad, run it plainly: a KV cache append
    inside a region must not run twice)."""
    if not enabled or not torch.is_grad_enabled():
        return fn(*args)
    if _depth() == 0:
        for observe in getattr(_state, "observers", ()):
            observe(args)
    return checkpoint(_Region(fn), *args, use_reentrant=False)


class _Region:
    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, *args):
        _state.depth = _depth() + 1
        try:
            return self.fn(*args)
        finally:
            _state.depth -= 1


def outside_recompute(what: str) -> None:
    """Raise if called from inside a checkpointed region (see the module docstring)."""
    if _depth():
        raise RuntimeError(
            f"{what} ran inside an activation-recompute region: it would run "
            "again in the backward (routing, all-to-all, statistics counted twice)"
        )


def apply_recompute(model: nn.Module, mode: RecomputeMode, every_n_blocks: int = 1) -> list[int]:
    """Set ``mode`` on blocks 0, N, 2N, ... (N = ``every_n_blocks``) of an
    :class:`~moe.model.transformer.MoETransformer` (plain or with its MoE layers wrapped for
    DeepSpeed) and ``none`` on the others. Idempotent: a later call replaces an earlier one.
    Returns the indices of the blocks that recompute."""
    if mode not in ("none", "full", "selective"):
        raise ValueError(f"recompute mode {mode!r} is not one of none, full, selective")
    if every_n_blocks < 1:
        raise ValueError(f"every_n_blocks must be >= 1, got {every_n_blocks}")
    chosen = []
    blocks = cast("list[Any]", model.blocks)  # Blocks; their parts are set by attribute
    for i, block in enumerate(blocks):
        m = mode if i % every_n_blocks == 0 else "none"
        # MoE layers (possibly inside DeepSpeed's wrapper) are found by their recompute switch.
        moe = [layer for layer in block.ffn.modules() if hasattr(layer, "recompute_experts")]
        block.recompute_block = m == "full" and not moe
        block.recompute_attention = m == "full" and bool(moe)
        block.recompute_norms = m == "selective"
        for layer in moe:
            layer.recompute_experts = m == "full"
        for ffn in block.ffn.modules():
            if hasattr(ffn, "recompute_activation"):
                ffn.recompute_activation = m == "selective"
        # CausalSelfAttention checkpoints its core (scores, softmax, weighted values) itself.
        block.attn.recompute_core = m == "selective"
        block.attn.recompute_qk_norms = m == "selective"
        if m != "none":
            chosen.append(i)
    return chosen


@contextmanager
def saved_activation_bytes(exclude: nn.Module | None = None):
    """Measure what a forward keeps for its backward: yields a dict whose ``"bytes"`` is, after
    the block, the size of every storage saved by autograd or held as the input of a
    checkpointed region, each storage once (by its data pointer). Parameters and buffers of
    ``exclude`` (the model) are not activations and are left out. Only tensors still alive
    when the block ends count: a graph dropped early (a detached statistic) frees what it
    saved, and the allocator may hand that address to a later tensor, which must not hide it."""
    skip = set()
    if exclude is not None:
        skip = {t.untyped_storage().data_ptr() for t in (*exclude.parameters(), *exclude.buffers())}
    held: list[tuple[weakref.ref, int, int]] = []
    result = {"bytes": 0, "storages": 0}

    def count(t):
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            if s.data_ptr() not in skip:
                held.append((weakref.ref(t), s.data_ptr(), s.nbytes()))

    def observe(args):
        for a in args:
            for t in _tensors(a):
                count(t)

    def pack(t):
        count(t)
        return t

    observers = getattr(_state, "observers", ())
    _state.observers = (*observers, observe)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield result
    finally:
        _state.observers = observers
    alive = {ptr: n for ref, ptr, n in held if ref() is not None}
    result["bytes"] = sum(alive.values())
    result["storages"] = len(alive)


def _tensors(obj):
    """Tensors in a region argument: a tensor, or the tensor fields of a small container
    (``AttentionInputs``: rotary tables and mask)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o)
    elif hasattr(obj, "__dict__"):
        for o in vars(obj).values():
            if not isinstance(o, nn.Module):
                yield from _tensors(o)
