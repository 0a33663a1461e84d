"""Prefix tuning (Li and Liang, 2021): every attention layer gains n trainable key/value pairs
that every query attends to, in front of the sequence's own keys; the model stays frozen.

Per layer, ``prefix_k`` and ``prefix_v`` are (Hkv, n, hd): one prefix per key/value head
(grouped-query heads share them as they share keys). Prefix keys are position-free: no rotary
embedding, and no ALiBi or T5 bias (their bias is 0); every query sees all of them (the causal
and cache masks apply to the sequence's keys only). They are added after the KV cache, so a
cache holds the sequence's keys only and each decoding step sees the prefix again.

Back ends: the explicit-mask paths only, i.e. SDPA (plain causal, or with a bool or float mask)
and the reference; flex attention and per-document SDPA (packed documents) are not built and are
refused by the run config (model.attention_backend, model.document_masking). Unlike soft
prompts, the prefixes change the function from step 0 (they start small: N(0, init_std))."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from moe.core.config_schema import arch, runtime
from moe.model.attention import AttentionInputs, CausalSelfAttention


@dataclass
class PrefixConfig:
    tokens: int = arch(10)
    """n, the key/value pairs each attention layer gains."""
    init_std: float = runtime(0.02)
    """Standard deviation of the prefixes' normal initialization."""

    def problems(self) -> list[str]:
        out = []
        if self.tokens < 1:
            out.append(f"tokens: must be >= 1, got {self.tokens}")
        if self.init_std <= 0:
            out.append(f"init_std: must be > 0, got {self.init_std}")
        return out


def prefix_problems(attention_backend: str, position: str, document_masking: bool) -> list[str]:
    """The model settings prefix tuning does not support (full keys, each with its fix)."""
    out = []
    if attention_backend == "flex" or (attention_backend == "auto" and position in ("alibi", "t5")):
        out.append(
            f"model.attention_backend: {attention_backend} can run flex attention (with "
            f"position {position}), which prefix tuning does not support; use sdpa or "
            "reference"
        )
    if document_masking:
        out.append(
            "model.document_masking: prefix tuning does not support packed documents "
            "(per-document attention); set it false"
        )
    return out


class PrefixAttention(CausalSelfAttention):
    prefix_k: nn.Parameter  # (Hkv, n, hd), added by apply_prefix
    prefix_v: nn.Parameter

    def extend_keys(self, k, v, inputs: AttentionInputs):
        if inputs.backend not in ("sdpa", "reference") or inputs.doc_lengths is not None:
            raise ValueError(
                f"prefix tuning does not support the {inputs.backend} back end or packed documents"
            )
        B, L, n = k.shape[0], k.shape[2], self.prefix_k.shape[1]
        mask = inputs.mask  # None: plain causal over L = S keys
        if mask is None:
            mask = torch.ones(L, L, dtype=torch.bool, device=k.device).tril()[None, None]
        front = (torch.ones if mask.dtype == torch.bool else torch.zeros)(
            *mask.shape[:-1], n, dtype=mask.dtype, device=mask.device
        )
        k = torch.cat((self.prefix_k.to(k.dtype).expand(B, -1, -1, -1), k), dim=2)
        v = torch.cat((self.prefix_v.to(v.dtype).expand(B, -1, -1, -1), v), dim=2)
        return k, v, dataclasses.replace(inputs, mask=torch.cat((front, mask), dim=-1))


def apply_prefix(model: nn.Module, cfg: PrefixConfig) -> list[nn.Parameter]:
    """Give every attention layer of ``model`` its prefixes (drawn from the global random
    state); returns them."""
    added = []
    for m in model.modules():
        if isinstance(m, CausalSelfAttention):
            like = m.k_proj.weight
            m.__class__ = PrefixAttention
            for name in ("prefix_k", "prefix_v"):
                p = (
                    torch.randn(
                        m.n_kv_heads, cfg.tokens, m.head_dim, dtype=like.dtype, device=like.device
                    )
                    * cfg.init_std
                )
                setattr(m, name, nn.Parameter(p))
                added.append(getattr(m, name))
    return added
