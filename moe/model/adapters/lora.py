"""LoRA (Hu et al., 2021): a frozen weight W (in -> out) gains a trainable low-rank update,
y = x W + (alpha / r) * dropout(x) A B with A (in, r) and B (r, out), B starting at zero so that
the adapted model starts as the base model.

Targets, by name (``LoRAConfig.targets``):

==================  ==========================================================================
``attention.q``     each attention's ``q_proj`` (likewise ``.k``, ``.v``, ``.o``: ``k_proj``,
                    ``v_proj``, ``o_proj``)
``ffn``             the dense FFN layers' ``w_in`` and ``w_out`` (layers that are not MoE)
``shared_experts``  the MoE layers' ``shared_mlp`` (``w_in``, ``w_out``)
``experts``         the routed experts' stacked ``w_in`` (E, D, W) and ``w_out`` (E, H, D)
``router``          each router's ``weight`` (E, D), computed in fp32 like the router
==================  ==========================================================================

Routed experts get per-expert stacks A (E, in, r) and B (E, r, out), computed with the same
grouped GEMMs and the same expert-sorted rows as the experts themselves
(:func:`moe.model.experts.grouped_mm`): no loop over experts. They are parameters of the experts
module, so expert parallelism shards, reduces and saves them with their experts.
``expert_rank: per_top_k`` gives each expert rank r / top_k (Megatron-Bridge, NeMo): a token
passes through top_k experts, so its adapted capacity stays about r.

Adapting keeps every base parameter where it was (same object, same state-dict key); the LoRA
factors are added beside it (``<module>.lora_A`` / ``lora_B``, ``<experts>.w_in_lora_A``, ...)
and the module's class becomes its LoRA subclass. :func:`merge_lora` folds them back.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from moe.core.config_schema import arch, fixed, runtime
from moe.model.attention import CausalSelfAttention
from moe.model.experts import (
    DenseFFN,
    GroupedExperts,
    grouped_mm,
    grouped_mm_supported,
    uses_grouped_kernel,
)
from moe.model.moe_layer import MoELayer
from moe.model.router import TopKRouter

LoRATarget = Literal[
    "attention.q",
    "attention.k",
    "attention.v",
    "attention.o",
    "ffn",
    "shared_experts",
    "experts",
    "router",
]
_ATTENTION = {
    "attention.q": "q_proj",
    "attention.k": "k_proj",
    "attention.v": "v_proj",
    "attention.o": "o_proj",
}


@dataclass
class LoRAConfig:
    targets: list[LoRATarget] = arch(
        default_factory=lambda: [
            "attention.q",
            "attention.k",
            "attention.v",
            "attention.o",
            "experts",
        ]
    )
    """What gets LoRA factors: attention.q, attention.k, attention.v, attention.o (the attention
    projections), ffn (dense FFN layers), shared_experts, experts (routed experts, per-expert
    stacks), router. Each must match at least one layer of the model."""
    rank: int = arch(8)
    """r, the rank of every factor pair (routed experts: see expert_rank). At most the smaller
    dimension of each targeted weight."""
    alpha: float = arch(16.0)
    """The update is scaled by alpha / r (r: the factor's own rank)."""
    dropout: float = runtime(0.0)
    """Dropout on the input of the LoRA branch only, in training."""
    expert_rank: Literal["full", "per_top_k"] = arch("full")
    """Rank of each routed expert's factors: full (rank) or per_top_k (rank // router top_k, as
    Megatron-Bridge and NeMo do; rank must be at least top_k)."""
    train_router: bool = fixed(False)
    """Train the routers' weights in full (they are small: E x D); frozen by default, so that
    fine-tuning does not move which experts tokens go to."""
    init_from: str | None = runtime(None)
    """An adapter file (``moe-export CHECKPOINT OUT --format adapters``) whose factors start
    this run instead of fresh ones: its targets, rank, alpha and expert_rank must equal these,
    and the base it was trained on must be this run's (checked by a fingerprint of the base
    weights)."""

    def problems(self) -> list[str]:
        out = []
        if self.rank < 1:
            out.append(f"rank: must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            out.append(f"alpha: must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            out.append(f"dropout: must be in [0, 1), got {self.dropout}")
        if len(set(self.targets)) != len(self.targets):
            out.append(f"targets: {self.targets} names a target twice")
        if not self.targets and not self.train_router:
            out.append("targets: empty, and train_router is false: nothing would train")
        return out

    def expert_rank_of(self, top_k: int) -> int:
        return self.rank // top_k if self.expert_rank == "per_top_k" else self.rank


def lora_sites(model: nn.Module, target: str, cfg: LoRAConfig) -> list[tuple[str, nn.Module, int]]:
    """(name, module, LoRA rank) of every module ``target`` adapts in ``model`` (single-device
    names)."""
    shared = {id(m.shared_mlp) for m in model.modules() if isinstance(m, MoELayer)}
    out = []
    for name, m in model.named_modules():
        if target in _ATTENTION and isinstance(m, CausalSelfAttention):
            out.append((f"{name}.{_ATTENTION[target]}", getattr(m, _ATTENTION[target]), cfg.rank))
        elif target == "ffn" and isinstance(m, DenseFFN) and id(m) not in shared:
            out += [(f"{name}.w_in", m.w_in, cfg.rank), (f"{name}.w_out", m.w_out, cfg.rank)]
        elif target == "shared_experts" and isinstance(m, MoELayer) and m.shared_mlp is not None:
            out += [
                (f"{name}.shared_mlp.w_in", m.shared_mlp.w_in, cfg.rank),
                (f"{name}.shared_mlp.w_out", m.shared_mlp.w_out, cfg.rank),
            ]
        elif target == "experts" and isinstance(m, MoELayer):
            out.append((f"{name}.experts", m.experts, cfg.expert_rank_of(m.cfg.router.top_k)))
        elif target == "router" and isinstance(m, MoELayer):
            out.append((f"{name}.router", m.router, cfg.rank))
    return out


def _factor_shapes(module: nn.Module) -> dict[str, tuple[int, int]]:
    """{weight name: (in, out)} of the weights LoRA adapts in ``module``."""
    if isinstance(module, GroupedExperts):
        (_, d, h), (_, h2, d2) = module.w_in.shape, module.w_out.shape  # (E, in, out) each
        return {"w_in": (d, h), "w_out": (h2, d2)}
    weight = cast(torch.Tensor, module.weight)  # nn.Linear and the router: (out, in)
    out_features, in_features = weight.shape
    return {"weight": (in_features, out_features)}


def lora_problems(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """What keeps ``cfg`` from adapting ``model``, relative to the LoRA section's keys: a target
    that matches nothing, a rank above a targeted weight's smaller dimension (one message per
    target)."""
    out = []
    for target in cfg.targets:
        sites = lora_sites(model, target, cfg)
        if not sites:
            out.append(f"targets: {target!r} matches no layer of this model ({_absent(target)})")
        found = [_rank_problem(target, name, module, rank, cfg) for name, module, rank in sites]
        out += [p for p in found if p][:1]
    return out


def _rank_problem(
    target: str, name: str, module: nn.Module, rank: int, cfg: LoRAConfig
) -> str | None:
    if rank < 1:
        if cfg.rank < 1:  # LoRAConfig.problems names it: no per-expert rank to explain
            return None
        return (
            f"rank: {cfg.rank} with expert_rank per_top_k gives the routed experts rank "
            f"{cfg.rank} // top_k = 0; use a rank >= top_k"
        )
    for wname, (d_in, d_out) in _factor_shapes(module).items():
        if rank > min(d_in, d_out):
            per = "" if rank == cfg.rank else f" (per expert with expert_rank per_top_k: {rank})"
            return (
                f"rank: {cfg.rank}{per} exceeds the smaller dimension of {target} "
                f"({name}.{wname}: {d_in} -> {d_out}); use at most {min(d_in, d_out)}"
            )
    return None


def _absent(target: str) -> str:
    return {
        "ffn": "it has no dense FFN layer",
        "shared_experts": "it has no shared experts",
        "experts": "it has no MoE layer",
        "router": "it has no MoE layer",
    }.get(target, "no such module")


def apply_lora(model: nn.Module, cfg: LoRAConfig) -> list[nn.Parameter]:
    """Add LoRA factors to every target of ``cfg`` in ``model`` (a single-device model, before
    any wrapping). A factors are drawn U(-1/sqrt(in), 1/sqrt(in)) from the global random state
    (nn.Linear's own init), B factors are zero. Returns the new parameters."""
    problems = lora_problems(model, cfg)
    if problems:
        raise ValueError("; ".join(problems))
    added = []
    for target in cfg.targets:
        for _, module, rank in lora_sites(model, target, cfg):
            added += _attach(module, rank, cfg.alpha, cfg.dropout)
    return added


def _attach(module: nn.Module, rank: int, alpha: float, dropout: float) -> list[nn.Parameter]:
    stacked = isinstance(module, GroupedExperts)
    module.__class__ = _LORA_CLASS[type(module)]
    adapted = cast(_Adapted, module)  # its class is a LoRA one now
    adapted.lora_scale, adapted.lora_dropout = alpha / rank, dropout
    out = []
    for wname, (d_in, d_out) in _factor_shapes(module).items():
        base = getattr(module, wname)
        lead = (base.shape[0],) if stacked else ()
        bound = 1 / math.sqrt(d_in)
        if stacked:  # (E, in, r) and (E, r, out): the experts' own (in, out) layout
            a = torch.empty(*lead, d_in, rank, device=base.device, dtype=base.dtype)
            b = torch.zeros(*lead, rank, d_out, device=base.device, dtype=base.dtype)
        else:  # (r, in) and (out, r): nn.Linear's (out, in) layout, as PEFT stores them
            a = torch.empty(rank, d_in, device=base.device, dtype=base.dtype)
            b = torch.zeros(d_out, rank, device=base.device, dtype=base.dtype)
        nn.init.uniform_(a, -bound, bound)
        names = _factor_names(module, wname)
        for pname, value in zip(names, (a, b)):
            setattr(module, pname, nn.Parameter(value))
            out.append(getattr(module, pname))
    return out


def _factor_names(module: nn.Module, wname: str) -> tuple[str, str]:
    if isinstance(module, GroupedExperts):
        return f"{wname}_lora_A", f"{wname}_lora_B"
    return "lora_A", "lora_B"


class _Adapted(nn.Module):
    """What every LoRA class adds to the module it adapts (declared for the type checker: the
    classes are swapped in place by :func:`_attach`)."""

    lora_scale: float  # alpha / r
    lora_dropout: float


def _branch(x: torch.Tensor, module: _Adapted, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """scale * dropout(x) A^T B^T for (r, in) / (out, r) factors."""
    x = F.dropout(x, module.lora_dropout, module.training)
    return module.lora_scale * F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype))


class LoRALinear(nn.Linear, _Adapted):
    """An nn.Linear with ``lora_A`` (r, in) and ``lora_B`` (out, r)."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + _branch(x, self, self.lora_A, self.lora_B)


class LoRARouter(TopKRouter, _Adapted):
    """A router whose (E, D) weight has ``lora_A`` (r, D) and ``lora_B`` (E, r); in fp32 like
    the router (its input is at least fp32 here)."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter

    def logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        return super().logits(x_TD) + _branch(x_TD, self, self.lora_A, self.lora_B)


def kernel_rank(rank: int, dtype: torch.dtype) -> int:
    """The smallest rank >= ``rank`` whose rows are a multiple of 16 bytes in ``dtype``, as the
    grouped kernel needs (bf16: a multiple of 8; fp32: of 4)."""
    step = max(1, 16 // dtype.itemsize)
    return -(-rank // step) * step


class LoRAGroupedExperts(GroupedExperts, _Adapted):
    """Routed experts with per-expert factors ``<w>_lora_A`` (E, in, r) and ``<w>_lora_B``
    (E, r, out) for ``w`` in ``w_in``, ``w_out``: two more grouped GEMMs over the same
    expert-sorted rows and counts per product.

    A rank the grouped kernel cannot take in the factors' dtype (rank 4 in bf16: 8-byte rows) is
    zero-padded to :func:`kernel_rank` for the products: the padding adds exact zeros to the
    output and gets no gradient, and the factors keep their shapes. Without it such a rank
    would run a loop over experts, on a GPU about 20x slower (BENCHMARKS.md, fine-tuning)."""

    def _factors(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = getattr(self, f"{name}_lora_A"), getattr(self, f"{name}_lora_B")
        pad = kernel_rank(a.shape[-1], a.dtype) - a.shape[-1]
        if pad and grouped_mm_supported(a.dtype, a.device):
            a, b = F.pad(a, (0, pad)), F.pad(b, (0, 0, 0, pad))
        return a, b

    def needs_host_counts(self, x_ND: torch.Tensor) -> bool:
        base = [w for n, w in self.named_parameters(recurse=False) if not is_factor(n)]
        if not all(uses_grouped_kernel(x_ND, w) for w in base):
            return True
        for name in ("w_in", "w_out"):
            a, b = getattr(self, f"{name}_lora_A"), getattr(self, f"{name}_lora_B")
            rank = kernel_rank(a.shape[-1], a.dtype)
            for shape in ((*a.shape[:-1], rank), (b.shape[0], rank, b.shape[-1])):
                if not uses_grouped_kernel(x_ND, torch.empty(shape, dtype=a.dtype, device="meta")):
                    return True
        return False

    def project(self, name, x_ND, counts_E, counts_host):
        y_NO = super().project(name, x_ND, counts_E, counts_host)
        x_ND = F.dropout(x_ND, self.lora_dropout, self.training)
        a, b = self._factors(name)
        a_NR = grouped_mm(x_ND, a, counts_E, counts_host)
        return y_NO + self.lora_scale * grouped_mm(a_NR, b, counts_E, counts_host)


_LORA_CLASS = {nn.Linear: LoRALinear, TopKRouter: LoRARouter, GroupedExperts: LoRAGroupedExperts}
_BASE_CLASS = {v: k for k, v in _LORA_CLASS.items()}


def lora_modules(model: nn.Module) -> list[tuple[str, _Adapted]]:
    return [(n, cast(_Adapted, m)) for n, m in model.named_modules() if type(m) in _BASE_CLASS]


def is_factor(name: str) -> bool:
    return "lora_" in name.rsplit(".", 1)[-1]


BASE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""What an adapter file's ``base_dtype`` may say: the precision its run held the base in."""


@torch.no_grad()
def base_fingerprint(params: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> str:
    """sha256 of the base weights (every parameter that is not a LoRA factor, by single-device
    name) rounded to ``dtype`` and written in fp32: the base an adapter was trained on. A bf16
    run holds its frozen base in bf16, so its checkpoint has the fp32 base rounded to bf16; its
    adapters are fingerprinted, and checked, at bf16."""
    h = hashlib.sha256()
    for name in sorted(params):
        if not is_factor(name):
            h.update(name.encode())
            h.update(params[name].detach().to(dtype).float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def merge_lora(model: nn.Module) -> int:
    """Fold every LoRA update into its base weight (W += scale * A B in the weight's own layout)
    and remove the factors: the model becomes a plain one computing the same function (up to
    rounding; dropout aside). Returns the number of adapted modules merged."""
    merged = lora_modules(model)
    for _, module in merged:
        for wname in _factor_shapes(module):
            a_name, b_name = _factor_names(module, wname)
            a, b = getattr(module, a_name), getattr(module, b_name)
            w = getattr(module, wname)
            if isinstance(module, LoRAGroupedExperts):
                delta = torch.bmm(a.float(), b.float())  # (E, in, out)
            else:
                delta = b.float() @ a.float()  # (out, in)
            w.copy_((w.float() + module.lora_scale * delta).to(w.dtype))
            delattr(module, a_name)
            delattr(module, b_name)
        module.__class__ = _BASE_CLASS[type(module)]
        del module.lora_scale, module.lora_dropout
    return len(merged)
