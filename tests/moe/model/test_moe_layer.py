"""The MoE layer against a slow, obvious per-token reference in float64."""

import math

import pytest
import torch
import torch.nn.functional as F

from moe.model.moe_layer import STEP_SUMS, SUM, MoEConfig, MoELayer
from moe.model.router import RouterConfig, capacity

D, E, H = 16, 8, 12


def reference(x, layer: MoELayer):
    """Per token: score every expert, pick top-k, weight, run each chosen expert on its own."""
    cfg, rc = layer.cfg, layer.cfg.router
    Wr = layer.router.weight.double()
    w_in, w_out = layer.experts.w_in.double(), layer.experts.w_out.double()
    T = x.shape[0]
    choices = []  # (token, expert, weight)
    for t in range(T):
        logits = Wr @ x[t]
        scores = logits.softmax(-1) if rc.score_func == "softmax" else logits.sigmoid()
        sel = (scores + layer.router.score_bias.double()).tolist()
        chosen = sorted(range(E), key=lambda e: -sel[e])[: rc.top_k]
        if rc.order == "topk_then_softmax":
            ws = torch.stack([logits[e] for e in chosen]).softmax(-1)
        else:
            ws = torch.stack([scores[e] for e in chosen])
        if rc.renormalize:
            ws = ws / ws.sum()
        ws = ws * rc.scaling_factor
        choices += [(t, e, w) for e, w in zip(chosen, ws)]
    if cfg.capacity_factor is not None:
        cap = capacity(T, E, rc.top_k, cfg.capacity_factor)
        kept = []
        for e in range(E):
            mine = [(i, c) for i, c in enumerate(choices) if c[1] == e]
            mine.sort(key=lambda ic: (-float(ic[1][2].detach()), ic[0]))
            kept += [c for _, c in mine[:cap]]
        dropped = len(choices) - len(kept)
        choices = kept
    else:
        dropped = 0
    out = [torch.zeros(D, dtype=torch.float64) for _ in range(T)]
    for t, e, w in choices:
        h = x[t] @ w_in[e]
        if cfg.activation == "swiglu":
            h = F.silu(h[:H]) * h[H:]
        else:
            h = F.gelu(h)
        out[t] = out[t] + w * (h @ w_out[e])
    out = torch.stack(out)
    if layer.shared_mlp is not None:
        shared = F.linear(
            _act(F.linear(x, layer.shared_mlp.w_in.weight.double()), cfg, layer.shared_mlp.hidden),
            layer.shared_mlp.w_out.weight.double(),
        )
        if layer.shared_gate is not None:  # Qwen2-MoE: sigmoid(x . g) per token
            shared = torch.sigmoid(x @ layer.shared_gate.weight.double()[0])[:, None] * shared
        out = out + shared
    return out, dropped


def _act(h, cfg, hidden):
    if cfg.activation == "swiglu":
        return F.silu(h[..., :hidden]) * h[..., hidden:]
    return F.gelu(h)


CASES = [
    dict(top_k=1, score_func="softmax"),
    dict(top_k=2, score_func="softmax"),
    dict(top_k=2, score_func="softmax", order="topk_then_softmax"),
    dict(top_k=8, score_func="softmax", renormalize=True),
    dict(top_k=2, score_func="sigmoid", renormalize=True, scaling_factor=2.5),
    dict(top_k=1, score_func="sigmoid"),
]


def make_layer(router: dict, dtype, **moe):
    torch.manual_seed(3)
    cfg = MoEConfig(num_experts=E, expert_hidden=H, router=RouterConfig(**router), **moe)
    return MoELayer(D, cfg).to(dtype)


@pytest.mark.parametrize("router", CASES, ids=lambda r: "-".join(f"{v}" for v in r.values()))
@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"capacity_factor": 1.0},
        {"num_shared_experts": 2},
        {"activation": "gelu", "capacity_factor": 0.5},
        {"num_shared_experts": 1, "shared_expert_gate": True},
        {"permute": "gather"},
        {"permute": "gather", "activation": "gelu", "capacity_factor": 0.5},
    ],
    ids=["dropless", "cf1.0", "shared", "gelu-cf0.5", "gated-shared", "gather", "gather-cf0.5"],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64-loop", "f32-grouped"])
