"""One decoder block: attention then feed-forward, each wrapped in a residual connection.

Pre-norm (default, GPT-2 onwards): ``x + f(norm(x))``; the residual stream itself is never
normalized, which keeps gradients well-behaved in deep stacks. Post-norm (the original
Transformer): ``norm(x + f(x))``; every block's output is normalized.
"""

from typing import Literal

import torch
from torch import nn

from moe.model.attention import AttentionInputs, CausalSelfAttention
from moe.model.norms import NormKind, build_norm
from moe.model.recompute import recompute
from moe.model.regions import ATTENTION, BLOCK, FFN, NORM, region

NormPlacement = Literal["pre", "post"]


class Block(nn.Module):
    def __init__(
        self,
        attn: CausalSelfAttention,
        ffn: nn.Module,
        d_model: int,
        norm: NormKind,
        norm_eps: float,
        placement: NormPlacement = "pre",
    ):
        super().__init__()
        self.pre_norm = placement == "pre"
        self.attn_norm = build_norm(norm, d_model, norm_eps)
        self.attn = attn
        self.ffn_norm = build_norm(norm, d_model, norm_eps)
        self.ffn = ffn
        # Activation recompute, set by moe.model.recompute.apply_recompute: the whole block as
        # one region (dense feed-forward), the attention half only (MoE feed-forward: routing
        # and dispatch stay outside), or each norm (selective).
        self.recompute_block = False
        self.recompute_attention = False
        self.recompute_norms = False

    def forward(self, x_BSD: torch.Tensor, inputs: AttentionInputs):
        """Returns the block output and the feed-forward's balancing loss (0 for dense)."""
        with region(BLOCK):
            return recompute(self._forward, x_BSD, inputs, enabled=self.recompute_block)

    def _forward(self, x_BSD: torch.Tensor, inputs: AttentionInputs):
        x_BSD, h_BSD = recompute(self._attention, x_BSD, inputs, enabled=self.recompute_attention)
        y_BSD, aux_loss = self._ffn(h_BSD)
        if self.pre_norm:
            return x_BSD + y_BSD, aux_loss
        return self._norm(self.ffn_norm, x_BSD + y_BSD), aux_loss

    def _attention(self, x_BSD: torch.Tensor, inputs: AttentionInputs):
        """The residual stream after attention, and the feed-forward's input."""
        if self.pre_norm:
            x_BSD = x_BSD + self._attn(self._norm(self.attn_norm, x_BSD), inputs)
            return x_BSD, self._norm(self.ffn_norm, x_BSD)
        x_BSD = self._norm(self.attn_norm, x_BSD + self._attn(x_BSD, inputs))
        return x_BSD, x_BSD

    def _attn(self, x_BSD: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        with region(ATTENTION):
            return self.attn(x_BSD, inputs)

    def _norm(self, norm: nn.Module, x_BSD: torch.Tensor) -> torch.Tensor:
        with region(NORM):
            return recompute(norm, x_BSD, enabled=self.recompute_norms)

    def _ffn(self, h_BSD: torch.Tensor):
        with region(FFN):  # an MoE layer's own ranges split it further
            out = self.ffn(h_BSD)
        # MoE layers (and their DeepSpeed wrapper) return (y, aux_loss); dense FFNs return y.
        return out if isinstance(out, tuple) else (out, h_BSD.new_zeros((), dtype=torch.float32))
