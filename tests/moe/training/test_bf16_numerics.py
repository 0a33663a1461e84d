"""What stays fp32 when the model runs in bf16, on one process: the router (logits, scores,
top-k, combine weights and their product with the expert rows, balancing losses), the
language-model loss, the expert bias and the step counters, the norm statistics; and how
train.precision / grad_reduce_dtype reach DeepSpeed.

Each numeric check compares with an fp64 reference computed from the same bf16 inputs, with a
tolerance of fp32 rounding (about 1e-6): a computation done in bf16 misses it by
up to 2^-8 = 4e-3 relative.
"""

import pytest
import torch
import torch.nn.functional as F

from moe.config.run import RunConfig
from moe.core.config_schema import from_dict
from moe.core.errors import ConfigError
from moe.model.experts import GroupedExperts, scale_rows
from moe.model.moe_layer import SUM, MoEConfig, MoELayer
from moe.model.norms import LayerNorm, RMSNorm
from moe.model.router import RouterConfig, TopKRouter, load_balancing_loss
from moe.model.transformer import ModelConfig, MoETransformer

BF16_ULP = 2.0**-7  # spacing of bf16 numbers in [1, 2): 8 significant bits, 7 stored


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_router_computes_in_fp32_on_bf16_input(score_func):
    torch.manual_seed(0)
    cfg = RouterConfig(top_k=2, score_func=score_func, z_loss_coef=1e-3, bias_update_rate=1e-3)
    router = TopKRouter(64, 8, cfg).bfloat16()
    router.score_bias.copy_(torch.linspace(-0.01, 0.01, 8))
    x_TD = torch.randn(256, 64).bfloat16()
    r = router(x_TD)
    for name in ("weights_TK", "scores_TE", "aux_loss", "z_loss", "entropy"):
        assert getattr(r, name).dtype == torch.float32, name

    logits64 = x_TD.double() @ router.weight.double().T  # the same bf16 values, exactly
    scores64 = logits64.softmax(-1) if score_func == "softmax" else logits64.sigmoid()
    select64 = scores64 + router.score_bias.double()
    ref_idx = select64.topk(2, dim=-1).indices
    assert torch.equal(r.indices_TK.sort(-1).values, ref_idx.sort(-1).values)
    torch.testing.assert_close(r.scores_TE.double(), scores64, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(
        r.weights_TK.double(), scores64.gather(-1, r.indices_TK), rtol=1e-5, atol=1e-7
    )
    probs64 = scores64 if score_func == "softmax" else scores64 / scores64.sum(-1, keepdim=True)
    torch.testing.assert_close(
        r.aux_loss.double(), load_balancing_loss(probs64, ref_idx, 8), rtol=1e-5, atol=0
    )
    torch.testing.assert_close(
        r.z_loss.double(), torch.logsumexp(logits64, -1).pow(2).mean(), rtol=1e-5, atol=0
    )


def test_expert_bias_and_step_counters_stay_fp32_under_a_cast():
    torch.manual_seed(0)
    cfg = MoEConfig(
        num_experts=4, expert_hidden=16, router=RouterConfig(top_k=2, bias_update_rate=1e-4)
    )
    layer = MoELayer(32, cfg).to(torch.bfloat16)
    assert layer.experts.w_in.dtype == torch.bfloat16  # the cast did happen
    for buf in (layer.router.score_bias, layer.step_load_E, layer.step_sums):
        assert buf.dtype == torch.float32
    # Updates of 1e-4 on a bias of 0.5: bf16's spacing there is 2^-8 ~ 4e-3, so every update
    # would be rounded away.
    layer.router.score_bias.fill_(0.5)
    load_E = torch.tensor([10.0, 0.0, 5.0, 5.0])  # mean 5: expert 0 down, 1 up, 2 and 3 kept
    for _ in range(100):
        layer.router.update_bias(load_E)
    expected = torch.tensor([0.5 - 100e-4, 0.5 + 100e-4, 0.5, 0.5])
    # fp32: 100 roundings of at most 3e-8 each; bf16 would be off by the whole 0.01.
    torch.testing.assert_close(layer.router.score_bias, expected, rtol=0, atol=1e-5)
    # Counts past 256 (bf16 counts integers exactly only up to 256): 6 batches of 64 tokens,
    # 2 copies each, are 768 routed copies.
    layer.train()
    routed = torch.zeros(4)
    with torch.no_grad():
        for _ in range(6):
            layer(torch.randn(2, 32, 32).bfloat16())
            routed += layer.stats["tokens_per_expert"].float()
    assert torch.equal(layer.step_load_E, routed) and routed.sum() == 768
    assert layer.step_sums[SUM["routed"]] == 768 and layer.step_sums[SUM["micro_batches"]] == 6


def test_combine_weights_scale_bf16_rows_in_fp32_with_an_fp32_gradient():
    """The router's combine weights multiply the experts' bf16 rows in fp32 and are rounded once
    with the product; their gradient (the router's share of the language-model gradient) is
    summed in fp32. A bf16 multiply would round the weight and the gradient to 8 bits."""
    torch.manual_seed(0)
    h_NH = torch.randn(512, 64).bfloat16()
    scale_N = (0.2 + 0.6 * torch.rand(512)).requires_grad_()  # fp32, like the router's weights
    g_NH = torch.randn(512, 64).bfloat16()
    out = scale_rows(h_NH, scale_N)
    assert out.dtype == torch.bfloat16
    out.backward(g_NH)
    assert scale_N.grad.dtype == torch.float32
    ref64 = h_NH.double() * scale_N.detach().double()[:, None]
    assert _bf16_rounding_errors(out, ref64).max() <= 0.5 + 1e-3
    grad64 = (g_NH.double() * h_NH.double()).sum(-1)
    torch.testing.assert_close(scale_N.grad.double(), grad64, rtol=1e-5, atol=1e-6)
    # The same check catches the bf16 multiply (weight and gradient rounded to bf16).
    naive = scale_N.detach().clone().requires_grad_()
    (h_NH * naive.to(torch.bfloat16)[:, None]).backward(g_NH)
    assert ((naive.grad.double() - grad64).abs() / grad64.abs().clamp_min(1e-3)).max() > 1e-3


@pytest.mark.parametrize("hidden", [16, 64])  # the weight scales the activation / the output
def test_bf16_experts_give_their_combine_weights_an_fp32_gradient(hidden):
    torch.manual_seed(0)
    experts = GroupedExperts(4, 32, hidden, "swiglu").bfloat16()
    x_ND = torch.randn(64, 32).bfloat16()
    counts_E = torch.tensor([16, 16, 16, 16])
    scale_N = torch.rand(64, requires_grad=True)
    y_ND = experts(x_ND, counts_E, scale_N)
    assert y_ND.dtype == torch.bfloat16
    y_ND.float().pow(2).sum().backward()
    assert scale_N.grad.dtype == torch.float32
    # Not a bf16 number: formed in fp32, never rounded to 8 bits.
    assert not torch.equal(scale_N.grad.bfloat16().float(), scale_N.grad)


def _bf16_rounding_errors(out_bf16: torch.Tensor, ref64: torch.Tensor) -> torch.Tensor:
    """|out - ref| in units of the bf16 spacing at ref."""
    ulp = BF16_ULP * 2.0 ** torch.floor(torch.log2(ref64.abs().clamp_min(1e-30)))
    return (out_bf16.double() - ref64).abs() / ulp


def _naive_bf16_rmsnorm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
def test_norm_statistics_are_fp32_so_bf16_output_is_rounded_once(kind):
    """Statistics in fp32, then one rounding to bf16: every output is within half a bf16 spacing
    (plus fp32 noise) of the fp64 result. Statistics in bf16 round several times on the way."""
    torch.manual_seed(0)
    norm = (RMSNorm(256) if kind == "rmsnorm" else LayerNorm(256)).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.rand(256))
    # An offset that makes a bf16 variance lose digits (it cancels in x - mean).
    x = (torch.randn(64, 256) * 0.5 + 3.0).bfloat16()
    x64, w64 = x.double(), norm.weight.double()
    if kind == "rmsnorm":
        ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + norm.eps) * w64
    else:
        ref = F.layer_norm(x64, (256,), w64, norm.bias.double(), norm.eps)
    out = norm(x)
    assert out.dtype == torch.bfloat16
    assert _bf16_rounding_errors(out, ref).max() <= 0.5 + 1e-3
    if kind == "rmsnorm":  # the same check catches the statistics computed in bf16
        naive = _naive_bf16_rmsnorm(x, norm.weight, norm.eps)
        assert _bf16_rounding_errors(naive, ref).max() > 0.5 + 1e-3


