"""Positional information: rotary embeddings (RoPE)."""

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Rotary position embedding applied to query and key heads.

    Rotates each pair of channels (i, i + d/2) by an angle ``pos * theta**(-2i/d)``, so a
    query/key dot product depends only on the offset between their positions.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head dim, got {head_dim}")
        inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, q_BHSd: torch.Tensor, k_BHSd: torch.Tensor, positions_S: torch.Tensor):
        angles_Sf = positions_S.float()[:, None] * self.inv_freq[None, :]
        cos, sin = angles_Sf.cos(), angles_Sf.sin()
        return _rotate(q_BHSd, cos, sin), _rotate(k_BHSd, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
