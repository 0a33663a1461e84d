"""Attention (MHA / GQA / MQA through SDPA) against a naive reference; document masking and the
KV cache for every positional encoding, on the whole model."""

import math

import pytest
import torch

from moe.model.attention import AttentionInputs, CausalSelfAttention, KVCache, build_mask
from moe.model.moe_layer import MoEConfig
from moe.model.positions import AlibiBias, RotaryEmbedding
from moe.model.transformer import ModelConfig, MoETransformer

POSITIONS = ["rope", "sinusoidal", "learned", "alibi", "t5"]


def reference_attention(
    attn: CausalSelfAttention, x_BSD, bias_BHSS=None, allowed_BSS=None, rope=None
):
    """softmax(q k^T / sqrt(hd) + bias, masked) v with key/value heads repeated per group."""
    B, S, _ = x_BSD.shape
    H, Hkv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = attn.q_proj(x_BSD).view(B, S, H, hd).transpose(1, 2)
    k = attn.k_proj(x_BSD).view(B, S, Hkv, hd).transpose(1, 2)
    v = attn.v_proj(x_BSD).view(B, S, Hkv, hd).transpose(1, 2)
    if rope is not None:
        from moe.model.positions import apply_rotary

        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
    k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    if bias_BHSS is not None:
        scores = scores + bias_BHSS
    allowed = torch.ones(S, S).tril().bool()[None]
    if allowed_BSS is not None:
        allowed = allowed & allowed_BSS
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    y = scores.softmax(-1) @ v
    return attn.o_proj(y.transpose(1, 2).reshape(B, S, -1))


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_sdpa_attention_matches_reference(n_kv_heads):
    torch.manual_seed(0)
    attn = CausalSelfAttention(32, 4, n_kv_heads)
    assert attn.k_proj.weight.shape == (n_kv_heads * 8, 32)
    x = torch.randn(2, 7, 32)
    pos = torch.arange(7)[None]
    rope = RotaryEmbedding(8).rotary(pos)
    # Plain causal (SDPA's is_causal path) with rotary positions.
    torch.testing.assert_close(
        attn(x, AttentionInputs(rope, None)),
        reference_attention(attn, x, rope=rope),
        atol=1e-5,
        rtol=1e-5,
    )
    # Float mask: ALiBi bias plus documents.
    doc = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 2, 2]])
    bias = AlibiBias(4).score_bias(pos, pos)
    mask = build_mask(torch.arange(7), torch.arange(7), doc, doc, bias)
    same_doc = doc[:, :, None] == doc[:, None, :]
    torch.testing.assert_close(
        attn(x, AttentionInputs(None, mask)),
        reference_attention(attn, x, bias, same_doc),
        atol=1e-5,
        rtol=1e-5,
    )


def make_model(position: str, **kw) -> MoETransformer:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=61,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=24,
        position=position,
        t5_num_buckets=8,
        t5_max_distance=16,
        moe=MoEConfig(num_experts=4, expert_hidden=16),
        **kw,
    )
    assert not cfg.problems()
    return MoETransformer(cfg).eval()


@pytest.mark.parametrize("position", POSITIONS)
def test_document_masking_equals_running_each_document_alone(position):
    """With doc ids, every document's logits are those of the document on its own: attention
    stays inside it and its positions start at 0."""
    model = make_model(position)
    torch.manual_seed(1)
    ids = torch.randint(0, 61, (2, 12))
    doc = torch.tensor([[3, 3, 3, 3, 3, 8, 8, 8, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 4]])
    with torch.no_grad():
        packed = model(ids, doc_ids_BS=doc).logits
        for b in range(2):
            for d in doc[b].unique():
                cols = (doc[b] == d).nonzero().flatten()
                alone = model(ids[b : b + 1, cols]).logits[0]
                torch.testing.assert_close(packed[b, cols], alone, atol=1e-5, rtol=1e-5)
        # Without doc ids the packed rows do see across documents.
        assert not torch.allclose(model(ids).logits[0, 5:], packed[0, 5:], atol=1e-4)


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("with_docs", [False, True], ids=["nodocs", "docs"])
def test_kv_cache_incremental_decoding_equals_full_forward(position, with_docs):
    model = make_model(position, norm="layernorm")
    torch.manual_seed(2)
    ids = torch.randint(0, 61, (2, 20))
    doc = torch.tensor([[0] * 9 + [1] * 11, [0] * 14 + [2] * 6]) if with_docs else None
    with torch.no_grad():
        full = model(ids, doc_ids_BS=doc).logits
        cache = KVCache(2)
        # A prompt chunk, single tokens, then a chunk of 3 (prefill and decode in one path).
        steps = [(0, 7)] + [(t, t + 1) for t in range(7, 17)] + [(17, 20)]
        pieces = []
        for a, b in steps:
            out = model(
                ids[:, a:b], doc_ids_BS=None if doc is None else doc[:, a:b], kv_cache=cache
            )
            pieces.append(out.logits)
        assert cache.length == 20 and cache.keys[0].shape == (2, 2, 20, 8)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=2e-5, rtol=1e-5)


def test_learned_positions_refuse_sequences_past_the_table():
    model = make_model("learned")
    cache = model.new_kv_cache()
    model(torch.zeros(1, 24, dtype=torch.long), kv_cache=cache)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 1, dtype=torch.long), kv_cache=cache)


def test_kv_cache_needs_consistent_doc_ids():
    model = make_model("rope")
    cache = model.new_kv_cache()
    model(torch.zeros(1, 4, dtype=torch.long), kv_cache=cache)
    with pytest.raises(ValueError, match="doc_ids_BS"):
        model(
            torch.zeros(1, 1, dtype=torch.long),
            doc_ids_BS=torch.zeros(1, 1, dtype=torch.long),
            kv_cache=cache,
        )


def rms(x: torch.Tensor, gain: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain


@pytest.mark.parametrize("qk_norm", ["none", "head", "projection"])
def test_head_dim_bias_and_query_key_norms_match_a_hand_computation(qk_norm):
    """head: one RMSNorm per head over its head_dim channels (Qwen3-MoE); projection: one over
    all heads' channels at once (OLMoE); both before the rotary embedding; biases on q, k, v."""
    torch.manual_seed(0)
    B, S, D, H, Hkv, hd = 2, 9, 24, 4, 2, 10  # hd * H != D
    attn = CausalSelfAttention(D, H, Hkv, head_dim=hd, qkv_bias=True, qk_norm=qk_norm)
    with torch.no_grad():
        for p in attn.parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p) * 0.5 + 1)
    x = torch.randn(B, S, D)
    rope = RotaryEmbedding(hd).rotary(torch.arange(S)[None])
    q = x @ attn.q_proj.weight.T + attn.q_proj.bias
    k = x @ attn.k_proj.weight.T + attn.k_proj.bias
    if qk_norm == "projection":
        q, k = rms(q, attn.q_norm.weight), rms(k, attn.k_norm.weight)
    q, k = q.view(B, S, H, hd), k.view(B, S, Hkv, hd)
    if qk_norm == "head":
        q, k = rms(q, attn.q_norm.weight), rms(k, attn.k_norm.weight)
    from moe.model.positions import apply_rotary

    q, k = apply_rotary(q.transpose(1, 2), rope), apply_rotary(k.transpose(1, 2), rope)
    v = (x @ attn.v_proj.weight.T + attn.v_proj.bias).view(B, S, Hkv, hd).transpose(1, 2)
    k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(
        torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf")
    )
    want = attn.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, S, H * hd))
    got = attn(x, AttentionInputs(rope, None))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
