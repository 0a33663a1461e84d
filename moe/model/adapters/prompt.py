"""Soft prompt tuning (Lester et al., 2021): n trainable embeddings prepended to every sequence;
the model itself stays frozen.

The prompted model runs on ``n`` placeholder ids followed by the sequence, and its embedding
puts the soft prompt in place of the placeholders' embeddings. Everything else follows from the
longer sequence: the sequence's tokens sit at positions n .. n+S-1 (every position encoding),
causal attention lets each of them see the whole prompt (every attention back end), and the
prompt positions' targets are the ignore index, so the loss is over the sequence's own
next-token predictions only; the logits returned are the sequence's, (B, S, V). With a KV
cache, the prompt goes in front of the first call only (it is in the cache after that).

Packed documents (``model.document_masking``) are refused: a prompt in front of the row would
be seen by its first document only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from moe.core.config_schema import arch, runtime
from moe.model.transformer import ModelOutput, MoETransformer


@dataclass
class PromptConfig:
    tokens: int = arch(20)
    """n, the soft prompt's length (its positions come before every sequence)."""
    init: Literal["vocab", "random"] = runtime("vocab")
    """vocab: each prompt embedding starts as the embedding of a vocabulary token drawn at
    random (Lester et al.); random: normal with the embedding table's standard deviation."""

    def problems(self) -> list[str]:
        return [] if self.tokens >= 1 else [f"tokens: must be >= 1, got {self.tokens}"]


IGNORE = -100  # F.cross_entropy's ignore_index in MoETransformer.forward


class PromptEmbedding(nn.Embedding):
    """The token embedding; while ``prompting``, the first n positions get ``prompt`` (n, D)."""

    prompting: bool
    prompt: nn.Parameter

    def forward(self, ids_BS: torch.Tensor) -> torch.Tensor:
        x_BSD = super().forward(ids_BS)
        if not self.prompting:
            return x_BSD
        n = self.prompt.shape[0]
        prompt_BND = self.prompt.to(x_BSD.dtype).expand(x_BSD.shape[0], n, -1)
        return torch.cat((prompt_BND, x_BSD[:, n:]), dim=1)


class PromptTunedTransformer(MoETransformer):
    embed: PromptEmbedding

    @property
    def prepended_positions(self) -> int:
        return self.embed.prompt.shape[0]

    def forward(self, input_ids_BS, targets_BS=None, doc_ids_BS=None, kv_cache=None):
        if doc_ids_BS is not None:
            raise ValueError("prompt tuning does not support document ids (packed documents)")
        if kv_cache is not None and kv_cache.length:  # the prompt is in the cache already
            return super().forward(input_ids_BS, targets_BS, kv_cache=kv_cache)
        n = self.prepended_positions
        ids_BL = F.pad(input_ids_BS, (n, 0))  # placeholders (id 0), replaced by the prompt
        if targets_BS is not None:
            targets_BS = F.pad(targets_BS, (n, 0), value=IGNORE)
        self.embed.prompting = True
        try:
            out = super().forward(ids_BL, targets_BS, kv_cache=kv_cache)
        finally:
            self.embed.prompting = False
        logits = None if out.logits is None else out.logits[:, n:]
        return ModelOutput(logits, out.loss, out.lm_loss, out.aux_loss)


def apply_prompt(model: MoETransformer, cfg: PromptConfig) -> list[nn.Parameter]:
    """Make ``model`` a prompt-tuned one with a new soft prompt (drawn from the global random
    state); returns its one parameter, ``embed.prompt`` (n, D)."""
    if model.cfg.document_masking:
        raise ValueError("prompt tuning does not support model.document_masking")
    table = model.embed.weight
    with torch.no_grad():
        if cfg.init == "vocab":
            prompt = table[torch.randint(0, table.shape[0], (cfg.tokens,))].clone()
        else:
            prompt = (
                torch.randn(cfg.tokens, table.shape[1], dtype=table.dtype, device=table.device)
                * table.std()
            )
    model.__class__ = PromptTunedTransformer
    model.embed.__class__ = PromptEmbedding
    embed = cast(PromptEmbedding, model.embed)
    embed.prompting = False
    embed.prompt = nn.Parameter(prompt)
    return [embed.prompt]
