"""Decoder-only language model: embedding -> N blocks (attention, dense or MoE feed-forward) ->
norm -> head.

Every architectural choice is a field of :class:`ModelConfig`: positional encoding, norm type
and placement, key/value heads, dense or MoE feed-forward, tied embeddings.

Initialization (``init_std`` = s, ``n_layers`` = L):

- token embedding, learned positions, T5 bias table, q/k/v projections, the input projections
  of dense FFNs, routed and shared experts, and an untied output head: N(0, s^2);
- projections that write into the residual stream (attention output, FFN / expert / shared
  expert output): N(0, (s / sqrt(2L))^2), so the residual's variance stays roughly constant
  with depth (GPT-2);
- the router: N(0, 0.02^2) (``moe/model/router.py``); the shared-expert gate N(0, s^2);
  norm gains (query/key norms included) 1, norm and q/k/v biases 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple, cast

import torch
from torch import nn

from moe.core.config_schema import arch, runtime
from moe.model.attention import (
    FLEX_AVAILABLE,
    AttentionBackend,
    AttentionInputs,
    CausalSelfAttention,
    KVCache,
    QKNorm,
    QKVProjection,
    build_attention_inputs,
)
from moe.model.block import Block, NormPlacement
from moe.model.experts import DenseFFN, residual_init_std
from moe.model.loss import CrossEntropyImpl, LMHeadLoss, full_cross_entropy, liger_problem
from moe.model.moe_layer import MoEConfig, MoELayer
from moe.model.norms import NormKind, build_norm
from moe.model.positions import (
    AlibiBias,
    LearnedPositions,
    PositionEncoding,
    PositionKind,
    RotaryEmbedding,
    SinusoidalPositions,
    T5RelativeBias,
    positions_from_doc_ids,
)
from moe.model.regions import ATTENTION, EMBEDDING, HEAD, region


@dataclass
class ModelConfig:
    """The model. Every field is declared once with ``arch(default)`` (changes the function the
    trained model computes: a checkpoint resumes only with the same value, every exporter holds
    or refuses it) or ``runtime(default)`` (initialization, training-only noise, losses, kernel
    choice); nested sections (``moe``, ``moe.router``) follow the same rule. The checkpoint
    check, the exporters and docs/config.md read this classification.

    A new field needs its declaration with a docstring, a rule per target in
    moe/tools/hf_support.py (held or refused if it is ``arch``), and ``python -m
    moe.config.reference > docs/config.md``; tests/moe/config/test_config_fields.py and
    test_config_reference.py fail until all are there."""

    vocab_size: int | None = arch(None)
    """Vocabulary size; null takes the tokenizer's. It must hold every id the tokenizer makes."""
    d_model: int = arch(256)
    n_layers: int = arch(4)
    n_heads: int = arch(4)
    n_kv_heads: int | None = arch(None)
    """Key/value heads: null or n_heads is multi-head attention, a divisor of n_heads
    grouped-query attention, 1 multi-query attention."""
    head_dim: int | None = arch(None)
    """Width of each attention head; null: d_model / n_heads. Set it when the heads are
    narrower or wider than that (Qwen3-MoE: 32 heads of 128 on d_model 2048)."""
    qkv_bias: bool = arch(False)
    """The query, key and value projections add a learned bias (Qwen2, Qwen2-MoE); the output
    projection never has one."""
    qk_norm: QKNorm = arch("none")
    """RMSNorm (eps norm_eps) of queries and keys before the rotary embedding: none; head, over
    each head's head_dim channels with one gain shared by the heads (Qwen3-MoE); projection,
    over the whole query and key projections, all heads at once (OLMoE)."""
    max_seq_len: int = arch(256)
    """Longest sequence (learned positions have one vector per position up to it)."""
    position: PositionKind = arch("rope")
    """Positional information: rope (rotary, base rope_theta), sinusoidal (fixed absolute),
    learned (trained absolute), alibi (linear distance bias, standard head slopes) or t5
    (learned bias per bucketed relative distance, shared by all layers)."""
    rope_theta: float = arch(10000.0)
    """RoPE base: channel pair i rotates by pos * rope_theta^(-2i/head_dim)."""
    t5_num_buckets: int = arch(32)
    """T5 bias: relative-distance buckets (half exact, half logarithmic)."""
    t5_max_distance: int = arch(128)
    """T5 bias: distance from which all pairs share the last bucket."""
    norm: NormKind = arch("rmsnorm")
    norm_placement: NormPlacement = arch("pre")
    """pre: x + f(norm(x)) and a final norm before the head; post: norm(x + f(x)) (the block
    outputs are already normalized, so there is no final norm)."""
    norm_eps: float = arch(1e-6)
    ffn: Literal["moe", "dense"] = arch("moe")
    """moe: layers chosen by moe.every_n_layers / moe.first_dense_layers are MoE layers, the
    others dense. dense: every layer is a dense FFN of width moe.dense_width, i.e. the active
    expert width (top_k + num_shared_experts) * expert_hidden: the dense baseline with the same
    active parameters (minus the router) is this one change."""
    tie_embeddings: bool = arch(False)
    """Use the token embedding matrix as the output head."""
    document_masking: bool = runtime(False)
    """In training, restrict attention to each packed document and restart positions at its
    first token, from the data pipeline's document boundaries (EOS)."""
    init_std: float = runtime(0.02)
    """Normal init std for all weights; projections into the residual stream (attention output,
    FFN and expert output) use init_std / sqrt(2 * n_layers). See the module docstring."""
    init_from: str | None = runtime(None)
    """A checkpoint (tag, checkpoints or run directory), or ``hf:DIR`` for a local Hugging Face
    transformers directory (moe/weights/hf.py, docs/open-weights.md), whose weights start
    training. Where it has a dense FFN and this model an MoE layer, every expert is upcycled
    from that FFN (moe/training/upcycle.py). Ignored when the run resumes from its own
    checkpoint."""
    upcycle_noise_std: float = runtime(0.0)
    """Relative std of Gaussian noise added to each upcycled expert (0: exact copies)."""
    attention_backend: AttentionBackend = runtime("auto")
    """How attention is computed (moe/model/attention.py); all give the same result. reference:
    SDPA with an explicit (S, L) mask for documents and biases. sdpa: SDPA's fused causal kernel,
    one call per packed document; a bias (alibi, t5) falls back to reference. flex:
    flex_attention (compiled) with a block-sparse document mask and the bias computed in the
    kernel, no (S, L) tensor; on CPU, which has no flex backward, training falls back to sdpa
    (reference with a bias). auto: sdpa without documents and bias; with them flex on CUDA; on
    CPU sdpa for documents from 2048 tokens on (measured faster; BENCHMARKS.md), otherwise
    reference. Decoding past a KV-cached prefix always runs
    reference; fallbacks are logged once."""
    qkv_projection: QKVProjection = runtime("auto")
    """How the query, key and value projections are computed; both give the same function and
    store the same three weights. separate: three products. fused: one product with the three
    weights concatenated, three times as wide, in the forward and for each gradient (fewer and
    larger GEMMs; a step keeps what the three products keep). auto (the default): by device, for a training run (RunConfig.for_device): fused
    on CUDA, separate elsewhere; a model built outside a run computes separate. Projections an
    adapter changes (LoRA, QLoRA) are computed separately."""
    cross_entropy: CrossEntropyImpl = runtime("auto")
    """How the training loss is computed from the output head (moe/model/loss.py); all give the
    same loss and gradients. auto (the default): by device, for a training run
    (RunConfig.for_device): chunked on CUDA, full elsewhere; a model built outside a run (as
    evaluation builds it) computes full. full: the (B, S, V) logits and their fp32 log-softmax (the model
    also returns the logits). chunked: cross_entropy_chunk_tokens tokens at a time, with the
    gradients formed in the forward; no (B, S, V) tensor, and a forward with targets returns no
    logits (logits None). liger: Liger-Kernel's fused linear cross-entropy (CUDA only; pip
    install liger-kernel), likewise without logits. A forward without targets (evaluation,
    generation) computes the logits with every setting."""
    cross_entropy_chunk_tokens: int = runtime(1024)
    """chunked: tokens per block; a block holds its (tokens, V) logits in fp32 and in the model
    dtype at once."""
    moe: MoEConfig = field(default_factory=MoEConfig)

    def problems(self) -> list[str]:
        out = [f"moe.{p}" for p in self.moe.problems()]
        if self.vocab_size is not None and self.vocab_size < 4:
            out.append(f"vocab_size: must be >= 4, got {self.vocab_size}")
        for name in ("d_model", "n_layers", "n_heads", "max_seq_len"):
            if getattr(self, name) < 1:
                out.append(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.head_dim is not None and self.head_dim < 1:
            out.append(f"head_dim: must be >= 1 or null (d_model / n_heads), got {self.head_dim}")
        elif self.head_dim is None and self.n_heads >= 1 and self.d_model % self.n_heads:
            out.append(
                f"d_model: {self.d_model} must be divisible by n_heads ({self.n_heads}), "
                "or set head_dim"
            )
        elif self.position == "rope" and self.n_heads >= 1 and self.head_size % 2:
            out.append(
                f"head_dim: the head dim ({self.head_size}) must be even for rotary "
                "embeddings (position: rope)"
            )
        kv = self.kv_heads
        if kv < 1 or (self.n_heads >= 1 and self.n_heads % kv):
            out.append(f"n_kv_heads: {kv} must divide n_heads ({self.n_heads})")
        if self.rope_theta <= 1:
            out.append(f"rope_theta: must be > 1, got {self.rope_theta}")
        if self.t5_num_buckets < 2:
            out.append(f"t5_num_buckets: must be >= 2, got {self.t5_num_buckets}")
        elif self.t5_max_distance <= self.t5_num_buckets // 2:
            out.append(
                f"t5_max_distance: {self.t5_max_distance} must exceed t5_num_buckets / 2 "
                f"({self.t5_num_buckets // 2}), the last exact distance"
            )
        if self.norm_eps <= 0:
            out.append(f"norm_eps: must be > 0, got {self.norm_eps}")
        if self.init_std <= 0:
            out.append(f"init_std: must be > 0, got {self.init_std}")
        if self.upcycle_noise_std < 0:
            out.append(f"upcycle_noise_std: must be >= 0, got {self.upcycle_noise_std}")
        if self.cross_entropy_chunk_tokens < 1:
            out.append(
                f"cross_entropy_chunk_tokens: must be >= 1, got {self.cross_entropy_chunk_tokens}"
            )
        if self.cross_entropy == "liger" and (problem := liger_problem()):
            out.append(
                f"cross_entropy: liger {problem}; or use chunked (the same loss in plain torch)"
            )
        if self.attention_backend == "flex" and not FLEX_AVAILABLE:
            out.append(
                f"attention_backend: flex needs torch >= 2.5 (installed {torch.__version__});"
                " use sdpa or auto"
            )
        return out

    @property
    def head_size(self) -> int:
        """Each attention head's width: head_dim, or d_model / n_heads."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    def is_moe_layer(self, index: int) -> bool:
        return self.ffn == "moe" and self.moe.is_moe_layer(index)


class ModelOutput(NamedTuple):
    logits: torch.Tensor | None  # (B, S, V); None with targets and a chunked or liger loss
    loss: torch.Tensor | None  # lm_loss + aux_loss: what training minimizes
    lm_loss: torch.Tensor | None  # mean next-token cross-entropy
    aux_loss: torch.Tensor  # sum of the MoE layers' weighted balancing losses


def build_positions(cfg: ModelConfig) -> PositionEncoding:
    if cfg.position == "rope":
        return RotaryEmbedding(cfg.head_size, cfg.rope_theta)
    if cfg.position == "sinusoidal":
        return SinusoidalPositions(cfg.d_model)
    if cfg.position == "learned":
        return LearnedPositions(cfg.max_seq_len, cfg.d_model)
    if cfg.position == "alibi":
        return AlibiBias(cfg.n_heads)
    return T5RelativeBias(cfg.n_heads, cfg.t5_num_buckets, cfg.t5_max_distance)


class MoETransformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError("ModelConfig.vocab_size must be resolved before building the model")
        self.cfg = cfg
        out_std = residual_init_std(cfg.init_std, cfg.n_layers)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.positions = build_positions(cfg)
        blocks = []
        for i in range(cfg.n_layers):
            attn = CausalSelfAttention(
                cfg.d_model,
                cfg.n_heads,
                cfg.kv_heads,
                i,
                cfg.head_size,
                cfg.qkv_bias,
                cfg.qk_norm,
                cfg.norm_eps,
                fused_qkv=cfg.qkv_projection == "fused",
            )
            ffn: nn.Module
            if cfg.is_moe_layer(i):
                ffn = MoELayer(cfg.d_model, cfg.moe, cfg.init_std, out_std)
            else:
                ffn = DenseFFN(
                    cfg.d_model, cfg.moe.dense_width, cfg.moe.activation, cfg.init_std, out_std
                )
            blocks.append(Block(attn, ffn, cfg.d_model, cfg.norm, cfg.norm_eps, cfg.norm_placement))
        self.blocks = nn.ModuleList(blocks)
        self.norm = (
            build_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
            if cfg.norm_placement == "pre"
            else nn.Identity()
        )
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # No parameters: the loss reads lm_head.weight (tied or not) when it runs.
        self.head_loss = (
            LMHeadLoss(cfg.cross_entropy, cfg.cross_entropy_chunk_tokens)
            if cfg.cross_entropy not in ("full", "auto")
            else None
        )
        self._init_weights(out_std)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def _init_weights(self, out_std: float) -> None:
        std = self.cfg.init_std
        nn.init.normal_(self.embed.weight, std=std)
        nn.init.normal_(self.lm_head.weight, std=std)
        for p in self.positions.parameters():
            nn.init.normal_(p, std=std)
        for block in cast("list[Block]", self.blocks):
            for proj in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj):
                nn.init.normal_(proj.weight, std=std)
                if proj.bias is not None:
                    nn.init.zeros_(proj.bias)
            nn.init.normal_(block.attn.o_proj.weight, std=out_std)

    def moe_layers(self) -> list[MoELayer]:
        return [m for m in self.modules() if isinstance(m, MoELayer)]

    def new_kv_cache(self) -> KVCache:
        return KVCache(self.cfg.n_layers)

    @property
    def prepended_positions(self) -> int:
        """Positions the model runs in front of the input ids of a forward without a filled
        cache (a soft prompt, moe/model/adapters/prompt.py): they take up sequence length and
        are routed, but have no input id and no output."""
        return 0

    def forward(
        self,
        input_ids_BS: torch.Tensor,
        targets_BS: torch.Tensor | None = None,
        doc_ids_BS: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> ModelOutput:
        """``doc_ids_BS``: optional document id of each token (packed sequences); attention then
        stays within a document and positions restart at 0 where the id changes (adjacent
        documents must have different ids). ``kv_cache``: keys/values of earlier tokens, appended
        to in place (pass the same ``doc_ids`` convention on every call)."""
        with region(ATTENTION):  # positions, rotary tables and masks every layer shares
            pos_BS, inputs = self._attention_inputs(input_ids_BS, doc_ids_BS, kv_cache)
        with region(EMBEDDING):
            x_BSD = self.embed(input_ids_BS)
            pos_emb = self.positions.embedding(pos_BS)
            if pos_emb is not None:
                x_BSD = x_BSD + pos_emb.to(x_BSD.dtype)
        aux_loss = x_BSD.new_zeros((), dtype=torch.float32)
        for block in self.blocks:
            x_BSD, layer_aux = block(x_BSD, inputs)
            aux_loss = aux_loss + layer_aux
        with region(HEAD):  # the final norm, the output head and the loss
            h_BSD = self.norm(x_BSD)
            logits_BSV = None
            if targets_BS is None or self.head_loss is None:
                logits_BSV = self.lm_head(h_BSD)
            if targets_BS is None:
                return ModelOutput(logits_BSV, None, None, aux_loss)
            # Mean over the targets not ignored (-100: prompt tokens of instruction data,
            # padding); 0, not NaN, when every target of the batch is ignored.
            targets = targets_BS.flatten()
            if self.head_loss is None:
                assert logits_BSV is not None
                summed = full_cross_entropy(logits_BSV.flatten(0, 1), targets)
            else:
                summed = self.head_loss(h_BSD.flatten(0, 1), self.lm_head.weight, targets)
            lm_loss = summed / (targets != -100).sum().clamp(min=1)
            return ModelOutput(logits_BSV, lm_loss + aux_loss, lm_loss, aux_loss)

    def _attention_inputs(
        self, input_ids_BS, doc_ids_BS, cache
    ) -> tuple[torch.Tensor, AttentionInputs]:
        """Positions of the new tokens and the masks/rotations all layers share."""
        S = input_ids_BS.shape[1]
        device = input_ids_BS.device
        past = cache.length if cache is not None else 0
        if past and (doc_ids_BS is None) != (cache.doc_ids_BL is None):
            raise ValueError("pass doc_ids_BS on every call with a KV cache, or on none")
        if self.cfg.position == "learned" and past + S > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence of {past + S} tokens exceeds max_seq_len "
                f"({self.cfg.max_seq_len}) of the learned position table"
            )
        doc_all_BL = None
        if doc_ids_BS is not None:
            doc_all_BL = doc_ids_BS if not past else torch.cat((cache.doc_ids_BL, doc_ids_BS), 1)
            pos_all_BL = positions_from_doc_ids(doc_all_BL)
        else:
            pos_all_BL = torch.arange(past + S, device=device)[None]  # (1, L): same for all rows
        if cache is not None:
            cache.positions_BL, cache.doc_ids_BL = pos_all_BL, doc_all_BL
        inputs = build_attention_inputs(
            self.cfg.attention_backend,
            self.positions,
            pos_all_BL,
            doc_all_BL,
            input_ids_BS.shape[0],
            past,
            cache,
        )
        return pos_all_BL[:, past:], inputs
