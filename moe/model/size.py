"""Parameters and FLOPs per token of a model config, without building the model (the trainer's
MFU and ``moe-plan`` both use them).

Parameters are counted per component from the shapes the model builds (tests compare every
count with the instantiated model, on the meta device for large configs). *Active* parameters
are those one token uses: all of them except the routed experts, of which top_k of num_experts
are active.

FLOPs per token (PaLM appendix B convention):

- forward = 2 * N_matmul + 4 * n_layers * S * n_heads * head_dim. ``N_matmul`` is the active
  parameters that multiply a token's activations: attention projections, router, active routed
  experts, shared experts, dense FFNs and the output head (also when tied); not the embedding
  lookup, positions or norms. The second term is the two attention products, q k^T and
  softmax(.) v, over a context of S = data.seq_len keys, counted for the full S x S square
  (causal kernels may skip half of it; the convention does not).
- training = 3 * forward (the backward pass costs twice the forward).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe.model.transformer import ModelConfig

COMPONENTS = (
    "embedding",
    "positions",
    "attention",
    "norms",
    "router",
    "routed_experts",
    "shared_experts",
    "dense_ffn",
    "lm_head",
)


@dataclass
class ParamCounts:
    total: dict[str, int] = field(default_factory=dict)
    active: dict[str, int] = field(default_factory=dict)

    @property
    def total_params(self) -> int:
        return sum(self.total.values())

    @property
    def active_params(self) -> int:
        return sum(self.active.values())


def _ffn_params(d_model: int, hidden: int, activation: str) -> int:
    return d_model * hidden * (3 if activation == "swiglu" else 2)


def _attention_vectors(cfg: ModelConfig) -> int:
    """One layer's attention parameters that multiply no activation: q/k/v biases, q/k norms."""
    hd, H, Hkv = cfg.head_size, cfg.n_heads, cfg.kv_heads
    bias = (H + 2 * Hkv) * hd if cfg.qkv_bias else 0
    return bias + {"none": 0, "head": 2 * hd, "projection": (H + Hkv) * hd}[cfg.qk_norm]


def count_parameters(cfg: ModelConfig) -> ParamCounts:
    """Total and active parameters per component (tied embeddings counted once)."""
    if cfg.vocab_size is None:
        raise ValueError("model.vocab_size must be resolved before counting parameters")
    D, L, moe = cfg.d_model, cfg.n_layers, cfg.moe
    hd, H, Hkv = cfg.head_size, cfg.n_heads, cfg.kv_heads
    norm_size = D if cfg.norm == "rmsnorm" else 2 * D
    n_moe = sum(cfg.is_moe_layer(i) for i in range(L))
    total = dict.fromkeys(COMPONENTS, 0)
    total["embedding"] = cfg.vocab_size * D
    total["positions"] = {
        "learned": cfg.max_seq_len * D,
        "t5": cfg.t5_num_buckets * cfg.n_heads,
    }.get(cfg.position, 0)
    total["attention"] = L * (2 * D * H * hd + 2 * D * Hkv * hd + _attention_vectors(cfg))
    total["norms"] = norm_size * (2 * L + (cfg.norm_placement == "pre"))
    total["router"] = n_moe * moe.num_experts * D
    expert = _ffn_params(D, moe.expert_hidden, moe.activation)
    total["routed_experts"] = n_moe * moe.num_experts * expert
    total["shared_experts"] = n_moe * (
        moe.num_shared_experts * expert + (D if moe.shared_expert_gate else 0)
    )
    total["dense_ffn"] = (L - n_moe) * _ffn_params(D, moe.dense_width, moe.activation)
    total["lm_head"] = 0 if cfg.tie_embeddings else cfg.vocab_size * D
    active = dict(total)
    active["routed_experts"] = n_moe * moe.router.top_k * expert
    return ParamCounts(total, active)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    """Forward and training FLOPs per token (see the module docstring for the formula)."""
    a = count_parameters(cfg).active
    assert cfg.vocab_size is not None  # count_parameters refuses a model without one
    matmul = (
        a["attention"]
        - cfg.n_layers * _attention_vectors(cfg)
        + a["router"]
        + a["routed_experts"]
        + a["shared_experts"]
        + a["dense_ffn"]
        + cfg.vocab_size * cfg.d_model
    )
    attention = 4 * cfg.n_layers * seq_len * cfg.n_heads * cfg.head_size
    forward = 2 * matmul + attention
    return {
        "matmul_params": matmul,
        "forward": forward,
        "attention_forward": attention,
        "training": 3 * forward,
    }
