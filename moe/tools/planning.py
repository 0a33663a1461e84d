"""Sizing a run before starting it: memory per GPU from a config alone (parameters and FLOPs
per token come from :mod:`moe.model.size`), and the layouts that fit a cluster.

Model states. Memory per GPU for weights, gradients and Adam states follows the ZeRO paper's
accounting: bf16 training keeps 2-byte weights and gradients and K = 12 bytes of optimizer
state per parameter (fp32 master copy, momentum, variance); fp32 training 4-byte weights and
gradients and 8 bytes of state. ZeRO stage 1 partitions the optimizer states and stage 2 also
the gradients over the data-parallel ranks. Expert parameters are first split over the
expert-parallel group (each rank holds num_experts / ep experts) and then partitioned over the
expert-data-parallel group (world / ep ranks); all other parameters over all ranks.

Activations: what one micro-batch keeps for its backward. Each term below is a storage that
autograd saves (or a checkpointed region holds as its input) in the forward of this code base,
found by listing the saved tensors with ``torch.autograd.graph.saved_tensors_hooks``; each
storage is counted once (a tensor saved by two ops, or a view, costs once), and tensors whose
graph is dropped in the forward (the router entropy, computed under ``detach``) cost nothing.
``tests/moe/tools/test_planning_measured.py`` measures it and holds the estimate to 10%.

Notation: T = micro_batch_size * S tokens, D model width, H / Hkv query / key-value heads, hd
head dim, V vocabulary, E experts, K top_k, Hx expert hidden, F dense FFN width, Fs = shared
experts * Hx, e = 2 (bf16) or 4 (fp32) bytes, N = routed copies kept per rank = T * K dropless
(balanced: every rank receives T*K copies under expert parallelism too), at most
E * ceil(capacity_factor * T * K / E) with a capacity factor. "w" = 3 for SwiGLU (the fused
gate/up output 2, then silu(gate)), 1 for GELU.

- Norm (RMSNorm, computed in fp32), not recomputed: its fp32 input 4TD (in fp32 the input
  tensor itself, in bf16 a copy), the rsqrt 4T, the normalized fp32 4TD, and its output eTD
  (saved by the next linear). LayerNorm: 4TD + 8T (mean, rstd) + eTD. Selective: the region
  keeps its input eTD, the output eTD is kept by the next linear.
- Attention, none: q, k, v after rotary (H + 2 Hkv) hd eT (GQA keys/values are not expanded),
  the core's output H hd eT and log-sum-exp 4HT, the output projection's input H hd eT.
  Selective: q, k, v and the output projection's input (the core's output and log-sum-exp
  are recomputed). ``model.qk_norm`` (head or projection) adds its norms: their fp32 input
  and normalized rows 8 (H + Hkv) hd T, each row's rsqrt 4T (H + Hkv per head, 2 per
  projection), in bf16 the fp32 weight copies; compiled, the input e (H + Hkv) hd T and the
  rsqrt; selective, the input only (the norms run again in the backward). ``model.qkv_projection: fused`` keeps the same
  (its backward concatenates the weights again). Back end ``reference`` with documents or an ALiBi/T5 bias (what
  ``auto`` picks on CUDA is flex, which keeps none): SDPA keeps the mask it receives as a
  float (B, 1, S, S) (documents) or (B, H, S, S) (bias) tensor of the model dtype, per layer;
  plain causal attention passes no mask. No back end keeps the S x S probabilities (SDPA's fused
  kernels keep the log-sum-exp instead); ``attention_mask_bytes`` reports the mask part.
- Dense FFN of width F, none: its output projection's input eTF and the activation's
  intermediates w eTF (SwiGLU: the fused 2F projection and silu(gate); GELU: its input).
  Selective: the activation's input (2F or F) and output F.
- MoE layer: router (never recomputed, fp32 whatever the model dtype): its fp32 input 4TD
  (the norm output itself in fp32, a copy in bf16; the bf16 norm output eTD is kept only
  when shared experts read it), the logits 4TE (the z-loss's logsumexp), the scores 4TE,
  the logsumexp 4T, the top-k ids 8TK, + 4TK for topk_then_softmax, + 4TK + 4T for
  renormalize, + 4T for sigmoid scores; in bf16 also the fp32 copy of the router weight 4ED.
  Dispatch: two int64 index vectors 16N (+ 8N for the expert-parallel regrouping); with
  ``moe.permute: gather`` one of them and the inverse of the sort, 8N + 8TK.
  Routed experts, none: the dispatched rows eND, the expert input projection w eN Hx, the
  activation eN Hx, the combine-weighted copy where it is applied (eN Hx when Hx <= D, else the
  output eND), the output rows kept by the combine eND (by its scatter-add: none with
  ``moe.permute: gather``, whose gradient needs only the indices), and the combine weights 4N
  (fp32 in any dtype: the product is formed in fp32). Selective: the activation's
  intermediates (silu(gate) in the w term) are recomputed. Full: the region keeps its inputs
  (rows eND, weights 4N), and the combine its output rows eND (not with gather).
  Shared experts: a dense FFN of width Fs on the norm output, dropped (but for its input)
  under full.
- Compiled blocks (``train.compile``), where not recomputed: inductor's partitioner rebuilds
  the norms and the activation functions in the backward rather than keeping them, as
  selective recompute does, keeps the attention core's output and statistics as eager does,
  and does not keep the expert output rows for the combine's scatter-add (checked against
  what compiled blocks keep on the CPU, and against the peak of one H200 step,
  BENCHMARKS.md).
- Block under full recompute: a dense block keeps its input eTD; an MoE block its input eTD
  (attention region), the router and dispatch terms, and the experts' region above.
  ``recompute_every_n_blocks`` n: blocks 0, n, 2n, ... use the mode, the others none.
- Outside the blocks: token ids 8T and targets 8T, rotary tables 4 S hd (B times with
  documents), the final norm (never recomputed), and the loss's fp32 log-softmax 4TV. With
  ``model.cross_entropy`` chunked or liger the gradients are formed in the forward: the
  hidden states' gradient eTD takes the place of the norm output the head would keep, and the
  head weight's fp32 gradient sum 4VD that of the log-softmax.

Working set on top of the saved activations (``transient_bytes``): the largest of (a) the logits
around the loss, TV (2e + 4) (the model-dtype logits, their fp32 log-softmax gradient and its
model-dtype cast); chunked: one block of C = cross_entropy_chunk_tokens tokens, its fp32 logits
and their log-softmax 8CV (the softmax gradient is formed in place in the latter) and its weight
gradient eVD;
liger: its block of Liger's size (:func:`liger_chunk_tokens`), eCV + eVD, (b) what the backward
rebuilds of one recomputed block (its none estimate minus what it kept), (c) under expert
parallelism the all-to-all send and receive buffers of one MoE layer, 2 eND + 8N. The peak is
modelled as model states + saved + transient.

Layouts (``fitting_layouts``): for a number of GPUs and their memory, every expert-parallel
size dividing both the GPU count and num_experts, ZeRO stage 0/1/2 (1/2 only for bf16), each
recompute mode and a micro-batch size from MICRO_BATCHES whose gradient accumulation keeps the
config's global batch, whose peak fits in USABLE_FRACTION of the memory (the rest is left
to the CUDA context, NCCL and allocator fragmentation). They are ordered by, first, the compute
factor (training FLOPs with recompute over training FLOPs without: full recompute adds one
forward of the blocks it covers, 4/3; selective adds the attention core's forward once more,
4 S H hd per layer and token, a few percent), then the larger micro-batch (better matmul
efficiency, fewer accumulation steps), then the fewer bytes each GPU sends per step (the
expert all-to-alls and the gradient reduction; ZeRO-2 reduces every micro-batch), then the
lower ZeRO stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe.model.attention import choose_backend
from moe.model.router import capacity
from moe.model.size import count_parameters, flops_per_token
from moe.model.transformer import ModelConfig

MODES = ("none", "selective", "full")
MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
USABLE_FRACTION = 0.9
GIB = 2**30


@dataclass
class ActivationEstimate:
    saved_bytes: float
    """Kept for the backward by one micro-batch (all terms of the module docstring)."""
    transient_bytes: float
    """Largest short-lived working set on top of ``saved_bytes``."""
    attention_mask_bytes: float
    """The part of ``saved_bytes`` that is S x S attention masks (back end ``reference``)."""
    alltoall_bytes: float
    """Expert-parallel send and receive buffers of one MoE layer (0 without expert parallelism)."""


@dataclass
class MemoryPlan:
    world_size: int
    expert_parallel_size: int
    zero_stage: int
    precision: str
    recompute: str
    params_per_gpu: float
    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    transient_bytes: float
    attention_mask_bytes: float

    @property
    def model_states_bytes(self) -> float:
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> float:
        return self.model_states_bytes + self.activation_bytes + self.transient_bytes


def _state_bytes(precision: str) -> tuple[int, int, int]:
    """(weight, gradient, optimizer-state) bytes per parameter for Adam."""
    return (2, 2, 12) if precision == "bf16" else (4, 4, 8)


def elem_bytes(precision: str) -> int:
    return 2 if precision == "bf16" else 4


def memory_per_gpu(
    cfg: ModelConfig,
    world_size: int,
    ep_size: int,
    zero_stage: int,
    precision: str,
    micro_batch_size: int,
    seq_len: int,
    recompute: str = "none",
    every_n_blocks: int = 1,
    immediate_grad_update: bool = False,
    compiled: bool = False,
) -> MemoryPlan:
    """``immediate_grad_update`` (train.immediate_grad_update, bf16 at ZeRO stage 1): no bf16
    gradient is kept, each is folded into DeepSpeed's accumulation buffer as it is produced.
    ``compiled`` (train.compile): the blocks not recomputed keep what inductor keeps."""
    counts = count_parameters(cfg)
    experts = counts.total["routed_experts"]
    others = counts.total_params - experts
    local_experts = experts / ep_size
    dp, edp = world_size, world_size // ep_size
    w, g, k = _state_bytes(precision)
    if immediate_grad_update and precision == "bf16" and zero_stage == 1:
        g = 0
    grads_div = (dp, edp) if zero_stage >= 2 else (1, 1)
    optim_div = (dp, edp) if zero_stage >= 1 else (1, 1)
    act = activation_bytes(
        cfg, micro_batch_size, seq_len, precision, recompute, every_n_blocks, ep_size, compiled
    )
    return MemoryPlan(
        world_size=world_size,
        expert_parallel_size=ep_size,
        zero_stage=zero_stage,
        precision=precision,
        recompute=recompute,
        params_per_gpu=others + local_experts,
        weights_bytes=w * (others + local_experts),
        grads_bytes=g * (others / grads_div[0] + local_experts / grads_div[1]),
        optimizer_bytes=k * (others / optim_div[0] + local_experts / optim_div[1]),
        activation_bytes=act.saved_bytes,
        transient_bytes=act.transient_bytes,
        attention_mask_bytes=act.attention_mask_bytes,
    )


FROZEN_BASE_METHODS = ("lora", "qlora", "adapter", "prompt", "prefix")
"""Fine-tuning methods whose base model keeps no optimizer state (finetune.method)."""


def checkpoint_bytes(
    cfg: ModelConfig,
    precision: str,
    zero_stage: int,
    ep_size: int = 1,
    finetune_method: str = "none",
) -> float:
    """Bytes of one saved checkpoint, every rank's files together, for its tensors: the weights
    at the training precision (the model states and one file per expert) and the optimizer
    state of what trains. Under ZeRO 1 or 2 the partitions add up to one fp32 master copy plus
    Adam's two moments, 12 bytes per parameter in fp32 and bf16 alike. Without ZeRO (fp32)
    DeepSpeed writes a rank's whole Adam state (8 bytes per parameter it holds: the others and
    its 1/ep_size of the routed experts) once per expert-parallel rank and once more, rank 0's,
    with the model states. A frozen base (FROZEN_BASE_METHODS) has no optimizer state, and the
    adapters' own states are left out (a small share of the base); ESFT counts every expert.
    RNG states, the config and the tokenizer copy come on top."""
    counts = count_parameters(cfg)
    params = counts.total_params
    weight = _state_bytes(precision)[0]
    if finetune_method in FROZEN_BASE_METHODS:
        return float(weight * params)
    if zero_stage >= 1:
        return float(weight * params + 12 * params)
    experts = counts.total["routed_experts"]
    per_rank = params - experts + experts / ep_size
    return float(weight * params + 8 * per_rank * (ep_size + 1))


def routed_copies(cfg: ModelConfig, tokens: int) -> int:
    """N: routed token copies an MoE layer keeps (per rank, balanced) for ``tokens`` tokens."""
    moe = cfg.moe
    n = tokens * moe.router.top_k
    if moe.capacity_factor is not None:
        n = min(
            n,
            moe.num_experts
            * capacity(tokens, moe.num_experts, moe.router.top_k, moe.capacity_factor),
        )
    return n


def _norm(cfg: ModelConfig, T: int, e: int, selective: bool) -> float:
    """A norm's saved bytes, its output (kept by the next linear) included."""
    D = cfg.d_model
    if selective:
        return 2 * e * T * D
    internals = 4 * T * D + 4 * T if cfg.norm == "rmsnorm" else 8 * T
    return 4 * T * D + internals + e * T * D


