"""Normalization layers, selected by ``model.norm``."""

from typing import Literal

import torch
from torch import nn

NormKind = Literal["rmsnorm", "layernorm"]


class RMSNorm(nn.Module):
    """Root-mean-square normalization (no mean subtraction, no bias), computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """Mean/variance normalization with a gain and a bias, computed in fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(
            x.float(), self.normalized_shape, self.weight.float(), self.bias.float(), self.eps
        ).to(x.dtype)


def build_norm(kind: NormKind, dim: int, eps: float) -> nn.Module:
    return RMSNorm(dim, eps) if kind == "rmsnorm" else LayerNorm(dim, eps)
