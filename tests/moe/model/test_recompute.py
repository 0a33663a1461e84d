"""Activation recompute (moe/model/recompute.py) changes memory, never a gradient or a statistic:
every parameter's gradient, the losses and the MoE layers' step counters, published metrics and
loss-free bias updates equal those of ``none`` under ``full`` and ``selective``; routing runs
once per micro-batch; saved activations shrink none > selective > full."""

import copy

import pytest
import torch

from moe.config.run import load_config
from moe.core.errors import ConfigError
from moe.model.moe_layer import MoEConfig
from moe.model.recompute import apply_recompute, saved_activation_bytes
from moe.model.router import RouterConfig
from moe.model.transformer import ModelConfig, MoETransformer
from moe.training.hooks import StepState
from moe.training.routing import RouterBalance

VOCAB, B, S = 64, 2, 16


def model_config(**moe) -> ModelConfig:
    """4 layers: a dense first layer, then MoE layers with shared experts, top-2, z-loss and the
    loss-free bias (so that a double-counted load would move the bias differently)."""
    extra = moe.pop("model", {})
    router = RouterConfig(top_k=2, z_loss_coef=0.01, bias_update_rate=0.01, **moe.pop("router", {}))
    moe_cfg = MoEConfig(
        **{
            "num_experts": 4,
            "expert_hidden": 16,
            "num_shared_experts": 1,
            "first_dense_layers": 1,
            "router": router,
            **moe,
        }
    )
    return ModelConfig(
        vocab_size=VOCAB, d_model=32, n_layers=4, n_heads=4, max_seq_len=S, moe=moe_cfg, **extra
    )


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (B, S + 1), generator=g) for _ in range(n)]


def step_state(step: int) -> StepState:
    return StepState(
        step=step,
        max_steps=2,
        loss=0.0,
        lm_loss=0.0,
        aux_loss=0.0,
        lr=0.0,
        grad_norm=None,
        step_seconds=1.0,
        tokens_per_step=1,
        samples_per_step=1,
        is_log_step=True,
    )


def train_steps(cfg: ModelConfig, mode: str, every_n: int = 1, steps: int = 2, accum: int = 2):
    """Two optimizer steps of two micro-batches each (no update: gradients are compared), with
    the training hook that publishes MoE metrics and moves the loss-free bias."""
    torch.manual_seed(0)
    model = MoETransformer(copy.deepcopy(cfg))
    apply_recompute(model, mode, every_n)
    hook = RouterBalance(model.moe_layers())
    router_calls = []
    for layer in model.moe_layers():
        layer.router.register_forward_hook(lambda *_: router_calls.append(1))
    data = batches(steps * accum)
    out = {"grads": [], "losses": [], "metrics": [], "bias": [], "counters": []}
    for step in range(steps):
        model.zero_grad()
        torch.manual_seed(100 + step)  # router jitter / noise draws
        for m in range(accum):
            batch = data[step * accum + m]
            res = model(batch[:, :-1], batch[:, 1:])
            res.loss.backward()
            out["losses"].append(torch.stack([res.loss, res.lm_loss, res.aux_loss]).detach())
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        out["counters"].append(
            [
                torch.cat([layer.step_load_E, layer.step_sums]).clone()
                for layer in model.moe_layers()
            ]
        )
        state = step_state(step + 1)
        hook.after_step(state)
        out["metrics"].append(state.extra)
        out["bias"].append([layer.router.score_bias.clone() for layer in model.moe_layers()])
    out["router_calls"] = len(router_calls)
    return out