def _ffn(T: int, width: int, swiglu: bool, e: int, selective: bool) -> float:
    """A dense FFN's saved bytes, its input excluded."""
    act_in = (2 if swiglu else 1) * width
    if selective:
        return e * T * (act_in + width)
    return e * T * (act_in + (width if swiglu else 0) + width)


def _qk_norm(cfg: ModelConfig, T: int, e: int, mode: str) -> float:
    """What the query and key norms (``model.qk_norm``) keep: selective recompute keeps their
    input only and runs them again in the backward; compiled, inductor rebuilds them from their
    input and statistics."""
    if cfg.qk_norm == "none":
        return 0.0
    H, Hkv, hd = cfg.n_heads, cfg.kv_heads, cfg.head_size
    width = (H + Hkv) * hd
    if mode == "selective":
        return e * T * width
    per_head = cfg.qk_norm == "head"
    stats = 4 * T * (H + Hkv if per_head else 2)  # each row's fp32 rsqrt
    if mode == "compiled":
        return e * T * width + stats
    weights = 0 if e == 4 else 4 * (2 * hd if per_head else width)  # the fp32 weight copies
    return 8 * T * width + stats + weights


def _attention(cfg: ModelConfig, B: int, S: int, e: int, mode: str, mask_per_layer: float) -> float:
    T, H, hd = B * S, cfg.n_heads, cfg.head_size
    qkv_o = e * T * hd * (H + 2 * cfg.kv_heads) + e * T * H * hd
    qkv_o += _qk_norm(cfg, T, e, mode)
    if mode == "selective":
        return qkv_o
    return qkv_o + e * T * H * hd + 4 * T * H + mask_per_layer


