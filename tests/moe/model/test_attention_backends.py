"""The attention back ends (model.attention_backend) against the reference: forward and backward
for every position scheme, documents, GQA and MQA; what auto picks and what falls back; that
the memory-efficient paths keep no (S, S) tensor for backward; selective recompute; the whole
model. flex_attention has no backward on CPU (torch 2.13), so flex's gradients are checked on
CUDA only; on CPU its forward runs without gradients and its score_mods are checked densely."""

import logging

import pytest
import torch

import moe.model.attention as attention
from moe.core.config_schema import from_dict
from moe.core.errors import ConfigError
from moe.model.attention import (
    CausalSelfAttention,
    build_attention_inputs,
    choose_backend,
)
from moe.model.moe_layer import MoEConfig
from moe.model.positions import (
    AlibiBias,
    LearnedPositions,
    PositionEncoding,
    RotaryEmbedding,
    SinusoidalPositions,
    T5RelativeBias,
    positions_from_doc_ids,
)
from moe.model.transformer import ModelConfig, MoETransformer

POSITIONS = ["rope", "alibi", "t5", "learned", "sinusoidal", "none"]
HEADS = {"mha": 4, "gqa": 2, "mqa": 1}
CUDA = torch.cuda.is_available()


def position_module(kind: str, n_heads: int = 4, head_dim: int = 8) -> PositionEncoding:
    torch.manual_seed(3)
    module = {
        "rope": lambda: RotaryEmbedding(head_dim),
        "alibi": lambda: AlibiBias(n_heads),
        "t5": lambda: T5RelativeBias(n_heads, 8, 16),
        "learned": lambda: LearnedPositions(64, 32),
        "sinusoidal": lambda: SinusoidalPositions(32),
        "none": PositionEncoding,
    }[kind]()
    if kind == "t5":
        torch.nn.init.normal_(module.bias.weight, std=1.0)  # large enough to matter
    return module


def packed_docs(B: int, S: int) -> torch.Tensor:
    """Several documents per row, different boundaries per row, ids increasing."""
    doc = torch.zeros(B, S, dtype=torch.long)
    for b in range(B):
        for start in range(3 + b, S, 11 + 4 * b):
            doc[b, start:] += 1
    return doc


def run_attention(
    backend: str,
    position: str,
    n_kv_heads: int,
    docs: bool,
    device="cpu",
    S: int = 40,
    grad: bool = True,
    recompute: bool = False,
):
    """Output, gradients (x, and the T5 table when there is one) and the back end that ran."""
    torch.manual_seed(0)
    attn = CausalSelfAttention(32, 4, n_kv_heads).to(device)
    attn.recompute_core = recompute
    positions = position_module(position).to(device)
    x = torch.randn(2, S, 32, device=device, requires_grad=grad)
    doc = packed_docs(2, S).to(device) if docs else None
    pos = positions_from_doc_ids(doc) if docs else torch.arange(S, device=device)[None]
    with torch.set_grad_enabled(grad):
        inputs = build_attention_inputs(backend, positions, pos, doc, batch=2)
        y = attn(x, inputs)
    if not grad:
        return y, [], inputs.backend
    (y * torch.linspace(-1, 1, y.numel(), device=device).view_as(y)).sum().backward()
    grads = [x.grad, attn.q_proj.weight.grad, attn.k_proj.weight.grad]
    if position == "t5":
        grads.append(positions.bias.weight.grad)
    return y, grads, inputs.backend


def expected_backend(
    requested: str, position: str, docs: bool, device_type: str, grad: bool, length: int = 40
):
    bias = position in ("alibi", "t5")
    if requested == "auto":
        if not docs and not bias:
            return "sdpa"
        if device_type == "cuda":
            return "flex"
        return "sdpa" if not bias and length >= attention.CPU_SDPA_DOCUMENTS_FROM else "reference"
    if requested == "flex" and (device_type != "cpu" or not grad):
        return "flex"
    return "reference" if bias else "sdpa"


