"""QLoRA (Dettmers et al., 2023): LoRA (moe/model/adapters/lora.py) on a frozen base whose
weights are held in 4-bit NormalFloat (NF4) with double quantisation, and dequantised on the fly.

What is quantised: every attention projection (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``),
the dense FFN layers' and shared experts' ``w_in`` / ``w_out``, and the routed experts' stacked
``w_in`` (E, D, W) / ``w_out`` (E, H, D). The embedding, the head, the norms, biases, the router
and the shared-expert gate stay in the model's precision: they are small, and the router scores
in fp32.

The format is torchao's NF4 (``torchao.quantization.to_nf4``; QLoRA's definition): a matrix,
flattened, is cut into blocks of 64 values; each block keeps its absmax c and each value the
index of the nearest of the 16 NF4 code values to w / c (two indices per byte). The absmaxes are
double-quantised: their mean is subtracted, and they are cut into blocks of 256 and stored as
int8 with one fp32 factor per block (127 / the block's absmax, torchao's 256 / (2 absmax)).

- **One quantisation per matrix.** torchao quantises tensors of at most two dimensions, and
  the mean it subtracts is per tensor; the expert stacks are quantised one expert matrix at a
  time and the results stacked. An expert's quantised weights therefore depend on that expert
  alone: each expert-parallel rank quantises only its own experts and gets exactly what one
  process quantising them all gets.
- **Padding.** torchao needs a multiple of 64 * 256 values; a matrix of another size is
  padded with zeros to the next multiple (the padding is dropped on dequantisation). For real
  sizes that is a few KB; a tiny test model pays more.
- **Storage.** Buffers of the module, ``<w>_nf4_codes`` (M, n/2) uint8, ``<w>_nf4_scales``
  (M, n/64) int8, ``<w>_nf4_factor`` (M, n/16384) fp32 and ``<w>_nf4_mean`` (M,) fp32, for
  M = 1 matrix (linear layers) or E experts; they are not parameters, so no optimizer, ZeRO
  partition or gradient sees them. For routed experts they are stacks like the expert weights,
  split per expert into the expert checkpoint files (moe/parallel/deepspeed_adapter.py).
- **Dequantisation** of a whole stack at once (no loop over experts), to fp32 exactly as
  torchao's ``NF4Tensor.get_original_weight`` computes it (tests/moe/model/adapters/test_qlora.py), then cast
  to the compute dtype. The products go through autograd functions that keep only the input's
  gradient path and dequantise again in the backward: no dequantised weight is saved for the
  backward or kept anywhere between products. Under ``torch.compile`` they are opaque custom
  ops (``moe::nf4_linear``, ``moe::nf4_grouped_mm``), so that inductor cannot keep the
  dequantised weight from the forward for the backward instead.

torchao is needed only to quantise (``pip install torchao==0.18.0``); a model whose NF4 buffers
come from a checkpoint is built and dequantised without it.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from moe.model.adapters.lora import LoRAGroupedExperts, LoRALinear
from moe.model.attention import CausalSelfAttention
from moe.model.compile import CUSTOM_OPS, is_compiling
from moe.model.experts import DenseFFN, GroupedExperts, grouped_mm

BLOCK = 64
"""Values per absmax block."""
SCALE_BLOCK = 256
"""Absmaxes per block of the double quantisation."""
TORCHAO_PIP = "pip install torchao==0.18.0"

NF4_CODE = torch.tensor(
    [
        -1.0000,
        -0.6962,
        -0.5251,
        -0.3949,
        -0.2844,
        -0.1848,
        -0.0911,
        0.0000,
        0.0796,
        0.1609,
        0.2461,
        0.3379,
        0.4407,
        0.5626,
        0.7230,
        1.0000,
    ]
)
"""The 16 NF4 values as torchao rounds them (QLoRA's quantiles of N(0, 1), scaled to [-1, 1])."""
_BYTE_VALUES = torch.stack([NF4_CODE.repeat_interleave(16), NF4_CODE.repeat(16)], dim=1)
"""(256, 2): the two values a byte of codes holds (high nibble first, as torchao packs them)."""

_PARTS = ("codes", "scales", "factor", "mean")


def torchao_missing() -> str | None:
    """Why QLoRA cannot quantise here (torchao is not installed), or None. Looked up without
    importing it (its import takes seconds)."""
    if importlib.util.find_spec("torchao") is None:
        return f"torchao, which is not installed: {TORCHAO_PIP}"
    return None


def _to_nf4():
    # torchao's import tries to load its CUDA extensions and logs a warning for each one that
    # does not load (on CPU, all of them), and torch warns about an enum it registers; NF4 is
    # plain PyTorch and needs neither.
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        from torchao.quantization import to_nf4
    except ImportError as e:
        raise ImportError(f"finetune.method qlora needs torchao ({e}): {TORCHAO_PIP}") from None
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)
    return to_nf4