def _router(cfg: ModelConfig, T: int, e: int) -> float:
    r, E, K, D = cfg.moe.router, cfg.moe.num_experts, cfg.moe.router.top_k, cfg.d_model
    out = 4 * T * D + 8 * T * E + 4 * T + 8 * T * K
    out += 4 * T * K * (r.order == "topk_then_softmax")
    out += (4 * T * K + 4 * T) * r.renormalize + 4 * T * (r.score_func == "sigmoid")
    if e != 4:
        out += 4 * E * D  # the fp32 copy of the router weight
    return out


def _experts(cfg: ModelConfig, N: int, e: int, mode: str) -> float:
    moe, D = cfg.moe, cfg.d_model
    Hx, swiglu = moe.expert_hidden, moe.activation == "swiglu"
    # The combine's scatter-add keeps its rows; compiled, inductor rebuilds them for the combine
    # weights' gradient from what the experts' backward keeps anyway.
    kept_out = D if moe.permute != "gather" and mode != "compiled" else 0  # auto: index_add
    if mode == "full":
        return e * N * (D + kept_out) + 4 * N
    act_in = (2 if swiglu else 1) * Hx
    if mode in ("selective", "compiled"):  # the activation's intermediates rebuilt in backward
        inner = act_in + Hx
    else:
        inner = act_in + (Hx if swiglu else 0) + Hx + (Hx if Hx <= D else 0)
    if Hx <= D:  # the combine weight scales the (N, Hx) activation
        return e * N * (D + inner + kept_out) + 4 * N
    # the weight is applied to the (N, D) output
    return e * N * (D + inner + D + kept_out) + 4 * N


