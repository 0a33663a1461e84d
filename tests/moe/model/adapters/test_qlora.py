"""QLoRA as model code (moe/model/adapters/qlora.py): the NF4 base against a reference written
here from the paper's definition and against torchao's own dequantisation, its memory, the
products' gradients against LoRA on the dequantised weights, and the config's refusal without
torchao."""

import copy

import numpy as np
import pytest
import torch
from scipy.stats import norm

import moe.model.adapters.qlora as qlora
from moe.config.run import load_config
from moe.core.errors import ConfigError
from moe.model.adapters.lora import LoRAConfig, apply_lora
from moe.model.adapters.qlora import (
    NF4_CODE,
    NF4GroupedExperts,
    NF4LoRAGroupedExperts,
    NF4LoRALinear,
    dequantize_base,
    dequantize_nf4,
    nf4_bytes,
    quantize_base,
    quantize_nf4,
    quantized_numel,
)
from moe.training.finetune import parameter_counts
from tests.moe.model.adapters.test_lora import _randomize_factors, tiny_model

pytestmark = pytest.mark.skipif(qlora.torchao_missing() is not None, reason="needs torchao")


def paper_code() -> np.ndarray:
    """QLoRA's NF4 values: 8 positive and 7 negative quantiles of N(0, 1) at evenly spaced
    probabilities from 1 - offset to 1/2 (offset 0.9677 makes the outermost +-1 after
    normalisation; the asymmetric halves give an exact zero), scaled to [-1, 1]."""
    offset = 0.9677083
    pos = norm.ppf(np.linspace(offset, 0.5, 9)[:-1])
    neg = -norm.ppf(np.linspace(offset, 0.5, 8)[:-1])
    v = np.sort(np.concatenate([pos, [0.0], neg]))
    return v / v.max()


