"""Bottleneck adapters (Houlsby et al., 2019): a small down-projection, a nonlinearity and an
up-projection with a residual connection, inserted after a sublayer's output:

    y = f(x);   y' = y + W_up gelu(W_down y + b_down) + b_up       W_down (D -> m), W_up (m -> D)

``placement`` says after which sublayers of every block: ``attention`` (after the attention's
output projection), ``ffn`` (after the feed-forward output: the dense FFN, or the MoE layer's
combined routed and shared output), or ``both`` (Houlsby's two adapters per block). Either way
the adapter sits inside the residual branch, before the block adds the branch to the residual
stream (and, with post-norm, before that norm). W_up and b_up start at zero, so the adapted model
computes exactly the base model's function at step 0 (the adapter adds +0.0).

The sublayer keeps its parameters and state-dict keys; it gains a child ``adapter`` (keys
``<sublayer>.adapter.down.weight``, ...) and its class becomes the adapted subclass. Adapters do
not fold into the base weights (the nonlinearity), so a loaded model keeps them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from moe.core.config_schema import arch, runtime
from moe.model.attention import CausalSelfAttention
from moe.model.block import Block
from moe.model.experts import DenseFFN
from moe.model.moe_layer import MoELayer
from moe.model.transformer import MoETransformer


@dataclass
class BottleneckConfig:
    hidden: int = arch(16)
    """m, the bottleneck width of each adapter (D -> m -> D); at most the model width."""
    placement: Literal["attention", "ffn", "both"] = arch("both")
    """After which sublayer of every block an adapter goes: attention (its output projection),
    ffn (the dense FFN or the MoE layer's output), or both (Houlsby et al.)."""
    init_std: float = runtime(0.01)
    """Standard deviation of the down-projection's normal initialization (the up-projection
    starts at zero)."""

    def problems(self) -> list[str]:
        out = []
        if self.hidden < 1:
            out.append(f"hidden: must be >= 1, got {self.hidden}")
        if self.init_std <= 0:
            out.append(f"init_std: must be > 0, got {self.init_std}")
        return out


class Bottleneck(nn.Module):
    """y + up(gelu(down(y))) for y (..., D)."""

    def __init__(self, d_model: int, hidden: int, init_std: float, like: torch.Tensor):
        super().__init__()
        self.down = nn.Linear(d_model, hidden, device=like.device, dtype=like.dtype)
        self.up = nn.Linear(hidden, d_model, device=like.device, dtype=like.dtype)
        nn.init.normal_(self.down.weight, std=init_std)
        nn.init.zeros_(self.down.bias)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return y + self.up(F.gelu(self.down(y)))


class AdaptedAttention(CausalSelfAttention):
    def forward(self, x_BSD, inputs):
        return self.adapter(super().forward(x_BSD, inputs))


class AdaptedDenseFFN(DenseFFN):
    def forward(self, x):
        return self.adapter(super().forward(x))


class AdaptedMoELayer(MoELayer):
    def forward(self, x_BSD):
        y_BSD, aux_loss = super().forward(x_BSD)
        return self.adapter(y_BSD), aux_loss


_ADAPTED = {
    CausalSelfAttention: AdaptedAttention,
    DenseFFN: AdaptedDenseFFN,
    MoELayer: AdaptedMoELayer,
}


def bottleneck_problems(d_model: int, cfg: BottleneckConfig) -> list[str]:
    """What keeps ``cfg`` from adapting a model of width ``d_model`` (keys of the section)."""
    if cfg.hidden > d_model:
        return [
            f"hidden: {cfg.hidden} exceeds the model width ({d_model}); a bottleneck "
            f"adapter narrows, use at most {d_model}"
        ]
    return []


def apply_bottleneck_adapters(model: MoETransformer, cfg: BottleneckConfig) -> list[nn.Parameter]:
    """Add an adapter after the sublayers ``cfg.placement`` names in every block of ``model`` (a
    single-device model, before any wrapping), drawing the down-projections from the global
    random state. Returns the new parameters."""
    problems = bottleneck_problems(model.cfg.d_model, cfg)
    if problems:
        raise ValueError("; ".join(problems))
    names = {"attention": ["attn"], "ffn": ["ffn"], "both": ["attn", "ffn"]}[cfg.placement]
    added = []
    for block in cast("list[Block]", model.blocks):
        for name in names:
            sub = getattr(block, name)
            sub.__class__ = _ADAPTED[type(sub)]
            like = next(sub.parameters())
            sub.adapter = Bottleneck(model.cfg.d_model, cfg.hidden, cfg.init_std, like)
            added += list(sub.adapter.parameters())
    return added
