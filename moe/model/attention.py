"""Causal self-attention with grouped key/value heads (MHA, GQA, MQA), an optional KV cache,
and the masks that causality, document boundaries and additive position biases need.

``n_kv_heads == n_heads`` is multi-head attention, ``1 < n_kv_heads < n_heads`` grouped-query
attention (each key/value head serves n_heads / n_kv_heads query heads), ``n_kv_heads == 1``
multi-query attention. All go through PyTorch's ``scaled_dot_product_attention``: with
``is_causal`` when the plain causal mask is all there is (the fused kernels' fast path), with an
explicit boolean mask for documents or cached prefixes, and with a float mask (bias, -inf where
masked) for ALiBi and T5 biases, which SDPA cannot take any other way.

Shapes here: ``B`` batch, ``H`` query heads, ``Hkv`` key/value heads, ``S`` new tokens, ``L``
all keys (cached + new), ``hd`` head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moe.model.positions import apply_rotary


class KVCache:
    """Keys and values of the tokens seen so far, per layer, for incremental decoding.

    The model appends to it in place on every forward that receives it, so decoding is
    ``cache = KVCache(n_layers); model(prompt, kv_cache=cache); model(next_token, kv_cache=cache)``.
    Keys are stored after rotary embedding, so cached keys are never rotated again. The cache
    also keeps the positions (and document ids, when given) of the cached tokens, which the next
    chunk's positions and masks continue from. Incremental logits equal the full forward's
    for dropless MoE layers; with a capacity factor, which copies are dropped depends on the
    tokens of each chunk.
    """

    def __init__(self, n_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * n_layers
        self.values: list[torch.Tensor | None] = [None] * n_layers
        self.positions_BL: torch.Tensor | None = None
        self.doc_ids_BL: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.positions_BL is None else self.positions_BL.shape[1]

    def append(self, layer: int, k_BHSd: torch.Tensor, v_BHSd: torch.Tensor):
        """Add this chunk's keys/values for ``layer``; returns all keys/values so far."""
        if self.keys[layer] is not None:
            k_BHSd = torch.cat((self.keys[layer], k_BHSd), dim=2)
            v_BHSd = torch.cat((self.values[layer], v_BHSd), dim=2)
        self.keys[layer], self.values[layer] = k_BHSd, v_BHSd
        return k_BHSd, v_BHSd


@dataclass
class AttentionInputs:
    """What every layer's attention shares in one forward, built once by the model."""

    rotary: tuple[torch.Tensor, torch.Tensor] | None  # cos, sin (B, 1, S, hd/2) or None
    mask: torch.Tensor | None  # None: plain causal; bool (B, 1, S, L) or float (B, H, S, L)
    cache: KVCache | None = None


def build_mask(q_idx_S: torch.Tensor, k_idx_L: torch.Tensor, q_doc_BS: torch.Tensor | None,
               k_doc_BL: torch.Tensor | None, bias_BHSL: torch.Tensor | None):
    """Causal (key index <= query index) and same-document mask over the S new queries and all
    L keys; folded into the bias as -inf when there is one. Every query may see itself, so no
    row is fully masked."""
    allowed_BSL = (k_idx_L[None, :] <= q_idx_S[:, None])[None]
    if q_doc_BS is not None:
        allowed_BSL = allowed_BSL & (q_doc_BS[:, :, None] == k_doc_BL[:, None, :])
    allowed_B1SL = allowed_BSL[:, None]
    if bias_BHSL is None:
        return allowed_B1SL
    return bias_BHSL.masked_fill(~allowed_B1SL, float("-inf"))


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, layer_index: int = 0):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = d_model // n_heads
        self.layer_index = layer_index  # its slot in a KVCache
        self.q_proj = nn.Linear(d_model, n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=False)

    def forward(self, x_BSD: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q = self.q_proj(x_BSD).view(B, S, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, S, hd)
        k = self.k_proj(x_BSD).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, S, hd)
        v = self.v_proj(x_BSD).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if inputs.rotary is not None:
            q, k = apply_rotary(q, inputs.rotary), apply_rotary(k, inputs.rotary)
        if inputs.cache is not None:
            k, v = inputs.cache.append(self.layer_index, k, v)  # (B, Hkv, L, hd)
        mask = inputs.mask
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(q.dtype)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=self.n_kv_heads != self.n_heads)
        return self.o_proj(y.transpose(1, 2).reshape(B, S, -1))
