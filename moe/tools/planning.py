"""Sizing a run before starting it: memory per GPU from a config alone (parameters and FLOPs
per token come from :mod:`moe.model.size`).

Memory per GPU for weights, gradients and Adam states follows the ZeRO paper's accounting:
bf16 training keeps 2-byte weights and gradients and K = 12 bytes of optimizer state per
parameter (fp32 master copy, momentum, variance); fp32 training 4-byte weights and gradients
and 8 bytes of state. ZeRO stage 1 partitions the optimizer states and stage 2 also the
gradients over the data-parallel ranks. Expert parameters are first split over the
expert-parallel group (each rank holds num_experts / ep experts) and then partitioned over the
expert-data-parallel group (world / ep ranks); all other parameters over all ranks.

Activation memory per micro-batch estimates the tensors autograd saves for the backward pass
(no activation checkpointing), per token and layer, in units of the activation dtype:

- attention: 2D (norm input/output) + (H + 2 H_kv) hd (q, k, v) + 2 H hd (attention output and
  the output projection's input), plus H * S per token for the attention probabilities when the
  attention kernel is not fused (``attention_probs_bytes``, reported separately);
- feed-forward: 2D (norm input/output) plus, for a dense FFN of width F, 4F (SwiGLU: the fused
  input projection output 2F, silu(gate), the product) or 2F (GELU); for an MoE layer, per
  routed copy (K per token) 2D (dispatched input, expert output) plus the expert's FFN term,
  the shared experts' FFN term, and 3E fp32 values for router logits/scores;
- the head: 2D + 2V fp32 (logits and log-softmax of the loss).
"""

from __future__ import annotations

from dataclasses import dataclass

from moe.model.size import count_parameters
from moe.model.transformer import ModelConfig


@dataclass
class MemoryPlan:
    world_size: int
    expert_parallel_size: int
    zero_stage: int
    precision: str
    params_per_gpu: float
    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    attention_probs_bytes: float

    @property
    def model_states_bytes(self) -> float:
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes


def _state_bytes(precision: str) -> tuple[int, int, int]:
    """(weight, gradient, optimizer-state) bytes per parameter for Adam."""
    return (2, 2, 12) if precision == "bf16" else (4, 4, 8)


def memory_per_gpu(cfg: ModelConfig, world_size: int, ep_size: int, zero_stage: int,
                   precision: str, micro_batch_size: int, seq_len: int) -> MemoryPlan:
    counts = count_parameters(cfg)
    experts = counts.total["routed_experts"]
    others = counts.total_params - experts
    local_experts = experts / ep_size
    dp, edp = world_size, world_size // ep_size
    w, g, k = _state_bytes(precision)
    grads_div = (dp, edp) if zero_stage >= 2 else (1, 1)
    optim_div = (dp, edp) if zero_stage >= 1 else (1, 1)
    act, probs = activation_bytes(cfg, micro_batch_size, seq_len, 2 if precision == "bf16" else 4)
    return MemoryPlan(
        world_size=world_size, expert_parallel_size=ep_size, zero_stage=zero_stage,
        precision=precision, params_per_gpu=others + local_experts,
        weights_bytes=w * (others + local_experts),
        grads_bytes=g * (others / grads_div[0] + local_experts / grads_div[1]),
        optimizer_bytes=k * (others / optim_div[0] + local_experts / optim_div[1]),
        activation_bytes=act, attention_probs_bytes=probs)


def activation_bytes(cfg: ModelConfig, micro_batch_size: int, seq_len: int,
                     elem_bytes: int) -> tuple[float, float]:
    """(saved activations, extra attention probabilities if unfused) for one micro-batch."""
    D, H, moe = cfg.d_model, cfg.n_heads, cfg.moe
    hd = D // H
    ffn_mult = 4 if moe.activation == "swiglu" else 2
    tokens = micro_batch_size * seq_len
    per_token = 0.0
    for i in range(cfg.n_layers):
        per_token += 2 * D + (H + 2 * cfg.kv_heads) * hd + 2 * H * hd + 2 * D
        if cfg.is_moe_layer(i):
            K = moe.router.top_k
            per_token += K * (2 * D + ffn_mult * moe.expert_hidden)
            per_token += ffn_mult * moe.num_shared_experts * moe.expert_hidden
            per_token += 3 * moe.num_experts * 4 / elem_bytes  # fp32 router values
        else:
            per_token += ffn_mult * moe.dense_width
    per_token += 2 * D + 2 * cfg.vocab_size * 4 / elem_bytes  # fp32 logits and log-softmax
    probs = cfg.n_layers * H * seq_len * tokens * elem_bytes
    return per_token * tokens * elem_bytes, probs
