"""One pre-norm decoder block: x + attn(norm(x)), then x + ffn(norm(x))."""

import torch
from torch import nn

from moe.attention import CausalSelfAttention
from moe.experts import DenseFFN
from moe.moe_layer import MoELayer
from moe.norms import RMSNorm


class Block(nn.Module):
    def __init__(self, attn: CausalSelfAttention, ffn: MoELayer | DenseFFN, d_model: int,
                 norm_eps: float):
        super().__init__()
        self.attn_norm = RMSNorm(d_model, norm_eps)
        self.attn = attn
        self.ffn_norm = RMSNorm(d_model, norm_eps)
        self.ffn = ffn

    def forward(self, x_BSD: torch.Tensor, positions_S: torch.Tensor):
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), positions_S)
        y, aux_loss = self._ffn(self.ffn_norm(x_BSD))
        return x_BSD + y, aux_loss

    def _ffn(self, h_BSD: torch.Tensor):
        if isinstance(self.ffn, DenseFFN):
            return self.ffn(h_BSD), h_BSD.new_zeros(())
        return self.ffn(h_BSD)
