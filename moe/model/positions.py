"""Positional information, one class per scheme, selected by ``model.position``.

Each scheme enters the model in one of three places, so every class implements exactly one of
the hooks of :class:`PositionEncoding` (the others return None):

- ``embedding(pos_BS)``: a (B, S, D) vector added to the token embeddings (sinusoidal, learned);
- ``rotary(pos_BS)``: cos/sin tables that rotate queries and keys inside attention (RoPE);
- ``score_bias(q_pos_BS, k_pos_BL)``: a (B, H, S, L) additive bias on attention scores (ALiBi,
  T5 relative buckets); those two also give the same bias as ``score_mod(pos_BL)``, a function of
  one (batch, head, query, key) index for ``flex_attention``, which never materializes (S, L).

Positions are explicit (B, S) integer tensors rather than ``arange(S)``: document masking resets
them at document starts and the KV cache continues them from the cached length.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

PositionKind = Literal["rope", "sinusoidal", "learned", "alibi", "t5"]
# (score, batch, head, query index, key index) -> score, all 0-d tensors (flex_attention's vmap).
ScoreMod = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


class PositionEncoding(nn.Module):
    def embedding(self, pos_BS: torch.Tensor) -> torch.Tensor | None:
        return None

    def rotary(self, pos_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None

    def score_bias(self, q_pos_BS: torch.Tensor, k_pos_BL: torch.Tensor) -> torch.Tensor | None:
        return None

    def score_mod(self, pos_BL: torch.Tensor) -> ScoreMod | None:
        """``score_bias`` as a flex_attention score_mod, for queries and keys both at the (B, L)
        positions ``pos_BL`` (no cached prefix)."""
        return None


def sinusoidal_table(pos: torch.Tensor, dim: int) -> torch.Tensor:
    """Vaswani et al.: PE(pos, 2i) = sin(pos / 10000^(2i/dim)), PE(pos, 2i+1) = cos(same angle).
    ``pos`` has any shape; the result has one more trailing dimension of size ``dim``."""
    two_i = torch.arange(0, dim, 2, dtype=torch.float64, device=pos.device)
    angles = pos.to(torch.float64)[..., None] / 10000.0 ** (two_i / dim)
    table = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # interleave sin, cos
    return table[..., :dim].float()


class SinusoidalPositions(PositionEncoding):
    """Fixed sinusoidal absolute positions (no parameters, no length limit)."""

    def __init__(self, d_model: int):
        super().__init__()
        self.d_model = d_model

    def embedding(self, pos_BS):
        return sinusoidal_table(pos_BS, self.d_model)


class LearnedPositions(PositionEncoding):
    """A trained vector per absolute position 0 .. max_seq_len-1 (GPT-2)."""

    def __init__(self, max_seq_len: int, d_model: int):
        super().__init__()
        self.table = nn.Embedding(max_seq_len, d_model)

    def embedding(self, pos_BS):
        return self.table(pos_BS)


class RotaryEmbedding(PositionEncoding):
    """Rotary position embedding (RoPE) applied to query and key heads.

    Rotates each pair of channels (i, i + d/2) by the angle ``pos * theta**(-2i/d)``, so a
    query/key dot product depends only on the offset between their positions.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head dim, got {head_dim}")
        inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def rotary(self, pos_BS):
        angles_BSf = pos_BS.float()[..., None] * self.inv_freq
        # (B, 1, S, d/2): broadcast over heads.
        return angles_BSf.cos()[:, None], angles_BSf.sin()[:, None]


def apply_rotary(x_BHSd: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = cos_sin
    x1, x2 = x_BHSd.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x_BHSd.dtype)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi head slopes (Press et al.): the geometric sequence 2^(-8/n), 2^(-16/n), ... for n a
    power of two; otherwise the slopes of the nearest lower power of two p, followed by every
    other slope of 2p until n heads have one."""

    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    p = 2 ** int(math.floor(math.log2(n_heads)))
    slopes = geometric(p) + geometric(2 * p)[0::2][: n_heads - p]
    return torch.tensor(slopes, dtype=torch.float32)


class AlibiBias(PositionEncoding):
    """Attention with linear biases: head h adds -m_h * (query pos - key pos) to its scores."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.register_buffer("slopes_H", alibi_slopes(n_heads), persistent=False)

    def score_bias(self, q_pos_BS, k_pos_BL):
        dist_BSL = (q_pos_BS[:, :, None] - k_pos_BL[:, None, :]).float()
        return -self.slopes_H[None, :, None, None] * dist_BSL[:, None]

    def score_mod(self, pos_BL):
        slopes_H = self.slopes_H

        def alibi(score, b, h, q_idx, kv_idx):
            return score - slopes_H[h] * (pos_BL[b, q_idx] - pos_BL[b, kv_idx]).float()

        return alibi


def t5_bucket(distance: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's causal relative-position bucket of ``distance = query pos - key pos`` (>= 0 where
    attention is allowed; negative values fall in bucket 0 and are masked anyway).

    Distances below ``num_buckets // 2`` get a bucket each; larger ones share buckets whose
    width grows geometrically up to ``max_distance``; everything farther shares the last bucket.
    """
    exact = num_buckets // 2
    n = distance.clamp_min(0)
    # Only evaluated where n >= exact (clamped to avoid log(0) elsewhere).
    log_ratio = torch.log(n.clamp_min(exact).float() / exact) / math.log(max_distance / exact)
    far = exact + (log_ratio * (num_buckets - exact)).long()
    far = far.clamp_max(num_buckets - 1)
    return torch.where(n < exact, n, far)


class T5RelativeBias(PositionEncoding):
    """T5-style learned scalar bias per (head, relative-distance bucket), shared by all layers."""

    def __init__(self, n_heads: int, num_buckets: int, max_distance: int):
        super().__init__()
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.bias = nn.Embedding(num_buckets, n_heads)

    def score_bias(self, q_pos_BS, k_pos_BL):
        dist_BSL = q_pos_BS[:, :, None] - k_pos_BL[:, None, :]
        buckets_BSL = t5_bucket(dist_BSL, self.num_buckets, self.max_distance)
        return self.bias(buckets_BSL).permute(0, 3, 1, 2)  # (B, H, S, L)

    def score_mod(self, pos_BL):
        # The table is captured, not copied: flex_attention's backward accumulates its gradient.
        table_NH, num_buckets, max_distance = self.bias.weight, self.num_buckets, self.max_distance

        def t5(score, b, h, q_idx, kv_idx):
            bucket = t5_bucket(pos_BL[b, q_idx] - pos_BL[b, kv_idx], num_buckets, max_distance)
            return score + table_NH[bucket, h]

        return t5


def positions_from_doc_ids(doc_ids_BL: torch.Tensor) -> torch.Tensor:
    """Position of each token within its document: 0 at every change of document id."""
    L = doc_ids_BL.shape[1]
    idx_L = torch.arange(L, device=doc_ids_BL.device)
    starts_BL = torch.ones_like(doc_ids_BL, dtype=torch.bool)
    starts_BL[:, 1:] = doc_ids_BL[:, 1:] != doc_ids_BL[:, :-1]
    start_idx_BL = torch.where(starts_BL, idx_L, 0).cummax(dim=1).values
    return idx_L - start_idx_BL
