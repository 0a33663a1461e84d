"""Decoder-only language model whose feed-forward layers are (mostly) MoE layers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from moe.attention import CausalSelfAttention
from moe.block import Block
from moe.experts import DenseFFN, residual_init_std
from moe.moe_layer import MoEConfig, MoELayer
from moe.norms import RMSNorm


@dataclass
class ModelConfig:
    vocab_size: int | None = None
    """Vocabulary size; null takes the tokenizer's. It must hold every id the tokenizer makes."""
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); null means n_heads (multi-head)."""
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02
    """Normal init std for all weights; projections into the residual stream (attention output,
    FFN and expert output) use init_std / sqrt(2 * n_layers)."""
    moe: MoEConfig = field(default_factory=MoEConfig)

    def problems(self) -> list[str]:
        out = [f"moe.{p}" for p in self.moe.problems()]
        if self.vocab_size is not None and self.vocab_size < 4:
            out.append(f"vocab_size: must be >= 4, got {self.vocab_size}")
        for name in ("d_model", "n_layers", "n_heads", "max_seq_len"):
            if getattr(self, name) < 1:
                out.append(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.n_heads >= 1 and self.d_model % self.n_heads:
            out.append(f"d_model: {self.d_model} must be divisible by n_heads ({self.n_heads})")
        elif self.n_heads >= 1 and (self.d_model // self.n_heads) % 2:
            out.append(f"n_heads: head dim d_model/n_heads ({self.d_model // self.n_heads}) must "
                       "be even for rotary embeddings")
        kv = self.kv_heads
        if kv < 1 or (self.n_heads >= 1 and self.n_heads % kv):
            out.append(f"n_kv_heads: {kv} must divide n_heads ({self.n_heads})")
        return out

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads


class ModelOutput(NamedTuple):
    logits: torch.Tensor  # (B, S, V)
    loss: torch.Tensor | None  # lm_loss + aux_loss: what training minimizes
    lm_loss: torch.Tensor | None  # mean next-token cross-entropy
    aux_loss: torch.Tensor  # sum of the MoE layers' weighted balancing losses


class MoETransformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError("ModelConfig.vocab_size must be resolved before building the model")
        self.cfg = cfg
        out_std = residual_init_std(cfg.init_std, cfg.n_layers)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        blocks = []
        for i in range(cfg.n_layers):
            attn = CausalSelfAttention(cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.rope_theta)
            if cfg.moe.is_moe_layer(i):
                ffn = MoELayer(cfg.d_model, cfg.moe, cfg.init_std, out_std)
            else:
                ffn = DenseFFN(cfg.d_model, cfg.moe.dense_width, cfg.moe.activation, cfg.init_std,
                               out_std)
            blocks.append(Block(attn, ffn, cfg.d_model, cfg.norm_eps))
        self.blocks = nn.ModuleList(blocks)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_weights(out_std)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def _init_weights(self, out_std: float) -> None:
        std = self.cfg.init_std
        nn.init.normal_(self.embed.weight, std=std)
        nn.init.normal_(self.lm_head.weight, std=std)
        for block in self.blocks:
            for proj in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj):
                nn.init.normal_(proj.weight, std=std)
            nn.init.normal_(block.attn.o_proj.weight, std=out_std)

    def moe_layers(self) -> list[MoELayer]:
        return [m for m in self.modules() if isinstance(m, MoELayer)]

    def forward(self, input_ids_BS: torch.Tensor, targets_BS: torch.Tensor | None = None) -> ModelOutput:
        S = input_ids_BS.shape[1]
        positions_S = torch.arange(S, device=input_ids_BS.device)
        x_BSD = self.embed(input_ids_BS)
        aux_loss = x_BSD.new_zeros((), dtype=torch.float32)
        for block in self.blocks:
            x_BSD, layer_aux = block(x_BSD, positions_S)
            aux_loss = aux_loss + layer_aux
        logits_BSV = self.lm_head(self.norm(x_BSD))
        if targets_BS is None:
            return ModelOutput(logits_BSV, None, None, aux_loss)
        lm_loss = F.cross_entropy(logits_BSV.float().flatten(0, 1), targets_BS.flatten(),
                                  ignore_index=-100)
        return ModelOutput(logits_BSV, lm_loss + aux_loss, lm_loss, aux_loss)