def test_language_model_and_balancing_losses_are_fp32_in_a_bf16_model():
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=512,
        d_model=64,
        n_layers=2,
        n_heads=4,
        max_seq_len=64,
        moe=MoEConfig(
            num_experts=4, expert_hidden=32, router=RouterConfig(top_k=2, z_loss_coef=1e-3)
        ),
    )
    model = MoETransformer(cfg).bfloat16()
    ids = torch.randint(0, 512, (2, 33))
    out = model(ids[:, :-1], ids[:, 1:])
    assert out.logits.dtype == torch.bfloat16
    for name in ("loss", "lm_loss", "aux_loss"):
        assert getattr(out, name).dtype == torch.float32, name
    # The cross-entropy of the very bf16 logits, in fp64: a bf16 log-softmax or mean would be off
    # by up to half a bf16 spacing of ~6.2, i.e. 0.016.
    ref = F.cross_entropy(out.logits.double().flatten(0, 1), ids[:, 1:].flatten())
    torch.testing.assert_close(out.lm_loss.double(), ref, rtol=1e-6, atol=0)
    assert out.aux_loss > 0 and torch.isfinite(out.loss)


def _cfg(**train):
    return from_dict(RunConfig, {"train": train})


def test_precision_reaches_deepspeed():
    from moe.parallel.deepspeed_adapter import deepspeed_config

    assert deepspeed_config(_cfg(), 2)["bf16"] == {"enabled": False}
    assert "data_types" not in deepspeed_config(_cfg(), 2)
    ds = deepspeed_config(_cfg(precision="bf16"), 2)
    assert ds["bf16"] == {"enabled": True, "immediate_grad_update": False}
    assert ds["communication_data_type"] == "fp32"
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"}
    ds = deepspeed_config(_cfg(precision="bf16", grad_reduce_dtype="bf16"), 2)
    assert ds["communication_data_type"] == "bf16"
    assert ds["data_types"] == {"grad_accum_dtype": "bf16"}
    ds = deepspeed_config(
        from_dict(
            RunConfig,
            {
                "train": {"precision": "bf16", "immediate_grad_update": True},
                "parallel": {"zero_stage": 1},
            },
        ),
        2,
    )
    assert ds["bf16"] == {"enabled": True, "immediate_grad_update": True}


