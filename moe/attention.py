"""Causal multi-head self-attention with grouped key/value heads and rotary positions."""

import torch
import torch.nn.functional as F
from torch import nn

from moe.positions import RotaryEmbedding


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, rope_theta: float):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = d_model // n_heads
        self.q_proj = nn.Linear(d_model, n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=False)
        self.rope = RotaryEmbedding(self.head_dim, rope_theta)

    def forward(self, x_BSD: torch.Tensor, positions_S: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q = self.q_proj(x_BSD).view(B, S, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, S, hd)
        k = self.k_proj(x_BSD).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x_BSD).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rope(q, k, positions_S)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads
        )
        return self.o_proj(y.transpose(1, 2).reshape(B, S, -1))
