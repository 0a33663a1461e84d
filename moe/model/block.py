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

NormPlacement = Literal["pre", "post"]


class Block(nn.Module):
    def __init__(self, attn: CausalSelfAttention, ffn: nn.Module, d_model: int, norm: NormKind,
                 norm_eps: float, placement: NormPlacement = "pre"):
        super().__init__()
        self.pre_norm = placement == "pre"
        self.attn_norm = build_norm(norm, d_model, norm_eps)
        self.attn = attn
        self.ffn_norm = build_norm(norm, d_model, norm_eps)
        self.ffn = ffn

    def forward(self, x_BSD: torch.Tensor, inputs: AttentionInputs):
        """Returns the block output and the feed-forward's balancing loss (0 for dense)."""
        if self.pre_norm:
            x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), inputs)
            y_BSD, aux_loss = self._ffn(self.ffn_norm(x_BSD))
            return x_BSD + y_BSD, aux_loss
        x_BSD = self.attn_norm(x_BSD + self.attn(x_BSD, inputs))
        y_BSD, aux_loss = self._ffn(x_BSD)
        return self.ffn_norm(x_BSD + y_BSD), aux_loss

    def _ffn(self, h_BSD: torch.Tensor):
        out = self.ffn(h_BSD)
        # MoE layers (and their DeepSpeed wrapper) return (y, aux_loss); dense FFNs return y.
        return out if isinstance(out, tuple) else (out, h_BSD.new_zeros((), dtype=torch.float32))
