"""The language-model loss on the output head: the summed next-token cross-entropy of the logits
``h W^T`` (``model.cross_entropy``).

- ``full``: the (T, V) logits in the model dtype, their fp32 copy and its log-softmax, kept for
  the backward (what :class:`~moe.model.transformer.MoETransformer` does by default; the model
  returns the logits too).
- ``chunked``: :class:`ChunkedLinearCrossEntropy`, in blocks of ``chunk`` tokens: each block's
  logits are formed, reduced to its loss and turned at once into the gradients of the hidden
  states and of the head weight; nothing of size (T, V) exists at any time, and the backward
  only scales the kept gradients by the incoming one (no second head product). The block's
  arithmetic is the reference's: the logits in the model dtype, then their fp32 log-softmax,
  the logit gradient rounded to the model dtype for the two products. Under
  ``train.compile`` the block's elementwise work (cast, log-softmax, softmax, target
  subtraction, cast back) is compiled into fused kernels (:meth:`LMHeadLoss.compile_part`).
- ``liger``: Liger-Kernel's fused linear cross-entropy (Triton, CUDA only; the ``liger`` extra,
  ``pip install liger-kernel``), with fp32 accumulation of the weight gradient.

All three return the same sum over the targets that are not ``IGNORE`` (fp32, a scalar); the
model divides it by their count. Peak memory against ``full``: BENCHMARKS.md ("Chunked
cross-entropy"); tests/moe/model/test_loss.py compares losses and gradients.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

CrossEntropyImpl = Literal["auto", "full", "chunked", "liger"]
IGNORE = -100
LIGER_INSTALL = "pip install liger-kernel==0.8.5 (or pip install -e .[liger])"


def liger_problem() -> str | None:
    """Why ``cross_entropy: liger`` cannot run on this machine, or None."""
    if importlib.util.find_spec("liger_kernel") is None:
        return f"needs Liger-Kernel, which is not installed: {LIGER_INSTALL}"
    return None


def full_cross_entropy(logits_TV: torch.Tensor, targets_T: torch.Tensor) -> torch.Tensor:
    """The reference: fp32 log-softmax of the whole logits, summed over the kept targets."""
    return F.cross_entropy(logits_TV.float(), targets_T, ignore_index=IGNORE, reduction="sum")


def chunk_loss_and_grads(
    h_CD: torch.Tensor, w_VD: torch.Tensor, targets_C: torch.Tensor, need_h: bool, need_w: bool
):
    """One block of tokens: its summed loss (fp32), and the gradients of that sum with respect to
    the block's hidden states (C, D) and to the head weight (V, D), both in the model dtype
    (None where not needed). The reference's formula (fp32 log-softmax of the model-dtype
    logits); the gradient is formed in place on the log-softmax, so the block's peak is one
    (C, V) fp32 tensor beside the model-dtype logits or gradient."""
    logp_CV = torch.log_softmax((h_CD @ w_VD.t()).float(), dim=-1)
    kept_C = targets_C != IGNORE
    safe_C = torch.where(kept_C, targets_C, 0)[:, None]  # any valid index where ignored
    loss = -torch.where(kept_C, logp_CV.gather(1, safe_C)[:, 0], 0.0).sum()
    if not (need_h or need_w):
        return loss, None, None
    # d loss / d logits = softmax - one_hot(target), zero for ignored targets.
    grad_CV = logp_CV.exp_()
    grad_CV.scatter_add_(1, safe_C, torch.full_like(grad_CV[:, :1], -1.0))
    grad_CV.mul_(kept_C[:, None])
    grad_CV = grad_CV.to(h_CD.dtype)  # as the reference's fp32 -> model dtype cast
    grad_h = grad_CV @ w_VD if need_h else None
    grad_w = grad_CV.t() @ h_CD if need_w else None
    return loss, grad_h, grad_w


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum over kept targets of cross_entropy(h W^T), computed ``chunk`` tokens at a time, with
    the gradients formed in the forward (see the module docstring). The weight gradient is
    summed over the blocks in fp32."""

    @staticmethod
    def forward(ctx, h_TD, w_VD, targets_T, chunk: int, body=chunk_loss_and_grads):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss = torch.zeros((), dtype=torch.float32, device=h_TD.device)
        grad_h = torch.empty_like(h_TD) if need_h else None
        grad_w = (
            torch.zeros(w_VD.shape, dtype=torch.float32, device=w_VD.device) if need_w else None
        )
        for start in range(0, h_TD.shape[0], chunk):
            part = slice(start, start + chunk)
            loss_c, grad_h_c, grad_w_c = body(h_TD[part], w_VD, targets_T[part], need_h, need_w)
            loss += loss_c
            if grad_h is not None:
                grad_h[part] = grad_h_c
            if grad_w is not None:
                grad_w += grad_w_c
        ctx.w_dtype = w_VD.dtype
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        if grad_h is not None:
            grad_h = (grad_h * grad_loss).to(grad_h.dtype)
        if grad_w is not None:
            grad_w = (grad_w * grad_loss).to(ctx.w_dtype)
        return grad_h, grad_w, None, None, None


class LMHeadLoss(nn.Module):
    """The summed cross-entropy of ``h_TD @ weight_VD.T`` against ``targets_T`` by ``impl``
    (``chunked`` or ``liger``; ``full`` stays in the model, which also returns the logits).
    No parameters: the head weight is passed in, so tied embeddings and a frozen head work."""

    def __init__(self, impl: CrossEntropyImpl, chunk_tokens: int):
        super().__init__()
        if impl not in ("chunked", "liger"):
            raise ValueError(f"LMHeadLoss computes chunked or liger, not {impl!r}")
        self.impl, self.chunk_tokens = impl, chunk_tokens
        self.body = chunk_loss_and_grads

    def compile_part(self, backend: str = "inductor", **options) -> None:
        """Compile the per-block work (called by moe.model.compile.compile_blocks): the fp32
        cast, log-softmax, softmax, target subtraction and cast back become fused kernels
        around the two head products. The block size is fixed, the last block may be shorter:
        at most two shapes, compiled in the first step."""
        self.body = torch.compile(chunk_loss_and_grads, backend=backend, **options)

    def forward(
        self, h_TD: torch.Tensor, weight_VD: torch.Tensor, targets_T: torch.Tensor
    ) -> torch.Tensor:
        if self.impl == "liger":
            return _liger_sum(h_TD, weight_VD, targets_T)
        if not torch.is_grad_enabled() or not (h_TD.requires_grad or weight_VD.requires_grad):
            return sum(
                self.body(
                    h_TD[s : s + self.chunk_tokens],
                    weight_VD,
                    targets_T[s : s + self.chunk_tokens],
                    False,
                    False,
                )[0]
                for s in range(0, h_TD.shape[0], self.chunk_tokens)
            )
        return ChunkedLinearCrossEntropy.apply(
            h_TD, weight_VD, targets_T, self.chunk_tokens, self.body
        )


def _liger_sum(h_TD: torch.Tensor, weight_VD: torch.Tensor, targets_T: torch.Tensor):
    problem = liger_problem()
    if problem is not None:
        raise RuntimeError(f"model.cross_entropy: liger {problem}")
    if h_TD.device.type != "cuda":
        raise RuntimeError(
            f"model.cross_entropy: liger runs Triton kernels on CUDA only (this "
            f"model is on {h_TD.device.type}); use chunked"
        )
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(
        h_TD, weight_VD, targets_T, ignore_index=IGNORE, reduction="sum", accum_dtype=torch.float32
    ).float()