def reference(w: torch.Tensor, code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantised w, block absmaxes) by the definition: blocks of 64 keep their absmax c and
    each value the nearest code to w / c; the absmaxes, less their mean, are quantised to int8
    in blocks of 256 (factor 128 / block absmax, clamped to [-128, 127], as torchao does)."""
    blocks = w.reshape(-1, 64)
    c = blocks.abs().amax(1)
    idx = (blocks / c[:, None])[..., None].sub(code).abs().argmin(-1)
    mean = c.mean()
    centred = (c - mean).view(-1, 256)
    factor = 128 / centred.abs().amax(1, keepdim=True)
    c8 = (centred * factor).round().clamp(-128, 127) / factor + mean
    return (code[idx] * c8.reshape(-1, 1)).reshape(w.shape), c


def test_nf4_matches_the_reference_and_torchao_and_bounds_the_error():
    # The code values torchao uses are the paper's (to its 4 decimals).
    assert np.abs(paper_code() - NF4_CODE.numpy()).max() <= 1.01e-4
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 128, 256, generator=gen) * 0.02  # a stack of 3 expert matrices
    w[1, :4] *= 30  # outliers: blocks and scale blocks of very different absmax
    parts = quantize_nf4(w)
    got = dequantize_nf4(*parts.values(), w.shape)
    to_nf4 = qlora._to_nf4()
    for e in range(3):
        # Each matrix quantised on its own: torchao's dequantisation of it, bit for bit.
        assert torch.equal(got[e], to_nf4(w[e], 64, 256).get_original_weight())
        want, c = reference(w[e], NF4_CODE)
        torch.testing.assert_close(got[e], want, rtol=1e-6, atol=1e-9)
        # Off the original by at most half the widest code gap times the block's absmax, plus
        # the double quantisation's error on that absmax (one 8-bit step: half for rounding,
        # a whole one where the block's largest absmax is clamped from 128 to 127).
        err = (got[e] - w[e]).reshape(-1, 64).abs().amax(1)
        step = (c - c.mean()).view(-1, 256).abs().amax(1).repeat_interleave(256) / 128
        assert (err <= c * NF4_CODE.diff().max() / 2 + step + 1e-7).all()
    rel = ((got - w).norm() / w.norm()).item()
    assert 0.01 < rel < 0.15, rel  # measured 0.09: 4 bits are not lossless, nor far off


def test_a_matrix_of_any_size_is_padded_and_cut_back():
    w = torch.randn(2, 33, 20) * 0.1  # 660 values: not a multiple of 64 * 256
    parts = quantize_nf4(w)
    assert parts["codes"].shape == (2, 16384 // 2)
    got = dequantize_nf4(*parts.values(), w.shape)
    assert got.shape == w.shape
    assert ((got - w).abs() <= w.abs().amax() * 0.15).all()


def _qlora_model(targets=("attention.q", "attention.v", "ffn", "shared_experts", "experts")):
    model = tiny_model(router={"top_k": 2})
    apply_lora(model, LoRAConfig(targets=list(targets), rank=4))
    _randomize_factors(model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


def test_quantised_products_equal_lora_on_the_dequantised_weights():
    """Forward and every LoRA factor's gradient: the NF4 model against the same model whose
    base holds the dequantised values as plain weights (the custom backward is checked)."""
    model = _qlora_model()
    counts = parameter_counts(model)
    # attention q/k/v/o x 3, the dense layer's 2, per MoE layer shared 2 and the experts
    assert quantize_base(model) == 4 * 3 + 2 + 2 * (2 + 1)
    assert isinstance(model.blocks[1].ffn.experts, NF4LoRAGroupedExperts)
    assert isinstance(model.blocks[0].attn.q_proj, NF4LoRALinear)
    assert type(model.blocks[0].attn.k_proj).__name__ == "NF4Linear"  # quantised, no LoRA
    plain = copy.deepcopy(model)
    assert dequantize_base(plain) == 4 * 3 + 2 + 2 * (2 + 1)
    assert not [n for n, _ in plain.named_buffers() if "_nf4_" in n]
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(3))
    losses, grads = [], []
    for m in (model, plain):
        loss = m(ids[:, :-1], ids[:, 1:]).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 2 * (2 * 3 + 2 + 2 * 4)
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-6, msg=name)
    # The NF4 weights still count as (frozen) parameters of the model.
    assert parameter_counts(model) == counts
    # The base is no parameter: nothing can give it a gradient or optimizer state.
    assert all("lora_" in n or not p.requires_grad for n, p in model.named_parameters())
    assert not [
        n
        for n, _ in model.named_parameters()
        if n.endswith(("q_proj.weight", "experts.w_in", "experts.w_out"))
    ]


def test_no_dequantised_weight_is_kept_for_the_backward():
    model = _qlora_model()
    quantize_base(model)
    # Every quantised weight's shape, stacked and per matrix (nn.Linear's (out, in) included).
    shapes = {
        shape
        for m in model.modules()
        for s in getattr(m, "nf4_shapes", {}).values()
        for shape in (tuple(s), tuple(s[1:]))
    }
    saved = []
    ids = torch.randint(0, 64, (2, 14))  # 26 tokens: no activation is shaped like a weight
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(tuple(t.shape)) or t, lambda t: t
    ):
        model(ids[:, :-1], ids[:, 1:]).loss.backward()
    assert saved and not [s for s in saved if s in shapes]
    # The plain LoRA model does keep its (float) weights for the backward: the check has teeth.
    plain = copy.deepcopy(model)
    dequantize_base(plain)
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(tuple(t.shape)) or t, lambda t: t
    ):
        plain(ids[:, :-1], ids[:, 1:]).loss.backward()
    assert [s for s in saved if s in shapes]


def test_base_memory_is_under_0_3_of_bf16():
    """The default-size fine-tuning model (configs/finetune-qlora.yaml): bytes of every NF4
    buffer (codes, int8 scales, factors, means) against 2 bytes per quantised value."""
    cfg = load_config("configs/finetune-qlora.yaml", ["model.init_from=x", "model.vocab_size=4096"])
    from moe.model.transformer import MoETransformer

    torch.manual_seed(0)
    model = MoETransformer(cfg.model)
    float_bytes = sum(p.nbytes for p in model.parameters())
    quantize_base(model)
    numel = sum(quantized_numel(m) for m in model.modules())
    ratio = nf4_bytes(model) / (2 * numel)
    assert ratio <= 0.3, ratio  # measured 0.258
    experts = model.blocks[0].ffn.experts
    assert isinstance(experts, NF4GroupedExperts) and experts.w_in_nf4_codes.dtype == torch.uint8
    # No float copy of a quantised weight stays: the model's float bytes fell by the weights'.
    assert sum(p.nbytes for p in model.parameters()) == float_bytes - 4 * numel
    assert sum(b.nbytes for b in model.buffers() if b.is_floating_point()) < 0.01 * numel


def test_qlora_without_torchao_is_refused_by_key(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(qlora.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError) as e:
        load_config("configs/finetune-qlora.yaml", ["model.init_from=ckpt"])
    assert e.value.problems == [
        "finetune.method: qlora quantises the base with torchao, which is not installed: "
        "pip install torchao==0.18.0 (or pip install -e .[qlora])"
    ]
    from launch.launch import main

    with pytest.raises(SystemExit) as e:
        main(
            [
                "configs/finetune-qlora.yaml",
                "--dry-run",
                "model.init_from=ckpt",
                f"output_dir={tmp_path / 'runs'}",
            ]
        )
    assert e.value.code == 2 and "pip install torchao" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