def _padded(numel: int) -> int:
    unit = BLOCK * SCALE_BLOCK
    return math.ceil(numel / unit) * unit


@torch.no_grad()
def quantize_nf4(w_M: torch.Tensor) -> dict[str, torch.Tensor]:
    """The NF4 parts of each matrix ``w_M[m]`` (a stack (M, ...)), quantised by torchao one
    matrix at a time from fp32."""
    to_nf4 = _to_nf4()
    flat = w_M.detach().float().reshape(w_M.shape[0], -1)
    pad = _padded(flat.shape[1]) - flat.shape[1]
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in _PARTS}
    for row in flat:
        t = to_nf4(F.pad(row, (0, pad)), BLOCK, SCALE_BLOCK)
        parts["codes"].append(t.quantized_data)
        parts["scales"].append(t.quantized_scalers)
        parts["factor"].append(t.quantization_factor)
        parts["mean"].append(t.scaler_mean.reshape(()))
    return {k: torch.stack(v).to(w_M.device) for k, v in parts.items()}


def empty_nf4(shape: torch.Size, device=None) -> dict[str, torch.Tensor]:
    """Parts shaped for a stack of ``shape`` (M, ...), to be loaded from a checkpoint."""
    m, n = shape[0], _padded(math.prod(shape[1:]))
    return {
        "codes": torch.zeros(m, n // 2, dtype=torch.uint8, device=device),
        "scales": torch.zeros(m, n // BLOCK, dtype=torch.int8, device=device),
        "factor": torch.ones(m, n // (BLOCK * SCALE_BLOCK), device=device),
        "mean": torch.zeros(m, device=device),
    }


def dequantize_nf4(
    codes: torch.Tensor,
    scales: torch.Tensor,
    factor: torch.Tensor,
    mean: torch.Tensor,
    shape: torch.Size,
) -> torch.Tensor:
    """The fp32 stack (M, ...) of ``shape`` the parts hold: torchao's dequantisation, for every
    matrix of the stack at once."""
    m = codes.shape[0]
    # The absmax of each block: int8 / its scale block's factor + the matrix's mean.
    absmax_MB = (scales.view(m, factor.shape[1], SCALE_BLOCK).float() / factor[:, :, None]).reshape(
        m, -1
    ) + mean[:, None]
    # One lookup per byte (int32 indices): a quarter of the index memory of one int64 per value.
    values = _BYTE_VALUES.to(codes.device).index_select(0, codes.reshape(-1).int())
    values = values.view(m, -1, BLOCK) * absmax_MB[:, :, None]
    return values.view(m, -1)[:, : math.prod(shape[1:])].view(shape)


class _Weight:
    """Where a module's quantised weight ``name`` lives: its buffers and its shape."""

    def __init__(self, module: nn.Module, name: str):
        self.module, self.name = module, name

    def parts(self) -> list[torch.Tensor]:
        return [getattr(self.module, f"{self.name}_nf4_{k}") for k in _PARTS]

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        codes, scales, factor, mean = self.parts()
        shape = _shapes(self.module)[self.name]
        return dequantize_nf4(codes, scales, factor, mean, shape).to(dtype)


def _shapes(module: nn.Module) -> dict[str, torch.Size]:
    """The shapes of the weights ``module`` holds in NF4, by name (none for other modules)."""
    return getattr(module, "nf4_shapes", {})


class _NF4Linear(torch.autograd.Function):
    """x W^T with W dequantised in the forward and again in the backward (nothing saved but the
    quantised parts, which the module holds anyway). W gets no gradient."""

    @staticmethod
    def forward(ctx, x, weight: _Weight):
        ctx.weight = weight
        return F.linear(x, weight.dequantized(x.dtype)[0])

    @staticmethod
    def backward(ctx, grad):
        return grad @ ctx.weight.dequantized(grad.dtype)[0], None


class _NF4GroupedMM(torch.autograd.Function):
    """:func:`grouped_mm` of expert-sorted rows with a dequantised expert stack (E, in, out);
    the backward is the rows' gradient only, with the stack dequantised again."""

    @staticmethod
    def forward(ctx, x_ND, weight: _Weight, counts_E, counts_host):
        ctx.weight, ctx.counts_host = weight, counts_host
        ctx.save_for_backward(counts_E)
        return grouped_mm(x_ND, weight.dequantized(x_ND.dtype), counts_E, counts_host)

    @staticmethod
    def backward(ctx, grad_NO):
        (counts_E,) = ctx.saved_tensors
        w_EOI = ctx.weight.dequantized(grad_NO.dtype).transpose(1, 2).contiguous()
        return grouped_mm(grad_NO, w_EOI, counts_E, ctx.counts_host), None, None, None


if CUSTOM_OPS:
    # Under torch.compile the autograd functions above are traced into the block's joint graph,
    # where the backward's dequantisation is the forward's (common subexpressions merged), and
    # inductor's partitioner keeps the dequantised weight for the backward instead of
    # recomputing it: a copy of every frozen weight in the compute dtype held from the forward
    # to the backward, what NF4 is there to avoid. As opaque ops the products keep only their
    # inputs (the module's NF4 buffers), and the backward dequantises again, as eagerly.

    @torch.library.custom_op("moe::nf4_linear", mutates_args=())
    def nf4_linear_op(
        x: torch.Tensor,
        codes: torch.Tensor,
        scales: torch.Tensor,
        factor: torch.Tensor,
        mean: torch.Tensor,
        shape: list[int],
        transposed: bool,
    ) -> torch.Tensor:
        """x W^T for the (out, in) matrix W of a (1, out, in) NF4 stack (x W if ``transposed``),
        W dequantised in x's dtype."""
        w = dequantize_nf4(codes, scales, factor, mean, torch.Size(shape)).to(x.dtype)[0]
        return x @ w if transposed else F.linear(x, w)

    @nf4_linear_op.register_fake
    def _(x, codes, scales, factor, mean, shape, transposed):
        return x.new_empty(*x.shape[:-1], shape[2] if transposed else shape[1])

    def _save_nf4(ctx, inputs, output):
        """Both ops: (x, the four NF4 parts, shape, transposed[, counts_E])."""
        ctx.save_for_backward(*inputs[1:5], *inputs[7:])
        ctx.shape, ctx.transposed = inputs[5], inputs[6]

    def _nf4_linear_backward(ctx, grad):
        grad_x = nf4_linear_op(grad, *ctx.saved_tensors, ctx.shape, not ctx.transposed)
        return grad_x, None, None, None, None, None, None

    nf4_linear_op.register_autograd(_nf4_linear_backward, setup_context=_save_nf4)

    @torch.library.custom_op("moe::nf4_grouped_mm", mutates_args=())
    def nf4_grouped_mm_op(
        x_ND: torch.Tensor,
        codes: torch.Tensor,
        scales: torch.Tensor,
        factor: torch.Tensor,
        mean: torch.Tensor,
        shape: list[int],
        transposed: bool,
        counts_E: torch.Tensor,
    ) -> torch.Tensor:
        """:func:`grouped_mm` of expert-sorted rows with the (E, in, out) NF4 stack dequantised
        in the rows' dtype (its (E, out, in) transpose if ``transposed``)."""
        w_EIO = dequantize_nf4(codes, scales, factor, mean, torch.Size(shape)).to(x_ND.dtype)
        if transposed:
            w_EIO = w_EIO.transpose(1, 2).contiguous()
        return grouped_mm(x_ND.contiguous(), w_EIO, counts_E)

    @nf4_grouped_mm_op.register_fake
    def _(x_ND, codes, scales, factor, mean, shape, transposed, counts_E):
        return x_ND.new_empty(x_ND.shape[0], shape[1] if transposed else shape[2])

    def _nf4_grouped_backward(ctx, grad_NO):
        *parts, counts_E = ctx.saved_tensors
        grad_x = nf4_grouped_mm_op(grad_NO, *parts, ctx.shape, not ctx.transposed, counts_E)
        return grad_x, None, None, None, None, None, None, None

    nf4_grouped_mm_op.register_autograd(_nf4_grouped_backward, setup_context=_save_nf4)


def _opaque_under_compile() -> bool:
    return CUSTOM_OPS and is_compiling()


class NF4Linear(nn.Linear):
    """An nn.Linear whose frozen ``weight`` is held in NF4 (buffers ``weight_nf4_*``)."""

    _nf4_names = ("weight",)

    # Held in NF4 buffers: read-only here (the float class's attribute becomes a property).
    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        """The dequantised weight in fp32 (a fresh tensor: for export and inspection)."""
        return _Weight(self, "weight").dequantized(torch.float32)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = _Weight(self, "weight")
        if _opaque_under_compile():
            y = nf4_linear_op(x, *weight.parts(), list(_shapes(self)["weight"]), False)
        else:
            y = _NF4Linear.apply(x, weight)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class NF4LoRALinear(LoRALinear, NF4Linear):
    """LoRA on an NF4 linear layer: LoRALinear's forward over NF4Linear's base product."""


class NF4GroupedExperts(GroupedExperts):
    """Routed experts whose frozen ``w_in`` / ``w_out`` stacks are held in NF4."""

    _nf4_names = ("w_in", "w_out")

    w_in_nf4_codes: torch.Tensor  # a buffer quantize_base registers

    @property  # held in NF4 buffers: read-only here
    def w_in(self) -> torch.Tensor:  # type: ignore[override]
        return _Weight(self, "w_in").dequantized(torch.float32)

    @property
    def w_out(self) -> torch.Tensor:  # type: ignore[override]
        return _Weight(self, "w_out").dequantized(torch.float32)

    @property
    def num_experts(self) -> int:
        return self.w_in_nf4_codes.shape[0]

    def project(self, name, x_ND, counts_E, counts_host):
        weight = _Weight(self, name)
        if _opaque_under_compile():
            shape = list(_shapes(self)[name])
            return nf4_grouped_mm_op(x_ND, *weight.parts(), shape, False, counts_E)
        return _NF4GroupedMM.apply(x_ND, weight, counts_E, counts_host)


class NF4LoRAGroupedExperts(LoRAGroupedExperts, NF4GroupedExperts):
    """LoRA on NF4 routed experts: the factors' grouped products over NF4GroupedExperts'."""


_NF4_CLASS = {
    nn.Linear: NF4Linear,
    LoRALinear: NF4LoRALinear,
    GroupedExperts: NF4GroupedExperts,
    LoRAGroupedExperts: NF4LoRAGroupedExperts,
}
_FLOAT_CLASS = {v: k for k, v in _NF4_CLASS.items()}


def quantizable(model: nn.Module) -> list[nn.Module]:
    """The modules whose weights QLoRA holds in NF4 (see the module docstring)."""
    out: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, CausalSelfAttention):
            out += [m.q_proj, m.k_proj, m.v_proj, m.o_proj]
        elif isinstance(m, DenseFFN):  # dense FFN layers and shared experts
            out += [m.w_in, m.w_out]
        elif isinstance(m, GroupedExperts):
            out.append(m)
    return out


def _names(module: nn.Module) -> tuple[str, ...]:
    return ("w_in", "w_out") if isinstance(module, GroupedExperts) else ("weight",)


@torch.no_grad()
def quantize_base(model: nn.Module, quantize: bool = True) -> int:
    """Hold the weights of :func:`quantizable` modules in NF4: each float weight is replaced by
    its NF4 buffers and the module's class by its NF4 subclass. ``quantize`` False: the buffers
    are left empty, for a checkpoint's to be loaded (no torchao needed). Call it after the
    experts were split over expert-parallel ranks, so that a rank quantises only its own.
    Returns the number of modules quantised."""
    modules = [m for m in quantizable(model) if type(m) in _NF4_CLASS]
    for module in modules:
        shapes = {}
        for name in _names(module):
            w = getattr(module, name)
            stack = w if isinstance(module, GroupedExperts) else w[None]
            parts = quantize_nf4(stack) if quantize else empty_nf4(stack.shape, w.device)
            delattr(module, name)
            for k, v in parts.items():
                module.register_buffer(f"{name}_nf4_{k}", v)
            shapes[name] = stack.shape
        module.__class__ = _NF4_CLASS[type(module)]
        cast(Any, module).nf4_shapes = shapes  # read by _shapes
    return len(modules)


@torch.no_grad()
def dequantize_base(model: nn.Module) -> int:
    """Undo :func:`quantize_base`: every NF4 weight becomes a float parameter again holding its
    dequantised value (frozen, in fp32), and the module its float class. Returns the number of
    modules."""
    modules = [m for m in model.modules() if type(m) in _FLOAT_CLASS]
    for module in modules:
        weights = {
            name: _Weight(module, name).dequantized(torch.float32) for name in _shapes(module)
        }
        for name in weights:
            for k in _PARTS:
                delattr(module, f"{name}_nf4_{k}")
        module.__class__ = _FLOAT_CLASS[type(module)]
        del module.nf4_shapes
        for name, w in weights.items():
            setattr(
                module, name, nn.Parameter(w if name != "weight" else w[0], requires_grad=False)
            )
    return len(modules)


def nf4_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m) in _FLOAT_CLASS]


def quantized_numel(module: nn.Module) -> int:
    """Values of the weights ``module`` holds in NF4 (0 for other modules)."""
    return sum(math.prod(s) for s in _shapes(module).values())


def nf4_bytes(model: nn.Module) -> int:
    """Bytes of every NF4 buffer of ``model``: codes, quantised scales, factors, means."""
    return sum(
        getattr(m, f"{name}_nf4_{k}").nbytes
        for m in nf4_modules(model)
        for name in _shapes(m)
        for k in _PARTS
    )
