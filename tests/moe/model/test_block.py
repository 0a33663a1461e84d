"""Norms against their formulas; pre-norm and post-norm placement by their defining structure."""

import pytest
import torch

from moe.model.attention import AttentionInputs, CausalSelfAttention
from moe.model.block import Block
from moe.model.experts import DenseFFN
from moe.model.norms import LayerNorm, RMSNorm, build_norm


def test_rmsnorm_formula():
    x = torch.randn(3, 5, 16)
    norm = RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    expected = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), expected)


def test_layernorm_formula():
    x = torch.randn(3, 5, 16) * 3 + 1
    norm = LayerNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-1, 1)
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    torch.testing.assert_close(
        norm(x), (x - mean) / torch.sqrt(var + 1e-5) * norm.weight + norm.bias
    )
    # bf16 input is normalized in fp32 and returned in bf16.
    assert norm(x.bfloat16()).dtype == torch.bfloat16


def make_block(norm: str, placement: str, silent: bool) -> Block:
    torch.manual_seed(0)
    ffn = DenseFFN(16, 32, "swiglu")
    block = Block(CausalSelfAttention(16, 2, 2), ffn, 16, norm, 1e-6, placement)
    if silent:  # both residual branches output zero
        with torch.no_grad():
            block.attn.o_proj.weight.zero_()
            ffn.w_out.weight.zero_()
    return block


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
def test_pre_and_post_norm_placement(norm):
    x = torch.randn(2, 6, 16) * 4 + 2
    inputs = AttentionInputs(None, None)
    # Pre-norm: x + f(norm(x)); silent branches leave the residual stream untouched.
    y, aux = make_block(norm, "pre", silent=True)(x, inputs)
    torch.testing.assert_close(y, x)
    assert aux.item() == 0
    # Post-norm: norm(x + f(x)); the output is normalized even with silent branches.
    block = make_block(norm, "post", silent=True)
    y, _ = block(x, inputs)
    torch.testing.assert_close(y, block.ffn_norm(block.attn_norm(x)))
    # With live branches, post-norm outputs stay normalized; pre-norm outputs do not.
    y_post, _ = make_block(norm, "post", silent=False)(x, inputs)
    y_pre, _ = make_block(norm, "pre", silent=False)(x, inputs)
    rms = lambda t: t.pow(2).mean(-1).sqrt()
    if norm == "rmsnorm":
        torch.testing.assert_close(rms(y_post), torch.ones(2, 6), atol=1e-4, rtol=0)
    else:
        torch.testing.assert_close(y_post.mean(-1), torch.zeros(2, 6), atol=1e-5, rtol=0)
    assert (rms(y_pre) > 2).all()


def test_build_norm_kinds():
    assert isinstance(build_norm("rmsnorm", 8, 1e-6), RMSNorm)
    ln = build_norm("layernorm", 8, 1e-5)
    assert isinstance(ln, LayerNorm) and ln.bias is not None
