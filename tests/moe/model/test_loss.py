"""The language-model loss back ends (moe/model/loss.py, ``model.cross_entropy``): chunked against
the full reference (loss and every gradient), in fp32 and bf16, with ignored targets, tied and
frozen heads; no (T, V) tensor is ever made by the chunked loss; liger is refused by name where
it cannot run.

Tolerances. fp32: rtol = atol = 1e-6 on the loss and 1e-6 on the gradients: both sides run the
same fp32 operations on the same logits, only the grouping of the sums over tokens (the weight
gradient is summed per block) and the log-sum-exp's kernel differ (a few ulps). bf16: both are
compared with a float64 reference of the same weights; the chunked loss's error must stay within
2x the full loss's own (plus 2^-9 of the gradient's size): the same model-dtype roundings, plus
one rounding of the hidden-state gradient when the incoming gradient scales it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe.model import loss as loss_mod
from moe.model.loss import IGNORE, ChunkedLinearCrossEntropy, LMHeadLoss, chunk_loss_and_grads
from moe.model.moe_layer import MoEConfig
from moe.model.transformer import ModelConfig, MoETransformer

VOCAB, B, S = 97, 3, 16


def config(vocab: int = VOCAB, **extra) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        d_model=32,
        n_layers=2,
        n_heads=4,
        max_seq_len=S,
        moe=MoEConfig(num_experts=4, expert_hidden=16, num_shared_experts=1),
        **extra,
    )


def pair(chunk: int, **extra) -> tuple[MoETransformer, MoETransformer]:
    torch.manual_seed(0)
    full = MoETransformer(config(**extra))
    chunked = MoETransformer(
        config(cross_entropy="chunked", cross_entropy_chunk_tokens=chunk, **extra)
    )
    chunked.load_state_dict(full.state_dict())
    return full, chunked


def batch(seed: int = 1, ignored: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, S + 1), generator=g)
    targets = ids[:, 1:].clone()
    if ignored:  # a prompt of 5 targets, and one whole row ignored (whole blocks of 1..16)
        targets[0, :5] = IGNORE
        targets[2] = IGNORE
    return ids[:, :-1], targets


def grads(model: MoETransformer) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("chunk", [1, 7, 16, 48, 1000])
def test_chunked_loss_and_gradients_equal_the_full_loss_in_fp32(chunk):
    full, chunked = pair(chunk)
    x, t = batch()
    ref, out = full(x, t), chunked(x, t)
    ref.loss.backward()
    out.loss.backward()
    assert out.logits is None and ref.logits.shape == (B, S, VOCAB)
    torch.testing.assert_close(out.lm_loss, ref.lm_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-6)
    got, want = grads(chunked), grads(full)
    assert got.keys() == want.keys() and "lm_head.weight" in got
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-6, msg=name)


def test_tied_embeddings_and_a_frozen_head():
    full, chunked = pair(5, tie_embeddings=True)
    x, t = batch(2)
    full(x, t).loss.backward()
    chunked(x, t).loss.backward()
    torch.testing.assert_close(
        chunked.embed.weight.grad, full.embed.weight.grad, rtol=1e-6, atol=1e-6
    )
    full, chunked = pair(5)
    for m in (full, chunked):
        m.lm_head.weight.requires_grad_(False)
    full(x, t).loss.backward()
    chunked(x, t).loss.backward()
    assert chunked.lm_head.weight.grad is None
    torch.testing.assert_close(
        chunked.embed.weight.grad, full.embed.weight.grad, rtol=1e-6, atol=1e-6
    )


def test_without_gradients_and_without_targets():
    full, chunked = pair(7)
    x, t = batch(3)
    with torch.no_grad():
        torch.testing.assert_close(chunked(x, t).lm_loss, full(x, t).lm_loss, rtol=1e-6, atol=1e-6)
    # Evaluation and generation pass no targets: the logits, exactly the full model's.
    assert torch.equal(chunked(x).logits, full(x).logits)
    # Every target ignored: 0, not NaN, as the full loss.
    none = torch.full_like(t, IGNORE)
    assert chunked(x, none).lm_loss.item() == 0.0 == full(x, none).lm_loss.item()


def test_the_full_loss_is_the_reference_formula_bitwise():
    """The default path: logits returned, loss exactly fp32 cross-entropy of the logits over the
    kept targets (the formula the model has always used)."""
    full, _ = pair(7)
    x, t = batch(4)
    out = full(x, t)
    want = (
        torch.nn.functional.cross_entropy(
            out.logits.float().flatten(0, 1), t.flatten(), ignore_index=IGNORE, reduction="sum"
        )
        / (t != IGNORE).sum()
    )
    assert torch.equal(out.lm_loss, want)


def _errors(model: MoETransformer, ref: MoETransformer, x, t) -> tuple[float, dict]:
    out, want = model(x, t), ref(x, t)
    out.lm_loss.backward()
    want.lm_loss.backward()
    got, exact = grads(model), grads(ref)
    rel = {n: ((got[n].double() - exact[n]).norm() / exact[n].norm()).item() for n in exact}
    return abs(out.lm_loss.item() - want.lm_loss.item()), rel


def test_chunked_in_bf16_is_as_close_to_float64_as_the_full_loss():
    full, chunked = pair(11)
    ref = copy.deepcopy(full).double()
    full, chunked = full.bfloat16(), chunked.bfloat16()
    x, t = batch(5)
    full_loss_err, full_rel = _errors(full, ref, x, t)
    ref.zero_grad()
    chunked_loss_err, chunked_rel = _errors(chunked, ref, x, t)
    assert chunked_loss_err <= 2 * full_loss_err + 1e-3, (chunked_loss_err, full_loss_err)
    for name, err in full_rel.items():
        assert chunked_rel[name] <= 2 * err + 2**-9, (name, chunked_rel[name], err)


class _LargestTensor(TorchDispatchMode):
    """The largest number of elements of any tensor an operator returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.largest = max(self.largest, o.numel())
        return out