def test_immediate_grad_update_is_refused_where_deepspeeds_bf16_optimizer_does_not_run():
    ok = {
        "train": {"precision": "bf16", "immediate_grad_update": True},
        "parallel": {"zero_stage": 1},
    }
    assert from_dict(RunConfig, ok).train.immediate_grad_update
    for train, stage in (
        ({}, 1),  # fp32
        ({"precision": "bf16"}, 2),
        ({"precision": "bf16", "grad_reduce_dtype": "bf16"}, 1),
    ):
        bad = {"train": {**train, "immediate_grad_update": True}, "parallel": {"zero_stage": stage}}
        with pytest.raises(
            ConfigError, match=r"train.immediate_grad_update: needs train.precision"
        ):
            from_dict(RunConfig, bad)


def test_flat_grad_ops_is_taken_with_either_zero_optimizer_and_refused_without():
    for train, stage in (
        ({"precision": "bf16"}, 1),  # DeepSpeed's BF16 optimizer
        ({"precision": "bf16"}, 2),
        ({"precision": "bf16", "grad_reduce_dtype": "bf16"}, 1),
        ({}, 1),  # fp32
        ({}, 2),
    ):
        cfg = {"train": {**train, "flat_grad_ops": True}, "parallel": {"zero_stage": stage}}
        assert from_dict(RunConfig, cfg).train.flat_grad_ops
    bad = {"train": {"flat_grad_ops": True}, "parallel": {"zero_stage": 0}}
    with pytest.raises(ConfigError, match=r"train.flat_grad_ops: needs parallel.zero_stage 1 or 2"):
        from_dict(RunConfig, bad)


def test_fp16_and_bf16_at_zero_stage_0_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"train.precision: fp16 is not supported .*use bf16"):
        _cfg(precision="fp16")
    with pytest.raises(
        ConfigError,
        match=r"parallel.zero_stage: train.precision bf16 needs ZeRO "
        r"stage 1 or 2",
    ):
        from_dict(RunConfig, {"train": {"precision": "bf16"}, "parallel": {"zero_stage": 0}})
