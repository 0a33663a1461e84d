"""Routed experts as stacked weights, computed with grouped GEMMs over expert-sorted tokens."""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from moe.model.compile import grouped_mm_op, is_compiling
from moe.model.recompute import recompute

Activation = Literal["swiglu", "gelu"]

_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm(x_ND: torch.Tensor, w_EIO: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Rows of ``x_ND`` are grouped by expert (``counts_E`` rows each); row block e is multiplied
    by ``w_EIO[e]``. Uses ``torch._grouped_mm`` where it supports the dtype and layout, otherwise
    a loop over contiguous slices (one host sync for the counts)."""
    row_bytes_ok = all((d * x_ND.element_size()) % 16 == 0 for d in w_EIO.shape[1:])
    compiled_other_dtype = x_ND.dtype != torch.bfloat16 and is_compiling()
    if (x_ND.dtype in _GROUPED_DTYPES and row_bytes_ok and hasattr(torch, "_grouped_mm")
            and not (compiled_other_dtype and grouped_mm_op is None)):
        offs = torch.cumsum(counts_E, 0, dtype=torch.int32)
        if compiled_other_dtype:  # the fake kernel takes bf16 only: moe/model/compile.py
            return grouped_mm_op(x_ND.contiguous(), w_EIO, offs)
        return torch._grouped_mm(x_ND.contiguous(), w_EIO, offs=offs)
    out = []
    start = 0
    for e, n in enumerate(counts_E.tolist()):
        out.append(x_ND[start:start + n] @ w_EIO[e])
        start += n
    if not out:
        return x_ND.new_zeros(0, w_EIO.shape[-1])
    return torch.cat(out, dim=0)


class GroupedExperts(nn.Module):
    """``num_experts`` feed-forward experts with stacked weights.

    SwiGLU: y = (silu(x W_gate) * (x W_up)) W_down with W_gate and W_up fused into ``w_in``
    (E, D, 2H). GELU: y = gelu(x W_in) W_out.
    """

    def __init__(self, num_experts: int, d_model: int, hidden: int, activation: Activation,
                 init_std: float = 0.02, out_init_std: float | None = None):
        super().__init__()
        self.activation = activation
        self.hidden = hidden
        width = 2 * hidden if activation == "swiglu" else hidden
        self.w_in = nn.Parameter(torch.empty(num_experts, d_model, width))
        self.w_out = nn.Parameter(torch.empty(num_experts, hidden, d_model))
        nn.init.normal_(self.w_in, std=init_std)
        nn.init.normal_(self.w_out, std=out_init_std if out_init_std is not None else init_std)
        # Selective recompute (moe/model/recompute.py): keep the (N, W) input projection,
        # recompute the (N, H) activation and its scaled copy in the backward.
        self.recompute_activation = False

    @property
    def num_experts(self) -> int:
        return self.w_in.shape[0]

    def forward(self, x_ND: torch.Tensor, counts_E: torch.Tensor,
                scale_N: torch.Tensor | None = None) -> torch.Tensor:
        """``scale_N`` (the router's combine weights) multiplies each copy's output. Since the
        output projection is linear, it is applied to whichever of the hidden activation (N, H)
        or the output (N, D) is narrower: for fine-grained experts that is 4x less work in the
        forward and in both backward products than scaling the output."""
        h_NW = grouped_mm(x_ND, self.w_in, counts_E)
        d_model = self.w_out.shape[-1]
        if scale_N is not None and self.hidden <= d_model:
            h_NH = recompute(self._scaled_activation, h_NW, scale_N,
                             enabled=self.recompute_activation)
        else:
            h_NH = recompute(self._activation, h_NW, enabled=self.recompute_activation)
        y_ND = grouped_mm(h_NH, self.w_out, counts_E)
        if scale_N is not None and self.hidden > d_model:
            y_ND = y_ND * scale_N.to(y_ND.dtype)[:, None]
        return y_ND

    def _activation(self, h_NW: torch.Tensor) -> torch.Tensor:
        return activate(h_NW, self.activation, self.hidden)

    def _scaled_activation(self, h_NW: torch.Tensor, scale_N: torch.Tensor) -> torch.Tensor:
        h_NH = activate(h_NW, self.activation, self.hidden)
        return h_NH * scale_N.to(h_NH.dtype)[:, None]


class DenseFFN(nn.Module):
    """A dense feed-forward block (the dense baseline, dense layers and shared experts)."""

    def __init__(self, d_model: int, hidden: int, activation: Activation, init_std: float = 0.02,
                 out_init_std: float | None = None):
        super().__init__()
        self.activation = activation
        self.hidden = hidden
        width = 2 * hidden if activation == "swiglu" else hidden
        self.w_in = nn.Linear(d_model, width, bias=False)
        self.w_out = nn.Linear(hidden, d_model, bias=False)
        nn.init.normal_(self.w_in.weight, std=init_std)
        nn.init.normal_(self.w_out.weight, std=out_init_std if out_init_std is not None else init_std)
        self.recompute_activation = False  # selective recompute, as in GroupedExperts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = recompute(activate, self.w_in(x), self.activation, self.hidden,
                      enabled=self.recompute_activation)
        return self.w_out(h)


def activate(h: torch.Tensor, activation: Activation, hidden: int) -> torch.Tensor:
    """SwiGLU of the fused (gate, up) projection (..., 2H), or GELU of (..., H)."""
    if activation == "swiglu":
        gate, up = h.split(hidden, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h)


def residual_init_std(base_std: float, num_layers: int) -> float:
    """Scaled init for projections that write into the residual stream (GPT-2): the residual's
    variance then stays roughly constant with depth."""
    return base_std / math.sqrt(2 * num_layers)
