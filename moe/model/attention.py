"""Causal self-attention with grouped key/value heads (MHA, GQA, MQA), an optional KV cache,
and the four ways (``model.attention_backend``) of computing its core, softmax(q k^T + bias) v:

- ``reference``: PyTorch's ``scaled_dot_product_attention`` (SDPA) with an explicit mask: none
  for plain causal attention (``is_causal``), a bool (B, 1, S, L) mask for documents or a cached
  prefix, a float (B, H, S, L) mask (bias, -inf where masked) for ALiBi and T5 biases. Simple and
  general; the mask is quadratic in the sequence and is kept for backward.
- ``sdpa``: SDPA with ``is_causal`` only, which the fused kernels run without any (S, L)
  tensor; packed documents become one ``is_causal`` call per document. A bias or a cached
  prefix falls back to ``reference`` (logged once).
- ``flex``: ``flex_attention`` with a BlockMask (causal and same document) and the position
  bias as a ``score_mod``: no (S, L) tensor in forward or backward, and blocks that are wholly
  masked are skipped. Compiled with ``torch.compile``, its documented mode (eager flex
  materializes all scores). On CPU it has no backward (torch <= 2.13): with gradients enabled it
  falls back to ``sdpa``, or to ``reference`` when there is a bias (logged once). A cached
  prefix falls back to ``reference``.
- ``auto``: see :func:`choose_backend`.

The query, key and value projections are three linears (``q_proj``, ``k_proj``, ``v_proj``),
as checkpoints and Hugging Face models store them. ``fused_qkv`` computes them as one product
with the three weights concatenated (``model.qkv_projection: fused``): one GEMM three times as
wide in the forward and for each gradient (the input's gradient summed in the product instead
of three products and two additions), the same function. Projections an adapter changed
(LoRA, QLoRA: another class than ``nn.Linear``) are computed separately.

Shapes here: ``B`` batch, ``H`` query heads, ``Hkv`` key/value heads, ``S`` new tokens, ``L``
all keys (cached + new), ``hd`` head dim.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from moe.model.compile import eager_under_compile
from moe.model.norms import RMSNorm
from moe.model.positions import PositionEncoding, apply_rotary
from moe.model.recompute import recompute

try:  # torch >= 2.5; the GPU machines run 2.11, this is for older installs
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:
    create_block_mask = flex_attention = None  # type: ignore[assignment]

AttentionBackend = Literal["auto", "sdpa", "flex", "reference"]
FLEX_AVAILABLE = flex_attention is not None
# Whether flex_attention runs compiled (fused, fast; compiles once per shape and score_mod). Eager
# flex is the unfused reference implementation: slow, and it materializes every score.
compile_flex = True
# auto on CPU: packed documents run per-document SDPA from this length on, the mask below it.
CPU_SDPA_DOCUMENTS_FROM = 2048

log = logging.getLogger(__name__)
_logged_fallbacks: set[tuple[str, str]] = set()
_compiled: dict[str, Callable] = {}


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
        cached_k, cached_v = self.keys[layer], self.values[layer]
        if cached_k is not None and cached_v is not None:
            k_BHSd = torch.cat((cached_k, k_BHSd), dim=2)
            v_BHSd = torch.cat((cached_v, v_BHSd), dim=2)
        self.keys[layer], self.values[layer] = k_BHSd, v_BHSd
        return k_BHSd, v_BHSd


@dataclass
class AttentionInputs:
    """What every layer's attention shares in one forward, built once by the model
    (:func:`build_attention_inputs`)."""

    rotary: tuple[torch.Tensor, torch.Tensor] | None  # cos, sin (B, 1, S, hd/2) or None
    mask: torch.Tensor | None  # None: plain causal; bool (B, 1, S, L) or float (B, H, S, L)
    cache: KVCache | None = None
    backend: Literal["reference", "sdpa", "flex"] = "reference"  # the one that runs
    doc_lengths: list[list[int]] | None = None  # sdpa: each row's document lengths, in order
    block_mask: object | None = None  # flex: a BlockMask
    score_mod: Callable | None = None  # flex: the position bias


def choose_backend(
    requested: AttentionBackend,
    device_type: str,
    documents: bool,
    bias: bool,
    cached: bool,
    grad: bool,
    length: int = 0,
) -> tuple[str, str | None]:
    """The back end that runs, and the reason when it is not the requested one.

    ``auto``: a cached prefix -> reference; plain causal -> sdpa (the fused causal kernel);
    documents or a bias on CUDA -> flex; on CPU documents without bias -> sdpa (one causal call
    per document) from ``length`` (L) CPU_SDPA_DOCUMENTS_FROM on and reference below it (measured
    in BENCHMARKS.md: sdpa 0.38x the reference at 4096, 1.1-1.4x at 256 and 1024), a bias ->
    reference (flex has no backward on CPU, and its compile time outweighs one inference call).
    """
    if requested == "reference":
        return "reference", None
    if cached:  # auto's own choice, not a fallback
        return "reference", (
            None if requested == "auto" else "a cached prefix needs the explicit mask"
        )
    if requested == "auto":
        if not documents and not bias:
            return "sdpa", None
        if device_type == "cuda" and FLEX_AVAILABLE:
            return "flex", None
        cpu_sdpa = not bias and length >= CPU_SDPA_DOCUMENTS_FROM
        return ("sdpa" if cpu_sdpa else "reference"), None
    if requested == "flex":
        if not FLEX_AVAILABLE:
            return "reference", f"torch {torch.__version__} has no flex_attention (needs >= 2.5)"
        if device_type == "cpu" and grad:
            return ("reference" if bias else "sdpa"), "flex_attention has no backward on CPU"
        return "flex", None
    if bias:
        return "reference", "SDPA takes an ALiBi/T5 bias only as an explicit float mask"
    return "sdpa", None


def document_lengths(doc_BL: torch.Tensor) -> list[list[int]] | None:
    """Each row's runs of equal document ids as lengths; None when an id comes back after
    another document (the mask lets equal ids attend to each other, separate runs would not).
    A host sync: only for CPU, or where flex is missing."""
    rows = []
    for doc_L in doc_BL:
        ids, lengths = torch.unique_consecutive(doc_L, return_counts=True)
        if ids.unique().numel() != ids.numel():
            return None
        rows.append(lengths.tolist())
    return rows


def build_attention_inputs(
    requested: AttentionBackend,
    positions: PositionEncoding,
    pos_all_BL: torch.Tensor,
    doc_all_BL: torch.Tensor | None,
    batch: int,
    past: int = 0,
    cache: KVCache | None = None,
) -> AttentionInputs:
    """Rotations and masks for the S = L - past new tokens at positions ``pos_all_BL[:, past:]``
    ((1, L) when every row has the same positions), in the form the chosen back end needs."""
    device, L = pos_all_BL.device, pos_all_BL.shape[1]
    pos_BS = pos_all_BL[:, past:]
    rotary = positions.rotary(pos_BS)
    score_mod = positions.score_mod(pos_all_BL.expand(batch, L))
    run, reason = choose_backend(
        requested,
        device.type,
        doc_all_BL is not None,
        score_mod is not None,
        past > 0,
        torch.is_grad_enabled(),
        L,
    )
    lengths = None
    if run == "sdpa" and doc_all_BL is not None:
        lengths = document_lengths(doc_all_BL)
        if lengths is None:
            run, reason = "reference", "a document id recurs after another document"
    if reason is not None and (requested, reason) not in _logged_fallbacks:
        _logged_fallbacks.add((requested, reason))
        log.warning("attention_backend %s: running %s instead: %s", requested, run, reason)
    if run == "sdpa":
        return AttentionInputs(rotary, None, cache, "sdpa", doc_lengths=lengths)
    if run == "flex":
        return AttentionInputs(
            rotary,
            None,
            cache,
            "flex",
            score_mod=score_mod,
            block_mask=_block_mask(doc_all_BL, batch, L, device),
        )
    bias = positions.score_bias(pos_BS, pos_all_BL)
    mask = None  # plain causal: SDPA's is_causal path
    if past or doc_all_BL is not None or bias is not None:
        mask = build_mask(
            torch.arange(past, L, device=device),
            torch.arange(L, device=device),
            None if doc_all_BL is None else doc_all_BL[:, past:],
            doc_all_BL,
            bias,
        )
    return AttentionInputs(rotary, mask, cache)


def _block_mask(doc_BL: torch.Tensor | None, batch: int, L: int, device: torch.device):
    """Causal and same-document BlockMask, from (B, L) ids: per 128 x 128 block, whether it is
    empty, full or partial; the mask function is evaluated per element only in partial ones."""

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def causal_same_doc(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc_BL[b, q_idx] == doc_BL[b, kv_idx])

    # Eager create_block_mask evaluates the mask densely (a transient bool (B, L, L)); compiled it
    # does not, and on CUDA the compile is cheap next to training. On CPU flex only serves
    # inference, where the transient is freed at once.
    build = (
        _compiled_fn("create_block_mask", create_block_mask)
        if device.type == "cuda"
        else create_block_mask
    )
    if doc_BL is None:
        return build(causal, None, None, L, L, device=device)
    return build(causal_same_doc, batch, None, L, L, device=device)


def _compiled_fn(name: str, fn: Callable) -> Callable:
    if name not in _compiled:
        _compiled[name] = torch.compile(fn)
    return _compiled[name]


def attention_core(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: AttentionInputs, gqa: bool
) -> torch.Tensor:
    """q (B, H, S, hd), k and v (B, Hkv, L, hd) -> (B, H, S, hd) with the chosen back end."""
    if inputs.backend == "flex":
        flex = cast(
            Callable,
            _compiled_fn("flex_attention", flex_attention) if compile_flex else flex_attention,
        )
        return flex(
            q, k, v, score_mod=inputs.score_mod, block_mask=inputs.block_mask, enable_gqa=gqa
        )
    if inputs.doc_lengths is not None:
        return _sdpa_per_document(q, k, v, inputs.doc_lengths, gqa)
    mask = inputs.mask
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa
    )


@eager_under_compile
def _sdpa_per_document(q, k, v, doc_lengths: list[list[int]], gqa: bool) -> torch.Tensor:
    """One causal SDPA call per packed document. Eager under ``train.compile`` (a graph break):
    the document lengths are Python ints that change every batch, and a graph would be
    specialized on them and compiled again for each batch."""
    rows = []
    for b, lengths in enumerate(doc_lengths):
        parts = zip(
            q[b : b + 1].split(lengths, 2),
            k[b : b + 1].split(lengths, 2),
            v[b : b + 1].split(lengths, 2),
        )
        rows.append(
            torch.cat(
                [
                    F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=gqa)
                    for qd, kd, vd in parts
                ],
                dim=2,
            )
        )
    return torch.cat(rows, dim=0)


class _ConcatLinear(torch.autograd.Function):
    """``F.linear(x, cat(weights), cat(biases))``, whose backward concatenates the weights again
    instead of keeping their concatenation (a weight-sized tensor per layer, 1.6 GB for
    Mixtral-8x7B's 32 layers): what it keeps is ``x`` where a weight trains, as separate
    linears do. The gradients
    are the same products: the input's is one product with the concatenated weights, the
    weights' one product split by rows; those of frozen weights are not formed."""

    @staticmethod
    def forward(ctx, x, n: int, *params):
        weights, biases = params[:n], params[n:]
        ctx.n, ctx.has_bias = n, bool(biases)
        # x only for the weights' gradients: frozen projections (fine-tuning) keep nothing of it
        ctx.save_for_backward(x if any(ctx.needs_input_grad[2 : 2 + n]) else None, *weights)
        return F.linear(x, torch.cat(weights), torch.cat(biases) if biases else None)

    @staticmethod
    def backward(ctx, grad_y):
        x, *weights = ctx.saved_tensors
        n, needs = ctx.n, ctx.needs_input_grad
        rows = [w.shape[0] for w in weights]
        # The concatenation spelled otherwise than the forward's (dim -2, not 0), so that a
        # compiler's common-subexpression pass does not merge the two and keep the forward's.
        grad_x = grad_y @ torch.cat(weights, dim=-2) if needs[0] else None
        grad_2d = grad_y.reshape(-1, grad_y.shape[-1])
        grad_w: list = [None] * n
        if any(needs[2 : 2 + n]):
            grad_w = list((grad_2d.t() @ x.reshape(-1, x.shape[-1])).split(rows))
        grad_b: list = [None] * n if ctx.has_bias else []
        if ctx.has_bias and any(needs[2 + n :]):
            grad_b = list(grad_2d.sum(0).split(rows))
        grad_w = [g if need else None for g, need in zip(grad_w, needs[2 : 2 + n])]
        grad_b = [g if need else None for g, need in zip(grad_b, needs[2 + n :])]
        return (grad_x, None, *grad_w, *grad_b)


def build_mask(
    q_idx_S: torch.Tensor,
    k_idx_L: torch.Tensor,
    q_doc_BS: torch.Tensor | None,
    k_doc_BL: torch.Tensor | None,
    bias_BHSL: torch.Tensor | None,
):
    """Causal (key index <= query index) and same-document mask over the S new queries and all
    L keys; folded into the bias as -inf when there is one. Every query may see itself, so no
    row is fully masked."""
    allowed_BSL = (k_idx_L[None, :] <= q_idx_S[:, None])[None]
    if q_doc_BS is not None:
        assert k_doc_BL is not None  # documents are given for queries and keys alike
        allowed_BSL = allowed_BSL & (q_doc_BS[:, :, None] == k_doc_BL[:, None, :])
    allowed_B1SL = allowed_BSL[:, None]
    if bias_BHSL is None:
        return allowed_B1SL
    return bias_BHSL.masked_fill(~allowed_B1SL, float("-inf"))


QKNorm = Literal["none", "head", "projection"]
QKVProjection = Literal["auto", "separate", "fused"]


class CausalSelfAttention(nn.Module):
    """``head_dim``: width of each head (default d_model / n_heads). ``qkv_bias``: the query,
    key and value projections add a bias (Qwen2). ``qk_norm``: an RMSNorm on queries and keys
    before the rotary embedding, over each head's ``head_dim`` channels (``head``, Qwen3) or over
    the whole projection, all heads at once (``projection``, OLMoE). ``fused_qkv``: the three
    projections computed as one product (see the module's docstring)."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        layer_index: int = 0,
        head_dim: int | None = None,
        qkv_bias: bool = False,
        qk_norm: QKNorm = "none",
        norm_eps: float = 1e-6,
        fused_qkv: bool = False,
    ):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.fused_qkv = fused_qkv
        self.head_dim = head_dim or d_model // n_heads
        self.layer_index = layer_index  # its slot in a KVCache
        # Selective recompute: run the attention core (scores, softmax, weighted sum) again in
        # backward instead of keeping what it saves; set by the trainer.
        self.recompute_core = False
        # Selective recompute, too: the query and key norms (qk_norm) keep their input only
        # and run again in the backward, as the block's norms do.
        self.recompute_qk_norms = False
        self.q_proj = nn.Linear(d_model, n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=False)
        self.qk_norm = qk_norm
        if qk_norm != "none":
            per_head = qk_norm == "head"
            self.q_norm = RMSNorm(self.head_dim if per_head else n_heads * self.head_dim, norm_eps)
            self.k_norm = RMSNorm(
                self.head_dim if per_head else n_kv_heads * self.head_dim, norm_eps
            )

    def _projections(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The query, key and value projections of ``x_BSD``: (B, S, heads * hd) each."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if not self.fused_qkv or any(type(p) is not nn.Linear for p in projs):
            return tuple(p(x_BSD) for p in projs)
        biases = () if self.q_proj.bias is None else tuple(p.bias for p in projs)
        y = _ConcatLinear.apply(x_BSD, len(projs), *(p.weight for p in projs), *biases)
        q, k, v = y.split([p.out_features for p in projs], dim=-1)
        # What the backward keeps of them gets a copy of its own, so that no view keeps the
        # whole (B, S, 3 x width) product alive: the values (the attention core saves them) and,
        # normalized, the queries and keys (their norms save their inputs).
        if self.qk_norm != "none":
            q, k = q.contiguous(), k.contiguous()
        return q, k, v.contiguous()

    def _heads(self, y: torch.Tensor, norm: str, heads: int) -> torch.Tensor:
        """A (B, S, heads * hd) projection -> (B, heads, S, hd), normalized as ``qk_norm``
        says."""
        B, S, _ = y.shape
        if self.qk_norm == "projection":
            y = recompute(getattr(self, norm), y, enabled=self.recompute_qk_norms)
        y = y.view(B, S, heads, self.head_dim)
        if self.qk_norm == "head":
            y = recompute(getattr(self, norm), y, enabled=self.recompute_qk_norms)
        return y.transpose(1, 2)

    def extend_keys(self, k: torch.Tensor, v: torch.Tensor, inputs: AttentionInputs):
        """Keys and values (B, Hkv, L, hd) the queries attend to, and the inputs to use with them;
        adapters (prefix tuning, moe/model/adapters/prefix.py) add their own in front."""
        return k, v, inputs

    def forward(self, x_BSD: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q_y, k_y, v_y = self._projections(x_BSD)
        q = self._heads(q_y, "q_norm", self.n_heads)  # (B, H, S, hd)
        k = self._heads(k_y, "k_norm", self.n_kv_heads)  # (B, Hkv, S, hd)
        v = v_y.view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if inputs.rotary is not None:
            q, k = apply_rotary(q, inputs.rotary), apply_rotary(k, inputs.rotary)
        if inputs.cache is not None:
            k, v = inputs.cache.append(self.layer_index, k, v)  # (B, Hkv, L, hd)
        k, v, inputs = self.extend_keys(k, v, inputs)
        gqa = self.n_kv_heads != self.n_heads
        if self.recompute_core and torch.is_grad_enabled():
            # Keeps only q, k, v for backward; the core runs again there.
            y = checkpoint(attention_core, q, k, v, inputs, gqa, use_reentrant=False)
        else:
            y = attention_core(q, k, v, inputs, gqa)  # (B, H, S, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, S, -1))