def _moe_block_ffn(cfg: ModelConfig, T: int, e: int, mode: str, ep_size: int) -> float:
    """An MoE layer's saved bytes, router and dispatch included, its norm excluded."""
    moe = cfg.moe
    N = routed_copies(cfg, T)
    out = _router(cfg, T, e) + 16 * N + (8 * N if ep_size > 1 else 0)
    if moe.permute == "gather":  # the inverse of the sort (8TK) in place of the sorted copies'
        out += 8 * T * moe.router.top_k - 8 * N  # ids (8N), which no gradient needs then
    out += _experts(cfg, N, e, mode)
    shared = moe.num_shared_experts * moe.expert_hidden
    if shared:
        out += e * T * cfg.d_model if e != 4 else 0  # bf16 norm output read by the shared FFN
        if mode != "full":
            rebuilt = mode in ("selective", "compiled")
            out += _ffn(T, shared, moe.activation == "swiglu", e, rebuilt)
    return out


def _block(
    cfg: ModelConfig, i: int, B: int, S: int, e: int, mode: str, ep_size: int, mask_per_layer: float
) -> float:
    T, D = B * S, cfg.d_model
    # Compiled blocks (train.compile): inductor's partitioner rebuilds the norms and the
    # activation functions in the backward as selective recompute does, and keeps the
    # attention core's output as eager does.
    sel = mode in ("selective", "compiled")
    if cfg.is_moe_layer(i):
        ffn = _moe_block_ffn(cfg, T, e, mode, ep_size)
        if mode == "full":
            return e * T * D + ffn
        # The FFN norm's output is the router's fp32 input in fp32 (counted there); in bf16
        # the router keeps an fp32 copy and the output itself only when shared experts read it.
        ffn_norm = _norm(cfg, T, e, sel) - e * T * D
        return (
            _norm(cfg, T, e, sel) + _attention(cfg, B, S, e, mode, mask_per_layer) + ffn_norm + ffn
        )
    if mode == "full":
        return e * T * D
    width = cfg.moe.dense_width
    return (
        2 * _norm(cfg, T, e, sel)
        + _attention(cfg, B, S, e, mode, mask_per_layer)
        + _ffn(T, width, cfg.moe.activation == "swiglu", e, sel)
    )


