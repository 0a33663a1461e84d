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

_probed: dict[tuple, bool] = {}


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def grouped_mm_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``torch._grouped_mm`` computes (E, ...) grouped products for ``dtype`` on
    ``device``. On CUDA it takes bf16 only, on Hopper (sm90) since torch 2.8; torch 2.13
    documents sm >= 80. On CPU (torch 2.13) it takes fp32 and bf16. Other versions and dtypes
    are not assumed: a tiny call per (device kind, capability, dtype) is checked against the
    loop once (cached), and anything that raises or disagrees uses the loop."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if dtype != torch.bfloat16 or cap < (8, 0) or (cap[0] != 9 and _torch_version() < (2, 13)):
            return False
        key: tuple[str, tuple[int, int] | None, torch.dtype] = ("cuda", cap, dtype)
    elif device.type == "cpu":
        key = ("cpu", None, dtype)
    else:
        return False
    if key not in _probed:
        if is_compiling():
            # No probe inside a graph being traced: compile_blocks probes every expert layer's
            # (dtype, device) eagerly first (GroupedExperts.before_compile); anything it did not
            # probe runs the loop.
            return False
        _probed[key] = _probe(dtype, device)
    return _probed[key]


@torch.no_grad()
def _probe(dtype: torch.dtype, device: torch.device) -> bool:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(24, 16, generator=gen).to(device, dtype)
    w = torch.randn(3, 16, 8, generator=gen).to(device, dtype)
    counts = [10, 0, 14]  # an expert with no tokens included
    try:
        got = torch._grouped_mm(
            x, w, offs=torch.tensor([10, 10, 24], dtype=torch.int32, device=device)
        )
    except (RuntimeError, NotImplementedError):
        return False
    want = _loop_mm(x, w, counts)
    return bool(torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2))