def test_the_chunked_loss_never_makes_a_tokens_by_vocabulary_tensor():
    vocab = 2000  # a head far larger than any other tensor of the model
    full, chunked = pair(8, vocab=vocab)
    x, t = batch(6)
    sizes = {}
    for name, model in (("full", full), ("chunked", chunked)):
        with _LargestTensor() as mode:
            model(x, t).loss.backward()
        sizes[name] = mode.largest
    assert sizes["full"] >= B * S * vocab
    # The head weight (V x D) and its gradient are the largest; a block's logits 8 x V.
    assert sizes["chunked"] == vocab * 32 < B * S * vocab, sizes


def test_the_incoming_gradient_scales_the_kept_gradients():
    torch.manual_seed(0)
    h = torch.randn(10, 6, requires_grad=True)
    w = torch.randn(13, 6, requires_grad=True)
    t = torch.randint(0, 13, (10,))
    loss = ChunkedLinearCrossEntropy.apply(h, w, t, 4)
    (3.5 * loss).backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    want = torch.nn.functional.cross_entropy(h2 @ w2.t(), t, reduction="sum")
    (3.5 * want).backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(h.grad, h2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


def test_a_compiled_block_gives_the_eager_loss_and_gradients():
    """compile_part (what train.compile calls): the block body traced by dynamo and AOT autograd
    (aot_eager: inductor's code generation is covered in tests/moe/model/test_compile.py)."""
    torch._dynamo.reset()
    full, chunked = pair(16)
    chunked.head_loss.compile_part(backend="aot_eager")
    assert chunked.head_loss.body is not chunk_loss_and_grads
    x, t = batch(7)
    for _ in range(2):
        full.zero_grad()
        chunked.zero_grad()
        ref, out = full(x, t), chunked(x, t)
        ref.loss.backward()
        out.loss.backward()
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(
            chunked.lm_head.weight.grad, full.lm_head.weight.grad, rtol=1e-6, atol=1e-6
        )


def test_config_problems_name_the_key_and_the_fix(monkeypatch):
    assert any(
        "cross_entropy_chunk_tokens: must be >= 1" in p
        for p in config(cross_entropy_chunk_tokens=0).problems()
    )
    monkeypatch.setattr(loss_mod.importlib.util, "find_spec", lambda name: None)
    problems = config(cross_entropy="liger").problems()
    assert any("cross_entropy: liger" in p and "pip install liger-kernel" in p for p in problems), (
        problems
    )


def test_liger_on_the_cpu_is_refused_naming_cuda(monkeypatch):
    monkeypatch.setattr(loss_mod, "liger_problem", lambda: None)  # as if it were installed
    head = LMHeadLoss("liger", 16)
    with pytest.raises(RuntimeError, match="CUDA only.*use chunked"):
        head(torch.randn(4, 8), torch.randn(11, 8), torch.zeros(4, dtype=torch.long))
    monkeypatch.setattr(loss_mod, "liger_problem", lambda: "needs Liger-Kernel")
    with pytest.raises(RuntimeError, match="model.cross_entropy: liger needs Liger-Kernel"):
        head(torch.randn(4, 8), torch.randn(11, 8), torch.zeros(4, dtype=torch.long))


def test_prompt_tuning_with_the_chunked_loss():
    from moe.model.adapters.prompt import PromptConfig, apply_prompt

    full, chunked = pair(9)
    for m in (full, chunked):
        torch.manual_seed(3)
        apply_prompt(m, PromptConfig(tokens=4))
    x, t = batch(8, ignored=False)
    ref, out = full(x[:, :12], t[:, :12]), chunked(x[:, :12], t[:, :12])
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-6)


def test_block_body_matches_autograd_of_the_reference():
    """chunk_loss_and_grads alone: its gradients are autograd's of the reference formula."""
    torch.manual_seed(1)
    h = torch.randn(9, 5, requires_grad=True)
    w = torch.randn(7, 5, requires_grad=True)
    t = torch.tensor([0, 3, IGNORE, 6, 6, 1, IGNORE, 2, 5])
    loss, gh, gw = chunk_loss_and_grads(h.detach(), w.detach(), t, True, True)
    want = torch.nn.functional.cross_entropy(h @ w.t(), t, ignore_index=IGNORE, reduction="sum")
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gh, h.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gw, w.grad, rtol=1e-6, atol=1e-6)