def attention_masks(cfg: ModelConfig, B: int, S: int, e: int) -> tuple[float, float]:
    """(bytes per layer, bytes once) of the (S, S) masks SDPA keeps with the back end training
    runs on CUDA: a document mask is converted to the model dtype by every layer's SDPA call;
    a bias is built once in fp32 ((1, H, S, S), (B, H, S, S) with documents) and cast per layer
    in bf16."""
    bias = cfg.position in ("alibi", "t5")
    run, _ = choose_backend(
        cfg.attention_backend, "cuda", cfg.document_masking, bias, cached=False, grad=True, length=S
    )
    if run != "reference" or not (bias or cfg.document_masking):
        return 0.0, 0.0
    if not bias:
        return e * B * S * S, 0.0
    size = (B if cfg.document_masking else 1) * cfg.n_heads * S * S
    return (0.0, 4 * size) if e == 4 else (e * size, 4 * size)


def activation_bytes(
    cfg: ModelConfig,
    micro_batch_size: int,
    seq_len: int,
    precision: str = "fp32",
    recompute: str = "none",
    every_n_blocks: int = 1,
    ep_size: int = 1,
    compiled: bool = False,
) -> ActivationEstimate:
    """What one micro-batch keeps for the backward (see the module docstring for each term);
    ``compiled``: the blocks run compiled (train.compile), those not recomputed keep less."""
    if recompute not in MODES:
        raise ValueError(f"recompute mode {recompute!r} is not one of {', '.join(MODES)}")
    e = elem_bytes(precision)
    B, S, D = micro_batch_size, seq_len, cfg.d_model
    T, hd = B * S, D // cfg.n_heads
    mask, mask_once = attention_masks(cfg, B, S, e)
    saved, rebuilt = 0.0, 0.0
    for i in range(cfg.n_layers):
        mode = recompute if i % every_n_blocks == 0 else "none"
        if mode == "none":
            saved += _block(cfg, i, B, S, e, "compiled" if compiled else "none", ep_size, mask)
            continue
        kept = _block(cfg, i, B, S, e, mode, ep_size, mask)
        saved += kept
        rebuilt = max(rebuilt, _block(cfg, i, B, S, e, "none", ep_size, mask) - kept)
    rotary = 4 * S * hd * (B if cfg.document_masking else 1) if cfg.position == "rope" else 0
    final_norm = _norm(cfg, T, e, False) if cfg.norm_placement == "pre" else e * T * D
    head_saved, logits = _head_loss(cfg, T, e)
    saved += 16 * T + rotary + final_norm + head_saved + mask_once
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    N = routed_copies(cfg, T)
    alltoall = (2 * e * N * D + 8 * N) if ep_size > 1 and n_moe else 0.0
    kept_masks = (
        cfg.n_layers
        if recompute == "none"
        else sum(i % every_n_blocks != 0 for i in range(cfg.n_layers))
    )
    masks = mask * kept_masks + mask_once
    return ActivationEstimate(
        saved_bytes=saved,
        transient_bytes=max(logits, rebuilt) + alltoall,
        attention_mask_bytes=masks,
        alltoall_bytes=alltoall,
    )