def _loop_mm(x_ND: torch.Tensor, w_EIO: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """One matmul per expert over its contiguous block of rows."""
    blocks, start = [x_ND.new_zeros(0, w_EIO.shape[-1])], 0
    for e, n in enumerate(counts):
        blocks.append(x_ND[start : start + n] @ w_EIO[e])
        start += n
    return torch.cat(blocks, dim=0)


def uses_grouped_kernel(x_ND: torch.Tensor, w_EIO: torch.Tensor) -> bool:
    """:func:`grouped_mm` calls ``torch._grouped_mm`` (else it loops over experts)."""
    # The kernels also need 16-byte aligned row strides in both operands (transposed in the
    # backward).
    aligned = all((d * x_ND.element_size()) % 16 == 0 for d in w_EIO.shape[1:])
    if x_ND.dtype != torch.bfloat16 and is_compiling() and grouped_mm_op is None:
        return False
    return x_ND.dtype == w_EIO.dtype and aligned and grouped_mm_supported(x_ND.dtype, x_ND.device)


def grouped_mm(
    x_ND: torch.Tensor,
    w_EIO: torch.Tensor,
    counts_E: torch.Tensor,
    counts_host: list[int] | None = None,
) -> torch.Tensor:
    """Rows of ``x_ND`` are grouped by expert (``counts_E`` rows each, experts with no rows
    allowed); row block e is multiplied by ``w_EIO[e]``.

    Uses ``torch._grouped_mm`` where :func:`grouped_mm_supported` (no host sync: the offsets
    stay on the device); otherwise a loop over experts, which needs the counts on the host:
    ``counts_host`` if the caller has them, else one ``tolist`` here (a host sync)."""
    if uses_grouped_kernel(x_ND, w_EIO):
        offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
        if x_ND.dtype != torch.bfloat16 and is_compiling():
            # The kernel's fake (meta) form takes bf16 only: an opaque custom op around the same
            # eager kernel (moe/model/compile.py).
            return grouped_mm_op(x_ND.contiguous(), w_EIO, offs_E)
        return torch._grouped_mm(x_ND.contiguous(), w_EIO, offs=offs_E)
    if counts_host is None:
        counts_host = counts_E.tolist()  # host sync: the loop needs the block sizes
    return _loop_mm(x_ND, w_EIO, counts_host)


class GroupedExperts(nn.Module):
    """``num_experts`` feed-forward experts with stacked weights.

    SwiGLU: y = (silu(x W_gate) * (x W_up)) W_down with W_gate and W_up fused into ``w_in``
    (E, D, 2H). GELU: y = gelu(x W_in) W_out.
    """

    def __init__(
        self,
        num_experts: int,
        d_model: int,
        hidden: int,
        activation: Activation,
        init_std: float = 0.02,
        out_init_std: float | None = None,
    ):
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

    def forward(
        self,
        x_ND: torch.Tensor,
        counts_E: torch.Tensor,
        scale_N: torch.Tensor | None = None,
        counts_host: list[int] | None = None,
    ) -> torch.Tensor:
        """``scale_N`` (the router's combine weights) multiplies each copy's output. Since the
        output projection is linear, it is applied to whichever of the hidden activation (N, H)
        or the output (N, D) is narrower: for fine-grained experts that is 4x less work in the
        forward and in both backward products than scaling the output. ``counts_host``: the
        counts on the host when the caller already read them (the loop fallback needs them)."""
        if counts_host is None and self.needs_host_counts(x_ND):
            # Host sync (fallback only): the loop over experts needs the block sizes; read once
            # for all products.
            counts_host = counts_E.tolist()
        h_NW = self.project("w_in", x_ND, counts_E, counts_host)
        d_model = x_ND.shape[-1]  # not w_out's: a quantised stack (adapters/qlora.py) has none
        if scale_N is not None and self.hidden <= d_model:
            h_NH = recompute(
                self._scaled_activation, h_NW, scale_N, enabled=self.recompute_activation
            )
        else:
            h_NH = recompute(self._activation, h_NW, enabled=self.recompute_activation)
        y_ND = self.project("w_out", h_NH, counts_E, counts_host)
        if scale_N is not None and self.hidden > d_model:
            y_ND = scale_rows(y_ND, scale_N)
        return y_ND

    def needs_host_counts(self, x_ND: torch.Tensor) -> bool:
        """Whether some product of this layer loops over experts (see :func:`grouped_mm`)."""
        return not all(uses_grouped_kernel(x_ND, w) for w in self.parameters(recurse=False))

    def project(
        self, name: str, x_ND: torch.Tensor, counts_E: torch.Tensor, counts_host: list[int] | None
    ) -> torch.Tensor:
        """Row block e of ``x_ND`` times expert e's ``name`` weight (``w_in`` or ``w_out``);
        adapters (moe/model/adapters/) add their own products over the same blocks."""
        return grouped_mm(x_ND, getattr(self, name), counts_E, counts_host)

    def before_compile(self) -> None:
        """Probe the grouped kernel for this layer's weights eagerly (see grouped_mm_supported);
        compile_blocks calls it."""
        grouped_mm_supported(self.w_in.dtype, self.w_in.device)

    def _activation(self, h_NW: torch.Tensor) -> torch.Tensor:
        return activate(h_NW, self.activation, self.hidden)

    def _scaled_activation(self, h_NW: torch.Tensor, scale_N: torch.Tensor) -> torch.Tensor:
        return scale_rows(activate(h_NW, self.activation, self.hidden), scale_N)


def scale_rows(h_NH: torch.Tensor, scale_N: torch.Tensor) -> torch.Tensor:
    """Each row times its fp32 combine weight, in fp32, rounded once to the rows' dtype.

    In a bf16 model the product is formed in fp32 (bf16 times fp32 promotes), so the weight is
    never rounded to bf16 and its gradient, the sum over the row of grad * h, is summed and kept
    in fp32: it is the router's gradient from the language-model loss, and the weights of a
    token's experts are close (near-uniform routing), so their gradients differ by little and a
    bf16 rounding of each (relative 2^-8) would blur which expert should gain. The saved tensors
    are the bf16 rows and the fp32 weights, as before but 2 more bytes per routed copy."""
    return (h_NH * scale_N[:, None]).to(h_NH.dtype)


class DenseFFN(nn.Module):
    """A dense feed-forward block (the dense baseline, dense layers and shared experts)."""

    def __init__(
        self,
        d_model: int,
        hidden: int,
        activation: Activation,
        init_std: float = 0.02,
        out_init_std: float | None = None,
    ):
        super().__init__()
        self.activation = activation
        self.hidden = hidden
        width = 2 * hidden if activation == "swiglu" else hidden
        self.w_in = nn.Linear(d_model, width, bias=False)
        self.w_out = nn.Linear(hidden, d_model, bias=False)
        nn.init.normal_(self.w_in.weight, std=init_std)
        nn.init.normal_(
            self.w_out.weight, std=out_init_std if out_init_std is not None else init_std
        )
        self.recompute_activation = False  # selective recompute, as in GroupedExperts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = recompute(
            activate, self.w_in(x), self.activation, self.hidden, enabled=self.recompute_activation
        )
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
