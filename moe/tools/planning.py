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

Fine-tuning (``finetune.method``, :func:`finetune_plan`). The parameters are counted on the
model the trainer trains: built on the meta device, its adapters added and its weights frozen by
``prepare_finetune`` itself, and for qlora its base replaced by the NF4 buffers ``quantize_base``
registers (0.5 byte a value for the codes, int8 scales per 64 values, fp32 factors and means,
each matrix padded to 64 x 256 values). Frozen parameters are held in the model dtype (qlora's
quantised ones in those buffers), with no gradient and no optimizer state; what trains (LoRA
factors, adapters, prompt and prefix vectors, everything for full) gets gradients and optimizer
states as above, routed-expert parameters (expert LoRA factors, ESFT's stacks) split as the
experts are. ESFT holds gradients and Adam states for the whole routed-expert stacks: the
unselected experts' rows get zero gradients and stay zero, but are held all the same.
Activations (:class:`Trains`): an op keeps a tensor only for a gradient that is needed, so a
frozen product does not keep its input (the norm output before the query, key and value
projections, one fused product or three; the attention core's output
before the output projection; the dispatched rows; the expert activation; the head's input), a
frozen norm not its normalized rows, a frozen router not its fp32 input, a frozen embedding not
the token ids, and nothing before the first thing that trains keeps anything (ESFT: the first
MoE layer's attention half and router; LoRA on the attention: the first block's norm).
A LoRA branch keeps its input (the one copy the base product would keep) and its (rows, rank)
product (the rank padded as the grouped kernel takes it for experts); with dropout it keeps the
dropped copy instead, and the mask where the input needs a gradient (a bool on CUDA, a noise
tensor of the input's dtype on the CPU). A bottleneck adapter keeps its input and GELU's input
and output, e T (D + 2 m). A soft prompt makes every sequence n positions longer, through the
head and the loss; prefixes make the keys and values S + n long and add a (1, 1, S, S + n) mask
per layer (SDPA's copy in the model dtype; selective recompute: the bool mask its core region
holds). ``tests/moe/tools/test_planning_finetune.py`` holds every method to 3% of what a step
keeps (most exactly), and its model states to what DeepSpeed's engine holds. Compiled blocks of
a fine-tuning run (``train.compile`` set; the adapter methods keep eager blocks by default) are
planned as their eager terms with inductor's savings applied as for pretraining: within 0.98-1.04x
of what they keep on the CPU, over every method and four shapes (the same file). Not modelled:
the compute factor (a frozen weight skips its gradient's product in the backward; the layouts
are ordered as for pretraining).

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

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from moe.config.run import FinetuneConfig
from moe.model.adapters.lora import kernel_rank
from moe.model.adapters.qlora import nf4_modules, quantize_base, quantized_numel
from moe.model.attention import choose_backend
from moe.model.experts import GroupedExperts
from moe.model.router import capacity
from moe.model.size import count_parameters, flops_per_token
from moe.model.transformer import ModelConfig, MoETransformer
from moe.training.finetune import prepare_finetune

MODES = ("none", "selective", "full")
MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
USABLE_FRACTION = 0.9
GIB = 2**30


@dataclass(frozen=True)
class Weight:
    """How one kind of weight trains: in full, through LoRA factors of rank ``lora_rank``
    (``dropout``: finetune.lora.dropout > 0), or not at all (``FROZEN``)."""

    full: bool = True
    lora_rank: int = 0
    dropout: bool = False

    @property
    def trains(self) -> bool:
        """Something in its product gets a gradient: its output needs one."""
        return self.full or self.lora_rank > 0

    @property
    def keeps_input(self) -> bool:
        """Its product keeps its input: for the weight's gradient, or for the LoRA factor A's
        (with dropout, A keeps the dropped copy instead, counted by :func:`_lora`)."""
        return self.full or (self.lora_rank > 0 and not self.dropout)


FROZEN = Weight(full=False)


@dataclass(frozen=True)
class Trains:
    """What gets a gradient in a training step, as far as what the forward keeps for the
    backward depends on it (module docstring, "Fine-tuning"). The default, everything, is
    pretraining and finetune.method full."""

    embedding: bool = True
    norms: bool = True
    head: bool = True
    q: Weight = Weight()
    k: Weight = Weight()
    v: Weight = Weight()
    o: Weight = Weight()
    ffn_in: Weight = Weight()
    """The dense FFN layers' ``w_in`` (and ``ffn_out`` their ``w_out``)."""
    ffn_out: Weight = Weight()
    shared_in: Weight = Weight()
    shared_out: Weight = Weight()
    experts_in: Weight = Weight()
    experts_out: Weight = Weight()
    router: Weight = Weight()
    adapter_hidden: int = 0
    adapter_after: tuple[str, ...] = ()
    """Bottleneck adapters of width ``adapter_hidden`` after "attention" and/or "ffn"."""
    prompt_tokens: int = 0
    prefix_tokens: int = 0

    def attention_trains(self) -> bool:
        """Something in a block's attention half (its norm, projections, prefixes, adapter)."""
        projections = (self.q, self.k, self.v, self.o)
        return (
            self.norms
            or any(w.trains for w in projections)
            or self.prefix_tokens > 0
            or "attention" in self.adapter_after
        )

    def ffn_trains(self, moe: bool) -> bool:
        """Something in a block's feed-forward half (an MoE layer's if ``moe``)."""
        weights = (
            (self.router, self.experts_in, self.experts_out, self.shared_in, self.shared_out)
            if moe
            else (self.ffn_in, self.ffn_out)
        )
        return self.norms or any(w.trains for w in weights) or "ffn" in self.adapter_after


EVERYTHING = Trains()

_LORA_WEIGHTS = {
    "attention.q": ("q",),
    "attention.k": ("k",),
    "attention.v": ("v",),
    "attention.o": ("o",),
    "ffn": ("ffn_in", "ffn_out"),
    "shared_experts": ("shared_in", "shared_out"),
    "experts": ("experts_in", "experts_out"),
    "router": ("router",),
}
_ADAPTER_AFTER = {"attention": ("attention",), "ffn": ("ffn",), "both": ("attention", "ffn")}


def trains_of(cfg: ModelConfig, ft: FinetuneConfig) -> Trains:
    """What ``ft.method`` trains in ``cfg``'s model (docs/finetuning.md): ESFT the whole routed
    expert stacks (the unselected experts' rows get zero gradients, but gradients all the
    same), the adapter methods their additions only, LoRA and QLoRA their factors (and the
    routers with ``train_router``)."""
    if ft.method in ("none", "full"):
        return EVERYTHING
    frozen = {name: FROZEN for names in _LORA_WEIGHTS.values() for name in names}
    base = Trains(
        embedding=False,
        norms=False,
        head=False,
        **frozen,
    )
    if ft.method == "esft":
        return dataclasses.replace(base, experts_in=Weight(), experts_out=Weight())
    if ft.method == "adapter":
        after = _ADAPTER_AFTER[ft.adapter.placement]
        return dataclasses.replace(base, adapter_hidden=ft.adapter.hidden, adapter_after=after)
    if ft.method in ("prompt", "prefix"):
        n = getattr(ft, ft.method).tokens
        return dataclasses.replace(base, **{f"{ft.method}_tokens": n})
    lora, dropout = ft.lora, ft.lora.dropout > 0
    adapted = {
        name: Weight(False, lora.expert_rank_of(cfg.moe.router.top_k), dropout)
        if target == "experts"
        else Weight(False, lora.rank, dropout)
        for target in lora.targets
        for name in _LORA_WEIGHTS[target]
    }
    if lora.train_router:
        adapted["router"] = dataclasses.replace(adapted.get("router", FROZEN), full=True)
    return dataclasses.replace(base, **adapted)


@dataclass(frozen=True)
class Share:
    """A count outside the routed experts and in them (split over expert parallelism)."""

    others: float = 0
    experts: float = 0

    def per_rank(self, ep_size: int) -> float:
        return self.others + self.experts / ep_size


@dataclass(frozen=True)
class FinetunePlan:
    """What a fine-tuning run (finetune.method) holds, counted on its model as the trainer
    prepares it (:func:`finetune_plan`)."""

    method: str
    trainable: Share
    """Parameters with gradients and optimizer states (ESFT: the whole routed-expert stacks)."""
    frozen: Share
    """Parameters held in the model dtype, with no gradient or optimizer state."""
    nf4_values: Share = field(default_factory=Share)
    """Frozen weights held in NF4 (qlora): values, and their bytes as stored."""
    nf4_bytes: Share = field(default_factory=Share)
    trains: Trains = EVERYTHING

    @property
    def trainable_params(self) -> float:
        return self.trainable.per_rank(1)

    @property
    def frozen_params(self) -> float:
        return self.frozen.per_rank(1) + self.nf4_values.per_rank(1)


def finetune_plan(cfg: ModelConfig, ft: FinetuneConfig) -> FinetunePlan | None:
    """What ``ft``'s method trains and freezes in ``cfg``'s model, counted on the model itself:
    built on the meta device (shapes only), its adapters added and its weights frozen by the
    trainer's own :func:`~moe.training.finetune.prepare_finetune`, and for qlora its base
    replaced by the NF4 buffers :func:`~moe.model.adapters.qlora.quantize_base` registers.
    None for method none (pretraining)."""
    if ft.method == "none":
        return None
    ft = dataclasses.replace(ft, lora=dataclasses.replace(ft.lora, init_from=None))
    with torch.device("meta"):
        model = MoETransformer(cfg)
        prepare_finetune(model, ft)
        if ft.method == "qlora":
            quantize_base(model, quantize=False)  # empty buffers of the real shapes and dtypes
    counts = {key: [0, 0] for key in ("trainable", "frozen", "nf4_values", "nf4_bytes")}
    expert_ids = {
        id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()
    }
    for p in model.parameters():
        counts["trainable" if p.requires_grad else "frozen"][id(p) in expert_ids] += p.numel()
    for m in nf4_modules(model):
        stacked = isinstance(m, GroupedExperts)
        counts["nf4_values"][stacked] += quantized_numel(m)
        parts = m.buffers(recurse=False)  # its own buffers are the NF4 parts
        counts["nf4_bytes"][stacked] += sum(b.numel() * b.element_size() for b in parts)
    return FinetunePlan(
        ft.method,
        **{key: Share(*value) for key, value in counts.items()},
        trains=trains_of(cfg, ft),
    )


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
    finetune: FinetunePlan | None = None,
) -> MemoryPlan:
    """``immediate_grad_update`` (train.immediate_grad_update, bf16 at ZeRO stage 1): no bf16
    gradient is kept, each is folded into DeepSpeed's accumulation buffer as it is produced.
    ``compiled`` (train.compile): the blocks not recomputed keep what inductor keeps.
    ``finetune`` (:func:`finetune_plan`): gradients and optimizer states for what trains only,
    frozen weights in the model dtype or NF4, and the activations of what trains."""
    plan = finetune or _pretraining(cfg)
    dp, edp = world_size, world_size // ep_size
    w, g, k = _state_bytes(precision)
    if immediate_grad_update and precision == "bf16" and zero_stage == 1:
        g = 0
    grads_div = (dp, edp) if zero_stage >= 2 else (1, 1)
    optim_div = (dp, edp) if zero_stage >= 1 else (1, 1)
    act = activation_bytes(
        cfg,
        micro_batch_size,
        seq_len,
        precision,
        recompute,
        every_n_blocks,
        ep_size,
        compiled,
        plan.trains,
    )
    floats = plan.trainable.per_rank(ep_size) + plan.frozen.per_rank(ep_size)
    trained = plan.trainable
    return MemoryPlan(
        world_size=world_size,
        expert_parallel_size=ep_size,
        zero_stage=zero_stage,
        precision=precision,
        recompute=recompute,
        params_per_gpu=floats + plan.nf4_values.per_rank(ep_size),
        weights_bytes=w * floats + plan.nf4_bytes.per_rank(ep_size),
        grads_bytes=g * (trained.others / grads_div[0] + trained.experts / ep_size / grads_div[1]),
        optimizer_bytes=k
        * (trained.others / optim_div[0] + trained.experts / ep_size / optim_div[1]),
        activation_bytes=act.saved_bytes,
        transient_bytes=act.transient_bytes,
        attention_mask_bytes=act.attention_mask_bytes,
    )


def _pretraining(cfg: ModelConfig) -> FinetunePlan:
    """Every parameter trains."""
    counts = count_parameters(cfg)
    experts = counts.total["routed_experts"]
    return FinetunePlan("none", Share(counts.total_params - experts, experts), Share())


def checkpoint_bytes(
    cfg: ModelConfig,
    precision: str,
    zero_stage: int,
    ep_size: int = 1,
    finetune: FinetunePlan | None = None,
) -> float:
    """Bytes of one saved checkpoint, every rank's files together, for its tensors: the weights
    at the training precision (the model states and one file per expert; a qlora base in NF4)
    and the optimizer state of what trains. Under ZeRO 1 or 2 the partitions add up to one fp32
    master copy plus Adam's two moments, 12 bytes per trained parameter in fp32 and bf16
    alike. Without ZeRO (fp32) DeepSpeed writes a rank's whole Adam state (8 bytes per trained
    parameter it holds: the others and its 1/ep_size of the routed experts) once per
    expert-parallel rank and once more, rank 0's, with the model states. ``finetune``
    (:func:`finetune_plan`): frozen parameters have no optimizer state. RNG states, the config
    and the tokenizer copy come on top."""
    plan = finetune or _pretraining(cfg)
    trained = plan.trainable.per_rank(1)
    params = trained + plan.frozen.per_rank(1)
    weights = _state_bytes(precision)[0] * params + plan.nf4_bytes.per_rank(1)
    if zero_stage >= 1:
        return float(weights + 12 * trained)
    return float(weights + 8 * plan.trainable.per_rank(ep_size) * (ep_size + 1))


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


def _norm(
    cfg: ModelConfig,
    T: int,
    e: int,
    selective: bool,
    grad_in: bool = True,
    weight: bool = True,
    out_kept: bool = True,
) -> float:
    """A norm's saved bytes: what its input's gradient needs (``grad_in``), its weight's
    (``weight``), and its output where the next product keeps it (``out_kept``)."""
    D = cfg.d_model
    out = e * T * D if out_kept else 0
    if not (grad_in or weight):
        return out
    if selective:
        return e * T * D + out
    if cfg.norm == "layernorm":  # one backward for input, weight and bias keeps all it reads
        return 4 * T * D + 8 * T + out
    # the fp32 input and the rsqrt for the input's gradient, the normalized rows for the weight's
    return (4 * T * D + 4 * T) * grad_in + 4 * T * D * weight + out


DROPOUT_MASK_BYTES = 1
"""Per element of a LoRA branch's input under dropout, when that input needs a gradient: CUDA's
fused dropout keeps a bool mask (the CPU's keeps a noise tensor of the input's dtype)."""


def _lora(
    w: Weight, rows: int, width_in: int, e: int, rank: int = 0, grad_in: bool = True
) -> float:
    """What a LoRA branch keeps beyond its input: the (rows, rank) product its factor B keeps
    (``rank``: the rank as computed, if padded), and with dropout the dropped copy of the input
    that A keeps and, if the input needs a gradient, dropout's mask."""
    if not w.lora_rank:
        return 0
    dropped = (e + DROPOUT_MASK_BYTES * grad_in) * rows * width_in if w.dropout else 0
    return e * rows * (rank or w.lora_rank) + dropped


def _ffn(
    T: int,
    width: int,
    swiglu: bool,
    e: int,
    selective: bool,
    D: int = 0,
    grad_in: bool = True,
    w_in: Weight = EVERYTHING.ffn_in,
    w_out: Weight = EVERYTHING.ffn_out,
) -> float:
    """A dense FFN's saved bytes, its input (width ``D``) excluded."""
    act_in = (2 if swiglu else 1) * width
    kept = act_in + (width if swiglu and not selective else 0)  # and silu(gate)
    h_grad = grad_in or w_in.trains
    out = e * T * kept if h_grad else 0
    out += e * T * width if w_out.keeps_input else 0
    return out + _lora(w_in, T, D, e, 0, grad_in) + _lora(w_out, T, width, e, 0, h_grad)


def _qk_norm(cfg: ModelConfig, T: int, e: int, mode: str, weight: bool = True) -> float:
    """What the query and key norms (``model.qk_norm``) keep: selective recompute keeps their
    input only and runs them again in the backward; compiled, inductor rebuilds them from their
    input and statistics; a frozen ``weight`` needs no normalized rows."""
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
    return (4 + 4 * weight) * T * width + stats + weights


def _attention(
    cfg: ModelConfig,
    B: int,
    S: int,
    e: int,
    mode: str,
    mask_per_layer: float,
    tr: Trains = EVERYTHING,
    grad_in: bool = True,
) -> float:
    T, H, Hkv, hd = B * S, cfg.n_heads, cfg.kv_heads, cfg.head_size
    L = S + tr.prefix_tokens  # keys and values: prefix tuning's in front of the sequence's
    qkv_grad = grad_in or any(w.trains for w in (tr.q, tr.k, tr.v)) or tr.prefix_tokens > 0
    out = e * hd * (H * T + 2 * Hkv * B * L) if qkv_grad else 0
    out += e * T * H * hd if tr.o.keeps_input else 0  # the output projection's input
    out += sum(_lora(w, T, cfg.d_model, e, 0, grad_in) for w in (tr.q, tr.k, tr.v))
    out += _lora(tr.o, T, H * hd, e, 0, qkv_grad)
    if grad_in or tr.q.trains or tr.k.trains:
        out += _qk_norm(cfg, T, e, mode, tr.norms)
    if not qkv_grad:
        return out
    if mode == "selective":  # the core's region keeps prefix tuning's (1, 1, S, L) bool mask
        return out + (S * L if tr.prefix_tokens else 0)
    if tr.prefix_tokens:  # SDPA keeps a float copy of it; a reference mask grows to L keys
        mask_per_layer = mask_per_layer * L / S if mask_per_layer else e * S * L
    return out + e * T * H * hd + 4 * T * H + mask_per_layer


def _router(
    cfg: ModelConfig, T: int, e: int, grad_in: bool = True, w: Weight = EVERYTHING.router
) -> float:
    r, E, K, D = cfg.moe.router, cfg.moe.num_experts, cfg.moe.router.top_k, cfg.d_model
    out = 4 * T * D if w.keeps_input else 0  # its fp32 input, for the weight's gradient
    out += _lora(w, T, D, 4, 0, grad_in)  # fp32, as the router
    if not (grad_in or w.trains):
        return out
    out += 8 * T * E + 4 * T + 8 * T * K
    out += 4 * T * K * (r.order == "topk_then_softmax")
    out += (4 * T * K + 4 * T) * r.renormalize + 4 * T * (r.score_func == "sigmoid")
    if e != 4 and grad_in:
        out += 4 * E * D  # the fp32 copy of the router weight, for the input's gradient
    return out


def _experts(
    cfg: ModelConfig,
    N: int,
    e: int,
    mode: str,
    rows_grad: bool = True,
    scale_grad: bool = True,
    w_in: Weight = EVERYTHING.experts_in,
    w_out: Weight = EVERYTHING.experts_out,
) -> float:
    """The routed experts' saved bytes; ``rows_grad`` and ``scale_grad``: the dispatched rows
    and the combine weights need gradients."""
    moe, D = cfg.moe, cfg.d_model
    Hx, swiglu = moe.expert_hidden, moe.activation == "swiglu"
    h_grad = rows_grad or w_in.trains
    y_grad = h_grad or w_out.trains or scale_grad
    # The combine's scatter-add keeps its rows; compiled, inductor rebuilds them for the combine
    # weights' gradient from what the experts' backward keeps anyway.
    keep_out = moe.permute != "gather" and mode != "compiled" and y_grad  # auto: index_add
    kept_out = D if keep_out else 0
    rows = D if w_in.keeps_input else 0
    kr = kernel_rank(w_in.lora_rank or w_out.lora_rank, torch.bfloat16 if e == 2 else torch.float32)
    if mode == "full":  # the region keeps its inputs
        region = rows_grad or scale_grad or w_in.trains or w_out.trains
        return e * N * (D * region + kept_out) + 4 * N * region
    lora = _lora(w_in, N, D, e, kr, rows_grad) + _lora(w_out, N, Hx, e, kr, h_grad or scale_grad)
    act_in = (2 if swiglu else 1) * Hx
    rebuilt = mode in ("selective", "compiled")  # the activation's intermediates rebuilt
    # The activation keeps its input (and silu(gate)); selective, its region keeps its inputs.
    kept_in = h_grad or (rebuilt and scale_grad and Hx <= D)
    inner = act_in + (Hx if swiglu and not rebuilt else 0) if kept_in else 0
    out_in = Hx if w_out.keeps_input else 0  # the output projection's input
    if Hx <= D:  # the combine weight scales the (N, Hx) activation
        inner += (Hx if scale_grad and not rebuilt else 0) + out_in
        scale = 4 * N if h_grad or (rebuilt and scale_grad) else 0
        return e * N * (rows + inner + kept_out) + scale + lora
    # the weight is applied to the (N, D) output
    y_kept = D if scale_grad else 0
    return e * N * (rows + inner + out_in + y_kept + kept_out) + 4 * N * y_grad + lora


def _moe_block_ffn(
    cfg: ModelConfig,
    T: int,
    e: int,
    mode: str,
    ep_size: int,
    tr: Trains = EVERYTHING,
    grad_in: bool = True,
) -> float:
    """An MoE layer's saved bytes, router and dispatch included, its norm excluded."""
    moe, D = cfg.moe, cfg.d_model
    N = routed_copies(cfg, T)
    scale_grad = grad_in or tr.router.trains
    y_grad = scale_grad or tr.experts_in.trains or tr.experts_out.trains
    out = _router(cfg, T, e, grad_in, tr.router)
    if moe.permute == "gather":  # the inverse of the sort (8TK) in place of the sorted copies'
        out += 8 * T * moe.router.top_k * scale_grad + 8 * N * y_grad  # ids, no gradient needs
    else:  # the copies' token ids (the gather's and the combine's) and their routing ids
        out += 8 * N * y_grad + 8 * N * scale_grad
    out += 8 * N if ep_size > 1 and scale_grad else 0
    out += _experts(cfg, N, e, mode, grad_in, scale_grad, tr.experts_in, tr.experts_out)
    shared = moe.num_shared_experts * moe.expert_hidden
    if shared:
        trains = tr.shared_in.trains or tr.shared_out.trains
        reads = tr.shared_in.keeps_input or (mode == "full" and (grad_in or trains))
        # The norm output the shared FFN (or its region) keeps: in fp32 the router's input.
        out += e * T * D if reads and (e != 4 or not tr.router.keeps_input) else 0
        if mode != "full":
            rebuilt = mode in ("selective", "compiled")
            swiglu = moe.activation == "swiglu"
            out += _ffn(T, shared, swiglu, e, rebuilt, D, grad_in, tr.shared_in, tr.shared_out)
    return out


def _block(
    cfg: ModelConfig,
    i: int,
    B: int,
    S: int,
    e: int,
    mode: str,
    ep_size: int,
    mask_per_layer: float,
    tr: Trains = EVERYTHING,
    grad_in: bool = True,
) -> float:
    """Block ``i``'s saved bytes; ``grad_in``: its input needs a gradient (something before it
    trains)."""
    T, D = B * S, cfg.d_model
    # Compiled blocks (train.compile): inductor's partitioner rebuilds the norms and the
    # activation functions in the backward as selective recompute does, and keeps the
    # attention core's output as eager does.
    sel = mode in ("selective", "compiled")
    ffn_grad = grad_in or tr.attention_trains()  # the feed-forward's input needs a gradient
    adapter = e * T * (D + 2 * tr.adapter_hidden)  # its input, gelu's input and output
    after_attn = adapter if "attention" in tr.adapter_after else 0
    after_ffn = adapter if "ffn" in tr.adapter_after else 0
    qkv_keep = any(w.keeps_input for w in (tr.q, tr.k, tr.v))
    attn = (
        _norm(cfg, T, e, sel, grad_in, tr.norms, qkv_keep)
        + _attention(cfg, B, S, e, mode, mask_per_layer, tr, grad_in)
        + after_attn
    )
    if cfg.is_moe_layer(i):
        ffn = _moe_block_ffn(cfg, T, e, mode, ep_size, tr, ffn_grad) + after_ffn
        if mode == "full":  # the attention region keeps its input; the MoE layer's adapter is
            return e * T * D * ffn_grad + ffn  # outside every region
        # The FFN norm's output is the router's fp32 input in fp32 (counted there); in bf16
        # the router keeps an fp32 copy and the output itself only when shared experts read it.
        return attn + _norm(cfg, T, e, sel, ffn_grad, tr.norms, False) + ffn
    if mode == "full":
        return e * T * D if ffn_grad or tr.ffn_trains(False) else 0
    swiglu, width = cfg.moe.activation == "swiglu", cfg.moe.dense_width
    return (
        attn
        + _norm(cfg, T, e, sel, ffn_grad, tr.norms, tr.ffn_in.keeps_input)
        + _ffn(T, width, swiglu, e, sel, D, ffn_grad, tr.ffn_in, tr.ffn_out)
        + after_ffn
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
    trains: Trains = EVERYTHING,
) -> ActivationEstimate:
    """What one micro-batch keeps for the backward (see the module docstring for each term);
    ``compiled``: the blocks run compiled (train.compile), those not recomputed keep less;
    ``trains``: what gets gradients (fine-tuning, :func:`trains_of`)."""
    if recompute not in MODES:
        raise ValueError(f"recompute mode {recompute!r} is not one of {', '.join(MODES)}")
    e = elem_bytes(precision)
    # A soft prompt's positions come before every sequence, through the head and the loss.
    B, S, D = micro_batch_size, seq_len + trains.prompt_tokens, cfg.d_model
    T, hd = B * S, D // cfg.n_heads
    mask, mask_once = attention_masks(cfg, B, S, e)
    saved, rebuilt = 0.0, 0.0
    grad = trains.embedding or trains.prompt_tokens > 0  # the first block's input needs one
    rotary_kept = False
    for i in range(cfg.n_layers):
        mode = recompute if i % every_n_blocks == 0 else "none"
        rotary_kept |= grad or trains.q.trains or trains.k.trains
        if mode == "none":
            none = "compiled" if compiled else "none"
            saved += _block(cfg, i, B, S, e, none, ep_size, mask, trains, grad)
        else:
            kept = _block(cfg, i, B, S, e, mode, ep_size, mask, trains, grad)
            saved += kept
            everything = _block(cfg, i, B, S, e, "none", ep_size, mask, trains, grad)
            rebuilt = max(rebuilt, everything - kept)
        grad = grad or trains.attention_trains() or trains.ffn_trains(cfg.is_moe_layer(i))
    rope = cfg.position == "rope" and rotary_kept
    rotary = 4 * S * hd * (B if cfg.document_masking else 1) if rope else 0
    # What the head keeps of the final norm's output (chunked or liger: the hidden states'
    # gradient in its place).
    head_reads = trains.head or cfg.cross_entropy not in ("full", "auto")
    if cfg.norm_placement == "pre":
        final_norm = _norm(cfg, T, e, False, grad, trains.norms, head_reads)
    else:
        final_norm = e * T * D if head_reads else 0
    head_saved, logits = _head_loss(cfg, T, e, trains.head)
    saved += 8 * T * trains.embedding + 8 * T + rotary + final_norm + head_saved + mask_once
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


def _head_loss(cfg: ModelConfig, T: int, e: int, head: bool = True) -> tuple[float, float]:
    """(kept for the backward beyond the final norm, working set) of the head and the loss;
    ``head``: the head weight trains (chunked and liger form its gradient in the forward)."""
    V, D = cfg.vocab_size, cfg.d_model
    if cfg.cross_entropy in ("full", "auto"):  # auto, unresolved: what the model computes
        return 4 * T * V, T * V * (2 * e + 4)
    # The weight's fp32 gradient; the hidden states' takes the norm output's place.
    kept, block_grad = (4 * V * D, e * V * D) if head else (0, 0)
    if cfg.cross_entropy == "chunked":
        C = min(cfg.cross_entropy_chunk_tokens, T)
        return kept, 8 * C * V + block_grad
    return kept, liger_chunk_tokens(T, V, D) * V * e + block_grad


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
    finetune: FinetunePlan | None = None,
) -> float:
    """Expert all-to-all (dispatch and combine, forward and backward, the share that leaves the
    rank) and the gradient reduction (ring all-reduce 2x the gradients once per step for ZeRO
    0/1; ZeRO-2 reduce-scatters every micro-batch and all-gathers the updated parameters), of
    the parameters that train (``finetune``)."""
    e = elem_bytes(precision)
    plan = finetune or _pretraining(cfg)
    held = plan.trainable.per_rank(ep)
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    N = routed_copies(cfg, micro_batch_size * (seq_len + plan.trains.prompt_tokens))
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
    finetune: FinetunePlan | None = None,
    immediate_grad_update: bool = False,
) -> tuple[list[Layout], list[Layout]]:
    """(layouts that fit, ordered best first; all layouts considered, smallest peak first).
    ``global_batch``: sequences per optimizer step, kept by gradient accumulation;
    ``compiled``: the blocks run compiled (train.compile); ``finetune``: what a fine-tuning
    run trains and holds (:func:`finetune_plan`); ``immediate_grad_update``: what a layout at
    ZeRO stage 1 takes for train.immediate_grad_update (no bf16 gradient buffer)."""
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
                        immediate_grad_update=immediate_grad_update,
                        compiled=compiled,
                        finetune=finetune,
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
                            comm_bytes_per_step(
                                cfg, gpus, ep, zero, precision, mb, accum, seq_len, finetune
                            ),
                        )
                    )
    fits = sorted(
        (lay for lay in considered if lay.memory.total_bytes <= budget),
        key=lambda lay: lay.sort_key,
    )
    return fits, sorted(considered, key=lambda lay: lay.memory.total_bytes)