def liger_chunk_tokens(T: int, V: int, D: int) -> int:
    """Liger-Kernel's block size (0.8.5): the smallest power of two holding T / ceil(V / D)
    tokens, at most T."""
    blocks = -(-V // D)
    return min(T, 1 << max(0, math.ceil(math.log2(-(-T // blocks)))))


def _head_loss(cfg: ModelConfig, T: int, e: int) -> tuple[float, float]:
    """(kept for the backward beyond the final norm, working set) of the head and the loss."""
    V, D = cfg.vocab_size, cfg.d_model
    if cfg.cross_entropy in ("full", "auto"):  # auto, unresolved: what the model computes
        return 4 * T * V, T * V * (2 * e + 4)
    kept = 4 * V * D  # the weight's fp32 gradient; the hidden states' takes the norm output's place
    if cfg.cross_entropy == "chunked":
        C = min(cfg.cross_entropy_chunk_tokens, T)
        return kept, 8 * C * V + e * V * D
    return kept, liger_chunk_tokens(T, V, D) * V * e + e * V * D


def compute_factor(
    cfg: ModelConfig, seq_len: int, recompute: str, every_n_blocks: int = 1
) -> float:
    """Training FLOPs with recompute over training FLOPs without (module docstring)."""
    f = flops_per_token(cfg, seq_len)
    share = math.ceil(cfg.n_layers / every_n_blocks) / cfg.n_layers  # blocks that recompute
    if recompute == "full":
        blocks = f["forward"] - 2 * cfg.vocab_size * cfg.d_model  # the head is not recomputed
        return 1 + share * blocks / f["training"]
    if recompute == "selective":
        return 1 + share * f["attention_forward"] / f["training"]
    return 1.0


@dataclass
class Layout:
    expert_parallel_size: int
    zero_stage: int
    recompute: str
    micro_batch_size: int
    grad_accum_steps: int
    memory: MemoryPlan
    compute_factor: float
    comm_bytes: float
    """Bytes each GPU sends per optimizer step: expert all-to-alls and gradient reduction."""

    @property
    def sort_key(self):
        return (
            round(self.compute_factor, 4),
            -self.micro_batch_size,
            self.comm_bytes,
            self.zero_stage,
        )


def comm_bytes_per_step(
    cfg: ModelConfig,
    world: int,
    ep: int,
    zero: int,
    precision: str,
    micro_batch_size: int,
    accum: int,
    seq_len: int,
) -> float:
    """Expert all-to-all (dispatch and combine, forward and backward, the share that leaves the
    rank) and the gradient reduction (ring all-reduce 2x the gradients once per step for ZeRO
    0/1; ZeRO-2 reduce-scatters every micro-batch and all-gathers the updated parameters)."""
    e = elem_bytes(precision)
    counts = count_parameters(cfg)
    experts = counts.total["routed_experts"]
    held = counts.total_params - experts + experts / ep
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    N = routed_copies(cfg, micro_batch_size * seq_len)
    a2a = 4 * n_moe * N * cfg.d_model * e * (ep - 1) / ep * accum
    grad = held * e
    frac = (world - 1) / world if world > 1 else 0.0
    reduce = 2 * grad * frac if zero < 2 else grad * frac * (accum + 1)
    return a2a + reduce


def fitting_layouts(
    cfg: ModelConfig,
    gpus: int,
    gpu_memory_gib: float,
    seq_len: int,
    global_batch: int,
    precision: str,
    every_n_blocks: int = 1,
    compiled: bool = False,
) -> tuple[list[Layout], list[Layout]]:
    """(layouts that fit, ordered best first; all layouts considered, smallest peak first).
    ``global_batch``: sequences per optimizer step, kept by gradient accumulation;
    ``compiled``: the blocks run compiled (train.compile)."""
    budget = USABLE_FRACTION * gpu_memory_gib * GIB
    E = cfg.moe.num_experts if cfg.ffn == "moe" else 1
    eps = [ep for ep in range(1, gpus + 1) if gpus % ep == 0 and E % ep == 0]
    zeros = (1, 2) if precision == "bf16" else (0, 1, 2)
    considered = []
    for mb in MICRO_BATCHES:
        if global_batch % (mb * gpus):
            continue
        accum = global_batch // (mb * gpus)
        for ep in eps:
            for zero in zeros:
                for mode in MODES:
                    m = memory_per_gpu(
                        cfg,
                        gpus,
                        ep,
                        zero,
                        precision,
                        mb,
                        seq_len,
                        mode,
                        every_n_blocks,
                        compiled=compiled,
                    )
                    considered.append(
                        Layout(
                            ep,
                            zero,
                            mode,
                            mb,
                            accum,
                            m,
                            compute_factor(cfg, seq_len, mode, every_n_blocks),
                            comm_bytes_per_step(cfg, gpus, ep, zero, precision, mb, accum, seq_len),
                        )
                    )
    fits = sorted(
        (lay for lay in considered if lay.memory.total_bytes <= budget),
        key=lambda lay: lay.sort_key,
    )
    return fits, sorted(considered, key=lambda lay: lay.memory.total_bytes)