@pytest.mark.parametrize("docs", [False, True], ids=["causal", "docs"])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("backend", ["sdpa", "flex", "auto"])
def test_backend_matches_reference_forward_and_backward(backend, position, heads, docs):
    """On CPU flex cannot run backward, so here it checks the documented fallback."""
    y_ref, g_ref, ran = run_attention("reference", position, HEADS[heads], docs)
    assert ran == "reference"
    y, grads, ran = run_attention(backend, position, HEADS[heads], docs)
    assert ran == expected_backend(backend, position, docs, "cpu", grad=True)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    assert len(grads) == len(g_ref)
    for g, g0 in zip(grads, g_ref):
        torch.testing.assert_close(g, g0, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("docs", [False, True], ids=["causal", "docs"])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("position", POSITIONS)
def test_flex_forward_matches_reference_without_gradients(position, heads, docs, monkeypatch):
    """flex_attention itself on CPU (inference): the BlockMask from document ids, GQA and the
    score_mods. Eager here (the same semantics, no compile per case); the compiled kernel is
    checked below."""
    monkeypatch.setattr(attention, "compile_flex", False)
    y_ref, _, _ = run_attention("reference", position, HEADS[heads], docs, grad=False)
    y, _, ran = run_attention("flex", position, HEADS[heads], docs, grad=False)
    assert ran == "flex"
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # compiles flex_attention
def test_compiled_flex_matches_reference_on_cpu():
    """The fused kernel (torch.compile), T5 bucket lookup inside it, documents, GQA, S not a
    multiple of the 128 block."""
    y_ref, _, _ = run_attention("reference", "t5", 2, True, S=300, grad=False)
    y, _, ran = run_attention("flex", "t5", 2, True, S=300, grad=False)
    assert ran == "flex"
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("position", ["alibi", "t5"])
def test_score_mods_are_the_score_bias_with_its_gradient(position):
    """Each score_mod, evaluated at every (b, h, q, k) by broadcasting, equals score_bias, and
    the T5 table gets the same gradient through it (what flex's backward differentiates)."""
    module = position_module(position)
    pos_BL = positions_from_doc_ids(packed_docs(2, 30))
    b, h, q, k = (
        torch.arange(n).view([-1 if i == d else 1 for i in range(4)])
        for d, n in enumerate((2, 4, 30, 30))
    )
    via_mod = module.score_mod(pos_BL)(torch.zeros(()), b, h, q, k)
    bias = module.score_bias(pos_BL, pos_BL)
    torch.testing.assert_close(via_mod, bias, atol=1e-6, rtol=1e-6)
    if position == "t5":
        w = torch.randn(2, 4, 30, 30)
        (grad_mod,) = torch.autograd.grad((via_mod * w).sum(), module.bias.weight)
        (grad_ref,) = torch.autograd.grad((bias * w).sum(), module.bias.weight)
        assert grad_ref.abs().sum() > 0
        torch.testing.assert_close(grad_mod, grad_ref)


@pytest.mark.skipif(not CUDA, reason="flex_attention's backward exists only on CUDA")
@pytest.mark.parametrize("docs", [False, True], ids=["causal", "docs"])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("position", POSITIONS)
def test_flex_matches_reference_on_cuda(position, heads, docs):
    torch.backends.cuda.matmul.allow_tf32 = False
    y, grads, ran = run_attention("flex", position, HEADS[heads], docs, device="cuda", S=200)
    y_ref, g_ref, _ = run_attention("reference", position, HEADS[heads], docs, device="cuda", S=200)
    assert ran == "flex"
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    for g, g0 in zip(grads, g_ref):
        torch.testing.assert_close(g, g0, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [40, 4096])
@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("grad", [True, False])
def test_auto_and_fallbacks_choose_as_documented(device_type, grad, length):
    for docs in (False, True):
        for bias in (False, True):
            position = "alibi" if bias else "rope"
            for requested in ("auto", "sdpa", "flex"):
                got, _ = choose_backend(requested, device_type, docs, bias, False, grad, length)
                assert got == expected_backend(requested, position, docs, device_type, grad, length)
            assert (
                choose_backend("reference", device_type, docs, bias, False, grad)[0] == "reference"
            )
            for requested in ("auto", "sdpa", "flex"):  # past a cached prefix
                assert (
                    choose_backend(requested, device_type, docs, bias, True, grad)[0] == "reference"
                )
    # The rule auto follows on CPU, spelled out: plain causal runs SDPA's causal kernel, long
    # packed sequences per-document SDPA, short ones and biases the explicit mask; on CUDA
    # documents and biases run flex.
    assert choose_backend("auto", "cpu", False, False, False, True, 40)[0] == "sdpa"
    assert choose_backend("auto", "cpu", True, False, False, True, 4096)[0] == "sdpa"
    assert choose_backend("auto", "cpu", True, False, False, True, 1024)[0] == "reference"
    assert choose_backend("auto", "cpu", True, True, False, True, 4096)[0] == "reference"
    assert choose_backend("auto", "cuda", True, True, False, True)[0] == (
        "flex" if attention.FLEX_AVAILABLE else "reference"
    )


def test_fallbacks_are_logged_and_recurring_ids_take_the_mask(caplog):
    attention._logged_fallbacks.clear()
    with caplog.at_level(logging.WARNING, logger="moe.model.attention"):
        _, _, ran = run_attention("flex", "t5", 2, True)
    assert ran == "reference" and "no backward on CPU" in caplog.text
    # Document ids 0, 1, 0: the two runs of id 0 attend to each other under the mask's rule,
    # so per-document SDPA would differ; it must not run.
    doc = torch.tensor([[0, 0, 1, 1, 0, 0]])
    inputs = build_attention_inputs("sdpa", PositionEncoding(), positions_from_doc_ids(doc), doc, 1)
    assert inputs.backend == "reference" and inputs.mask is not None


def test_config_refuses_flex_without_flex_attention(monkeypatch):
    monkeypatch.setattr("moe.model.transformer.FLEX_AVAILABLE", False)
    with pytest.raises(ConfigError, match="attention_backend: flex needs torch"):
        from_dict(ModelConfig, {"attention_backend": "flex"})
    with pytest.raises(ConfigError, match="attention_backend: 'flash' is not allowed"):
        from_dict(ModelConfig, {"attention_backend": "flash"})
    assert from_dict(ModelConfig, {"attention_backend": "sdpa"}).attention_backend == "sdpa"


def max_saved_numel(backend: str, S: int, docs: bool, device="cpu") -> int:
    """Largest tensor autograd keeps for backward of one attention core at length S."""
    torch.manual_seed(0)
    attn = CausalSelfAttention(16, 2, 1).to(device)  # head dim 8: cheap
    x = torch.randn(1, S, 16, device=device, requires_grad=True)
    doc = (torch.arange(S, device=device) * 5 // S)[None] if docs else None  # 5 documents
    pos = positions_from_doc_ids(doc) if docs else torch.arange(S, device=device)[None]
    inputs = build_attention_inputs(backend, PositionEncoding(), pos, doc, batch=1)
    assert inputs.backend == backend
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attn(x, inputs)
    return max(sizes)


@pytest.mark.parametrize("docs", [False, True], ids=["causal", "docs"])
def test_sdpa_keeps_no_square_tensor_at_8192(docs):
    S = 8192
    assert max_saved_numel("sdpa", S, docs) < S * S
    if docs:  # the reference keeps its (1, 1, S, S) mask: the check can tell them apart
        assert max_saved_numel("reference", S, docs) >= S * S


@pytest.mark.skipif(not CUDA, reason="flex_attention has no backward on CPU")
def test_flex_keeps_no_square_tensor_at_8192_on_cuda():
    S = 8192
    assert max_saved_numel("flex", S, True, "cuda") < S * S
    assert max_saved_numel("reference", S, True, "cuda") >= S * S


@pytest.mark.parametrize(
    "backend, position, docs",
    [
        ("sdpa", "rope", True),
        ("sdpa", "none", False),
        ("reference", "t5", True),
        ("reference", "alibi", False),
    ],
)
def test_recompute_core_gives_identical_gradients(backend, position, docs, monkeypatch):
    calls = []
    core = attention.attention_core
    monkeypatch.setattr(attention, "attention_core", lambda *a: calls.append(1) or core(*a))
    y0, g0, _ = run_attention(backend, position, 2, docs)
    assert len(calls) == 1
    calls.clear()
    y1, g1, _ = run_attention(backend, position, 2, docs, recompute=True)
    assert len(calls) == 2  # forward, and again in backward
    assert torch.equal(y0, y1)
    assert len(g0) == len(g1)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def tiny_model(position: str, backend: str, **options) -> MoETransformer:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=61,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=64,
        position=position,
        t5_num_buckets=8,
        t5_max_distance=16,
        attention_backend=backend,
        moe=MoEConfig(num_experts=4, expert_hidden=16),
        **options,
    )
    assert not cfg.problems()
    model = MoETransformer(cfg)
    with torch.no_grad():  # biases start at 0 and norm gains at 1: make both matter
        for name, p in model.named_parameters():
            if name.endswith(("_proj.bias", "q_norm.weight", "k_norm.weight")):
                p.copy_(torch.randn_like(p) * 0.5 + name.endswith("weight"))
    return model


# The attention options of the open-weights architectures (each head narrower than
# d_model / n_heads, biases, query/key norms), on the back ends.
ATTENTION_OPTIONS = {
    "qwen3": {"head_dim": 12, "qk_norm": "head"},
    "olmoe": {"qk_norm": "projection"},
    "qwen2": {"qkv_bias": True, "head_dim": 6},
}


@pytest.mark.parametrize("backend", ["sdpa", "flex", "auto"])
@pytest.mark.parametrize("position", ["rope", "alibi", "t5", "learned", "sinusoidal"])
def test_model_backends_match_reference(position, backend, monkeypatch):
    """Logits and every parameter's gradient (training on CPU: flex falls back), and logits
    without gradients (CPU flex runs, eager)."""
    check_model_backend(position, backend, {}, monkeypatch)


@pytest.mark.parametrize("backend", ["sdpa", "flex", "auto"])
@pytest.mark.parametrize("options", ATTENTION_OPTIONS.values(), ids=ATTENTION_OPTIONS.keys())
def test_model_attention_options_match_reference_on_every_backend(options, backend, monkeypatch):
    check_model_backend("rope", backend, options, monkeypatch)


def check_model_backend(position: str, backend: str, options: dict, monkeypatch):
    monkeypatch.setattr(attention, "compile_flex", False)
    torch.manual_seed(1)
    ids = torch.randint(0, 61, (2, 48))
    doc = packed_docs(2, 48)
    results = []
    for name in ("reference", backend):
        model = tiny_model(position, name, **options)
        out = model(ids, targets_BS=ids, doc_ids_BS=doc)
        out.loss.backward()
        with torch.no_grad():
            no_grad_logits = model(ids, doc_ids_BS=doc).logits
        results.append(
            (out.logits, {n: p.grad for n, p in model.named_parameters()}, no_grad_logits)
        )
    (ref, ref_grads, ref_ng), (got, grads, got_ng) = results
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_ng, ref_ng, atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(
            grads[name], ref_grads[name], atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize(
    "backend, position, options",
    [
        *[(b, p, {}) for b in ("sdpa", "flex", "auto", "reference") for p in ("rope", "t5")],
        ("flex", "rope", ATTENTION_OPTIONS["qwen3"]),
        ("sdpa", "rope", ATTENTION_OPTIONS["olmoe"]),
        ("auto", "rope", ATTENTION_OPTIONS["qwen2"]),
    ],
)
def test_kv_cache_decoding_with_every_backend(position, backend, options, monkeypatch):
    """Prefill runs the chosen back end (flex too: no gradients), decoding past the cached
    prefix the reference; together they equal one full forward."""
    monkeypatch.setattr(attention, "compile_flex", False)
    model = tiny_model(position, backend, **options).eval()
    torch.manual_seed(2)
    ids = torch.randint(0, 61, (2, 20))
    doc = torch.tensor([[0] * 9 + [1] * 11, [0] * 14 + [2] * 6])
    with torch.no_grad():
        full = model(ids, doc_ids_BS=doc).logits
        cache = model.new_kv_cache()
        pieces = [
            model(ids[:, a:b], doc_ids_BS=doc[:, a:b], kv_cache=cache).logits
            for a, b in [(0, 12)] + [(t, t + 1) for t in range(12, 20)]
        ]
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=2e-5, rtol=1e-5)