def test_matches_reference_outputs_and_gradients(router, variant, dtype):
    layer = make_layer(router, dtype, **variant)
    if variant.get("num_shared_experts"):
        assert layer.shared_mlp is not None
    x = torch.randn(2, 20, D, dtype=torch.float64)
    x_ours = x.clone().to(dtype).requires_grad_(True)
    y, _ = layer(x_ours)
    x_ref = x.reshape(-1, D).clone().requires_grad_(True)
    ref_params = [layer.router.weight, layer.experts.w_in, layer.experts.w_out]
    y_ref, dropped = reference(x_ref, layer)
    tol = dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(y.reshape(-1, D).double(), y_ref, **tol)
    assert int(round(layer.stats["dropped_fraction"].item() * 40 * router["top_k"])) == dropped

    g = torch.randn_like(y_ref)
    grads = torch.autograd.grad(y.reshape(-1, D), [x_ours] + ref_params, g.to(dtype))
    # Reference gradients: same function of float64 copies of the same parameters.
    leaves = [p.detach().double().requires_grad_(True) for p in ref_params]
    with _swapped(layer, leaves):
        y_ref2, _ = reference(x_ref, layer)
    ref_grads = torch.autograd.grad(y_ref2, [x_ref] + leaves, g)
    for ours, ref in zip(grads, ref_grads):
        torch.testing.assert_close(ours.double().reshape(ref.shape), ref, **tol)


class _swapped:
    """Temporarily make the layer's router/expert weights the given float64 leaves."""

    def __init__(self, layer, leaves):
        self.layer, self.leaves = layer, leaves

    def __enter__(self):
        m = self.layer
        self.saved = (m.router.weight, m.experts.w_in, m.experts.w_out)
        for mod, name, leaf in zip(
            (m.router, m.experts, m.experts), ("weight", "w_in", "w_out"), self.leaves
        ):
            del mod._parameters[name]
            setattr(mod, name, leaf)

    def __exit__(self, *exc):
        m = self.layer
        for mod, name, p in zip(
            (m.router, m.experts, m.experts), ("weight", "w_in", "w_out"), self.saved
        ):
            delattr(mod, name)
            mod.register_parameter(name, p)


def test_drop_accounting_matches_direct_count():
    layer = make_layer(dict(top_k=2), torch.float32, capacity_factor=0.75)
    x = torch.randn(1, 64, D)
    layer(x)
    r = layer.router(x.reshape(-1, D))
    cap = capacity(64, E, 2, 0.75)
    counts = torch.bincount(r.indices_TK.reshape(-1), minlength=E)
    expected_kept = counts.clamp(max=cap)
    assert torch.equal(layer.stats["tokens_per_expert"], expected_kept)
    direct_dropped = int((counts - cap).clamp(min=0).sum())
    assert math.isclose(layer.stats["dropped_fraction"].item(), direct_dropped / 128)
    assert direct_dropped > 0


def test_experts_with_zero_tokens():
    layer = make_layer(dict(top_k=1), torch.float32)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[3, 0] = 10.0  # every token with x[0] > 0 goes to expert 3
    x = torch.randn(1, 10, D)
    x[..., 0] = x[..., 0].abs() + 1
    y, _ = layer(x.requires_grad_())
    y.sum().backward()
    assert layer.stats["tokens_per_expert"].tolist() == [0, 0, 0, 10, 0, 0, 0, 0]
    assert (
        layer.experts.w_in.grad[3].abs().sum() > 0 and layer.experts.w_in.grad[0].abs().sum() == 0
    )


def test_step_counters_stay_exact_fp32_in_a_bf16_layer():
    torch.manual_seed(0)
    layer = MoELayer(16, MoEConfig(num_experts=4, expert_hidden=16)).to(torch.bfloat16)
    total = torch.zeros(4)
    for _ in range(3):
        layer(torch.randn(2, 300, 16, dtype=torch.bfloat16))
        total += layer.stats["tokens_per_expert"].float()
    assert layer.step_load_E.dtype == torch.float32 and layer.step_sums.dtype == torch.float32
    assert torch.equal(layer.step_load_E, total)  # exact, though counts exceed 256
    assert layer.step_sums[SUM["routed"]].item() == 3 * 600 * 2  # routed copies


def test_every_step_sum_is_added_up_by_name():
    """Each entry of STEP_SUMS holds its own quantity over a step's training micro-batches,
    whatever its position; a validation pass adds nothing."""
    torch.manual_seed(0)
    layer = MoELayer(
        16,
        MoEConfig(num_experts=4, expert_hidden=16, router=RouterConfig(top_k=2, z_loss_coef=1e-3)),
    )
    want = dict.fromkeys(STEP_SUMS, 0.0)
    for tokens in (5, 7):
        layer(torch.randn(1, tokens, 16))
        st = layer.stats
        for name, value in (
            ("routed", 2 * tokens),
            ("router_entropy", st["router_entropy"]),
            ("aux_loss", st["aux_loss"]),
            ("z_loss", st["z_loss"]),
            ("micro_batches", 1),
        ):
            want[name] += float(value)
    layer.eval()
    layer(torch.randn(1, 3, 16))
    got = {name: layer.step_sums[SUM[name]].item() for name in STEP_SUMS}
    assert got == pytest.approx(want, rel=1e-6)
    assert all(v > 0 for v in want.values()) and len(SUM) == len(STEP_SUMS)