CASES = {
    "dropless": {},
    "capacity-dropping": {"capacity_factor": 0.75},
    "noisy-router-wide-experts": {
        "expert_hidden": 48,  # hidden > d_model: scale after w_out
        "router": {"jitter_eps": 0.1, "logit_noise_std": 0.5},
    },
    "open-weights-options": {
        "shared_expert_gate": True,
        "model": {"head_dim": 12, "qkv_bias": True, "qk_norm": "projection"},
    },
    "per-head-query-key-norms": {"model": {"qk_norm": "head", "n_kv_heads": 2}},
    "gelu-postnorm-layernorm": {
        "activation": "gelu",
        "capacity_factor": 1.0,
        "model": {"norm": "layernorm", "norm_placement": "post"},
    },
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_gradients_losses_and_moe_statistics_do_not_change(case):
    cfg = model_config(**copy.deepcopy(case))
    ref = train_steps(cfg, "none")
    for mode in ("full", "selective"):
        got = train_steps(cfg, mode)
        for step, (g_ref, g_got) in enumerate(zip(ref["grads"], got["grads"])):
            assert g_ref.keys() == g_got.keys()
            for name in g_ref:
                torch.testing.assert_close(
                    g_got[name],
                    g_ref[name],
                    rtol=1e-6,
                    atol=1e-12,
                    msg=f"{mode}, step {step}: gradient of {name}",
                )
        torch.testing.assert_close(
            torch.stack(got["losses"]), torch.stack(ref["losses"]), rtol=0, atol=0
        )
        for step in range(len(ref["counters"])):
            for layer, (a, b) in enumerate(zip(got["counters"][step], ref["counters"][step])):
                torch.testing.assert_close(
                    a, b, rtol=0, atol=0, msg=f"{mode}: step counters of MoE layer {layer}"
                )
            assert got["metrics"][step] == ref["metrics"][step], mode
            for a, b in zip(got["bias"][step], ref["bias"][step]):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{mode}: loss-free bias")
        assert got["router_calls"] == ref["router_calls"], f"{mode}: routing ran again"
    # Teeth: the routers ran once per layer and micro-batch, counted every routed copy once,
    # and the bias moved.
    assert ref["router_calls"] == 3 * 2 * 2
    routed = ref["counters"][0][0][4]
    assert routed == 2 * B * S * 2
    for bias, counters in zip(ref["bias"][0], ref["counters"][0]):
        load_E = counters[:4]
        assert bias.abs().sum() > 0 or (load_E == load_E[0]).all()  # capacity can balance it
    assert any(b.abs().sum() > 0 for b in ref["bias"][0])
    for g in ref["grads"][0].values():
        assert g.abs().sum() > 0


def test_an_moe_layer_inside_a_recompute_region_is_refused():
    """The guarantee is structural: routing inside a checkpointed region fails at once."""
    model = MoETransformer(model_config())
    apply_recompute(model, "full")
    model.blocks[1].recompute_block = True  # what a naive whole-block checkpoint would do
    batch = batches(1)[0]
    with pytest.raises(RuntimeError, match="MoELayer routing and dispatch ran inside"):
        model(batch[:, :-1], batch[:, 1:])
    with torch.no_grad():  # no region without gradients: evaluation and generation run plainly
        model(batch[:, :-1], batch[:, 1:])


def saved_bytes(cfg: ModelConfig, mode: str, every_n: int = 1) -> int:
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    apply_recompute(model, mode, every_n)
    batch = batches(1)[0]
    with saved_activation_bytes(exclude=model) as saved:
        loss = model(batch[:, :-1], batch[:, 1:]).loss
    loss.backward()
    return saved["bytes"]


def test_saved_activations_none_over_selective_over_full():
    cfg = model_config(expert_hidden=64)
    none, selective, full = (saved_bytes(cfg, m) for m in ("none", "selective", "full"))
    assert none > selective > full > 0, (none, selective, full)
    # Full keeps at least each block's input (B, S, D) fp32, and far less than none.
    assert full >= cfg.n_layers * B * S * cfg.d_model * 4
    assert full < none / 2, (none, full)


def test_every_second_block_recomputes():
    cfg = model_config()
    assert apply_recompute(MoETransformer(cfg), "full", 2) == [0, 2]
    none, full, half = (
        saved_bytes(cfg, "none"),
        saved_bytes(cfg, "full"),
        saved_bytes(cfg, "full", 2),
    )
    assert full < half < none, (full, half, none)

    # Attention runs twice (forward and recompute) exactly in the blocks that recompute.
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    apply_recompute(model, "full", 2)
    calls = [0] * cfg.n_layers
    for i, block in enumerate(model.blocks):
        block.attn.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    batch = batches(1)[0]
    model(batch[:, :-1], batch[:, 1:]).loss.backward()
    assert calls == [2, 1, 2, 1]


def test_apply_recompute_sets_the_switches_and_resets_them():
    model = MoETransformer(model_config())
    assert apply_recompute(model, "selective") == [0, 1, 2, 3]
    for block in model.blocks:
        assert block.recompute_norms and block.attn.recompute_core
        assert block.attn.recompute_qk_norms
        assert not (block.recompute_block or block.recompute_attention)
        acts = [
            m.recompute_activation
            for m in block.ffn.modules()
            if hasattr(m, "recompute_activation")
        ]
        assert acts and all(acts)  # dense FFN; routed and shared experts
    apply_recompute(model, "full")
    assert model.blocks[0].recompute_block and not model.blocks[0].recompute_attention  # dense
    for block in model.blocks[1:]:  # MoE: routing and dispatch outside the regions
        assert block.recompute_attention and not block.recompute_block
        assert block.ffn.recompute_experts and not block.attn.recompute_core
    apply_recompute(model, "none")
    for block in model.blocks:
        flags = [
            block.recompute_block,
            block.recompute_attention,
            block.recompute_norms,
            block.attn.recompute_core,
            block.attn.recompute_qk_norms,
        ]
        flags += [
            getattr(m, name)
            for m in block.ffn.modules()
            for name in ("recompute_experts", "recompute_activation")
            if hasattr(m, name)
        ]
        assert not any(flags)
    with pytest.raises(ValueError, match="every_n_blocks"):
        apply_recompute(model, "full", 0)


def test_config_refuses_unknown_mode_and_bad_interval():
    with pytest.raises(ConfigError) as e:
        load_config(
            "configs/default.yaml", ["train.recompute=bogus", "train.recompute_every_n_blocks=1"]
        )
    assert "train.recompute: 'bogus' is not allowed" in str(e.value)
    with pytest.raises(ConfigError, match="train.recompute_every_n_blocks: must be >= 1, got 0"):
        load_config("configs/default.yaml", ["train.recompute_every_n_blocks=0"])
    cfg = load_config("configs/default.yaml", ["train.recompute=selective"])
    assert cfg.train.recompute == "selective" and cfg.train.recompute_every_n_blocks == 1
