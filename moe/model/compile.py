"""Regional compilation: each transformer block is compiled on its own (``train.compile``).

Why per block and not the whole model: the blocks are alike, so a compile of one block's code
serves every block (dynamo keys its cache on the code object; the other blocks' modules only add
guards), compile time does not grow with depth, and whatever stays eager between blocks (the
embedding, the head and loss, DeepSpeed's hooks) stays out of the graph. ``Module.compile`` is
used rather than ``torch.compile(module)``: the block stays a :class:`Block` with the same
parameter names, so checkpoints, recompute switches and the DeepSpeed adapter see no wrapper.

The MoE layer is compiled with its block. What a step's data decides, and how that is kept from
causing a compile per step:

- dropless routing has static shapes: T*K copies are sorted by expert, the per-expert counts are
  a tensor (the grouped GEMM's offsets), never a Python int, so nothing about them is guarded;
- a capacity factor needs the number of kept copies (``int(...)`` in the dispatcher): a graph
  break; the code after it takes that number as a dynamic size (see :func:`mark_rows_dynamic`);
- expert parallelism (moe/parallel/deepspeed_adapter.py): the all-to-alls and the host sync of
  the split sizes run eagerly (graph breaks), and the received rows are a dynamic size.

``torch._grouped_mm``'s fake (meta) kernel accepts bf16 only, while the CPU kernel also runs fp32:
under compile any other dtype goes through :func:`grouped_mm_op`, an opaque custom op around the
same eager kernel, with its backward written with the same kernel.
"""

from __future__ import annotations

import functools
import sys
from typing import cast

import torch
from torch import nn

# torch.library.custom_op and torch.compiler.is_compiling exist in every torch this project
# supports (>= 2.4); the guards keep an older torch importing the model and running eagerly.
CUSTOM_OPS = hasattr(torch.library, "custom_op") and hasattr(torch, "_grouped_mm")


def is_compiling() -> bool:
    return hasattr(torch, "compiler") and torch.compiler.is_compiling()


def eager_under_compile(fn):
    """``torch.compiler.disable`` (a compiled graph that reaches ``fn`` runs it eagerly, a graph
    break) without importing dynamo where nothing is compiled: that import costs about a second
    of CPU, which every command line that only reads configs or checkpoints, and every rank of
    an eager run, would pay. While dynamo is not imported nothing can be compiling, and ``fn``
    is called as it is; once it is, the call goes through ``torch._disable_dynamo`` (torch >=
    2.4), which makes the disabled function at its first call."""
    lazy = getattr(torch, "_disable_dynamo", None)
    if lazy is None:
        return torch.compiler.disable(fn)
    disabled = lazy(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        # Under tracing is_compiling() is True, so dynamo never reads sys.modules here.
        if torch.compiler.is_compiling() or "torch._dynamo" in sys.modules:
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


def mark_rows_dynamic(x_ND: torch.Tensor) -> torch.Tensor:
    """Call eagerly (outside a graph) on a tensor whose row count depends on the routing: the
    graph that takes it is then compiled for any row count the first time, instead of once for
    the first count and again, dynamic, for the second (dynamo's automatic dynamic shapes)."""
    dynamo = sys.modules.get("torch._dynamo")  # not imported: nothing is compiled
    mark = getattr(dynamo, "maybe_mark_dynamic", None)
    if mark is not None and x_ND.dim() and not is_compiling():
        mark(x_ND, 0)
    return x_ND


if CUSTOM_OPS:

    @torch.library.custom_op("moe::grouped_mm", mutates_args=())
    def grouped_mm_op(
        x_ND: torch.Tensor, w_EIO: torch.Tensor, offs_E: torch.Tensor
    ) -> torch.Tensor:
        """(N, I) rows grouped by expert (``offs_E``: cumulative row ends, int32) times
        (E, I, O) -> (N, O)."""
        return torch._grouped_mm(x_ND, w_EIO, offs=offs_E)

    @grouped_mm_op.register_fake
    def _(x_ND, w_EIO, offs_E):
        return x_ND.new_empty(x_ND.shape[0], w_EIO.shape[-1])

    @torch.library.custom_op("moe::grouped_mm_weight_grad", mutates_args=())
    def _weight_grad(
        x_ND: torch.Tensor, grad_NO: torch.Tensor, offs_E: torch.Tensor
    ) -> torch.Tensor:
        """(E, I, O): for each expert e, its rows of x transposed times its rows of grad."""
        return torch._grouped_mm(x_ND.t(), grad_NO, offs=offs_E)

    @_weight_grad.register_fake
    def _(x_ND, grad_NO, offs_E):
        return x_ND.new_empty(offs_E.shape[0], x_ND.shape[1], grad_NO.shape[1])

    def _save(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def _backward(ctx, grad_NO):
        x_ND, w_EIO, offs_E = ctx.saved_tensors
        grad_NO = grad_NO.contiguous()
        grad_x = grouped_mm_op(grad_NO, w_EIO.transpose(1, 2).contiguous(), offs_E)
        return grad_x, _weight_grad(x_ND, grad_NO, offs_E), None

    grouped_mm_op.register_autograd(_backward, setup_context=_save)
else:  # compiled experts then run the per-expert loop (a graph break)
    grouped_mm_op = None  # type: ignore[assignment]


def compile_blocks(
    model: nn.Module, backend: str = "inductor", cuda_graphs: bool = False, **options
) -> int:
    """Compile every block of ``model.blocks`` in place (``Module.compile``; extra keyword
    arguments go to ``torch.compile``). Call it after the model is final: after wrapping its
    MoE layers for expert parallelism, after ``apply_recompute``, and on the device and in the
    dtype it will run in (after DeepSpeed's ``initialize``, which moves and casts it): the expert
    layers probe the grouped GEMM for those here, and one they did not probe runs the
    per-expert loop under compile. Parts outside the blocks that compile a piece of their own
    (``compile_part``: the chunked loss's per-block work, moe/model/loss.py) do so here too.
    ``cuda_graphs`` (train.cuda_graphs): the blocks in torch.compile's mode "reduce-overhead",
    replayed as CUDA graph trees on CUDA (on the CPU inductor runs them without, and counts a
    skip); the parts keep the default mode. Returns the number of blocks compiled."""
    for module in model.modules():  # eager work that must not run inside a traced graph
        before = getattr(module, "before_compile", None)
        if callable(before):
            before()
    blocks = cast(nn.ModuleList, model.blocks)
    block_options = {**options, "mode": "reduce-overhead"} if cuda_graphs else options
    for block in blocks:
        block.compile(backend=backend, **block_options)
    for module in model.modules():
        part = getattr(module, "compile_part", None)
        if callable(part):
            part(backend=backend, **options)
    return len(blocks)
