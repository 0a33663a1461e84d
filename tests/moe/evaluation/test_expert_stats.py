"""Expert statistics collected from the layers' own routing, checked against routing recomputed
here from each layer's input and router weights."""

import math

import pytest
import torch

from moe.evaluation.expert_stats import ExpertStatsCollector
from moe.model.moe_layer import MoEConfig
from moe.model.router import RouterConfig
from moe.model.transformer import ModelConfig, MoETransformer
from tests.helpers.threads import single_thread  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")

V, E, K = 23, 4, 2


def make_model(capacity_factor):
    torch.manual_seed(3)
    moe = MoEConfig(
        num_experts=E,
        expert_hidden=16,
        capacity_factor=capacity_factor,
        router=RouterConfig(top_k=K),
    )
    m = MoETransformer(
        ModelConfig(vocab_size=V, d_model=16, n_layers=3, n_heads=2, max_seq_len=32, moe=moe)
    )
    with torch.no_grad():  # decisive, unbalanced routing
        for layer in m.moe_layers():
            layer.router.weight.mul_(40)
    return m.eval()


def reference_routing(model, batches):
    """Per layer and batch: softmax router probabilities recomputed from the layer's input."""
    inputs = {i: [] for i in range(len(model.moe_layers()))}
    hooks = [
        layer.register_forward_pre_hook(lambda mod, args, i=i: inputs[i].append(args[0]))
        for i, layer in enumerate(model.moe_layers())
    ]
    with torch.no_grad():
        for b in batches:
            model(b)
    for h in hooks:
        h.remove()
    out = {}
    for i, layer in enumerate(model.moe_layers()):
        w = layer.router.weight.detach()
        out[i] = [(x.reshape(-1, x.shape[-1]) @ w.T).softmax(-1) for x in inputs[i]]
    return out


def collect(model, batches):
    with ExpertStatsCollector(model) as c, torch.no_grad():
        for b in batches:
            c.observe(b)
            model(b)
    return c


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_loads_dropped_fraction_and_entropy_match_recomputed_routing(capacity_factor):
    model = make_model(capacity_factor)
    torch.manual_seed(4)
    batches = [torch.randint(0, V, (3, 20)) for _ in range(3)] + [torch.randint(0, V, (1, 7))]
    c = collect(model, batches)
    summary = c.summary()
    ref = reference_routing(model, batches)
    assert [s["block"] for s in summary] == [0, 1, 2]
    T_total = sum(b.numel() for b in batches)
    for i, layer in enumerate(summary):
        selected = torch.zeros(E, dtype=torch.long)
        kept = torch.zeros(E, dtype=torch.long)
        entropy = 0.0
        for probs_TE in ref[i]:
            T = probs_TE.shape[0]
            sel_E = torch.bincount(probs_TE.topk(K, -1).indices.flatten(), minlength=E)
            selected += sel_E
            cap = math.ceil(capacity_factor * T * K / E) if capacity_factor else T * K
            kept += sel_E.clamp(max=cap)
            entropy -= float((probs_TE * probs_TE.clamp_min(1e-20).log()).sum())
        assert layer["tokens"] == T_total and layer["routed_copies"] == T_total * K
        assert layer["selected_per_expert"] == selected.tolist()
        assert layer["kept_per_expert"] == kept.tolist()
        dropped = 1 - kept.sum().item() / (T_total * K)
        assert math.isclose(layer["dropped_fraction"], dropped, rel_tol=1e-6, abs_tol=1e-9)
        assert math.isclose(layer["router_entropy"], entropy / T_total, rel_tol=1e-4)
        assert math.isclose(sum(layer["load_fraction"]), 1.0, rel_tol=1e-9)
        loads = kept.double()
        assert math.isclose(
            layer["max_over_mean_load"], float(loads.max() / loads.mean()), rel_tol=1e-9
        )
    if capacity_factor:
        assert any(layer["dropped_fraction"] > 0.05 for layer in summary)  # the case has teeth
    else:
        assert all(layer["dropped_fraction"] == 0 for layer in summary)


def test_token_preferences_are_routing_shares_of_frequent_tokens():
    model = make_model(None)
    torch.manual_seed(5)
    batches = [torch.randint(0, V, (4, 25)) for _ in range(2)]
    c = collect(model, batches)
    ref = reference_routing(model, batches)
    tokens = torch.cat([b.flatten() for b in batches])
    freq = torch.bincount(tokens, minlength=V)
    rare = int(freq.argmin())
    summary = c.summary(decode_piece=lambda v: f"<{v}>", top_n=3, min_count=int(freq[rare]) + 1)
    for i, layer in enumerate(summary):
        indices_TK = torch.cat([p.topk(K, -1).indices for p in ref[i]])
        for e, prefs in enumerate(layer["top_tokens"]):
            # A token's K experts are distinct: count the positions that chose e.
            routed_V = torch.bincount(tokens[(indices_TK == e).any(-1)], minlength=V)
            share_V = routed_V.double() / freq.double()
            ranked = sorted(
                (v for v in range(V) if freq[v] > freq[rare]),
                key=lambda v: (-share_V[v].item(), -freq[v].item(), v),
            )
            assert [p["id"] for p in prefs] == ranked[:3]
            assert all(math.isclose(p["share"], round(share_V[p["id"]].item(), 4)) for p in prefs)
            for p in prefs:
                assert p["piece"] == f"<{p['id']}>" and p["count"] == int(freq[p["id"]])
                assert p["routed"] == int(routed_V[p["id"]])
                assert p["id"] != rare


def test_hooks_are_removed_and_observe_is_required():
    model = make_model(None)
    ids = torch.randint(0, V, (2, 8))
    c = collect(model, [ids])
    with torch.no_grad():
        model(ids)  # after the context: not counted
    assert c.summary()[0]["tokens"] == ids.numel()
    with pytest.raises(RuntimeError, match="observe"), ExpertStatsCollector(model), torch.no_grad():
        model(ids)


def test_specialisation_finds_the_tokens_a_deliberately_specialised_router_sends():
    """One MoE block whose attention adds nothing and whose router reads the token embedding:
    token v goes to expert v % E (top-1). Each expert's over-represented tokens are then its own
    class, each with lift N / N_e, and its effective token count is that of its class."""
    moe = MoEConfig(num_experts=E, expert_hidden=8, router=RouterConfig(top_k=1))
    model = MoETransformer(
        ModelConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, max_seq_len=32, moe=moe)
    ).eval()
    with torch.no_grad():
        model.blocks[0].attn.o_proj.weight.zero_()
        model.embed.weight.zero_()
        model.embed.weight[torch.arange(V), torch.arange(V) % E] = 1.0
        model.moe_layers()[0].router.weight.copy_(10 * torch.eye(E, 16))
    torch.manual_seed(6)
    batches = [torch.randint(0, V, (4, 30)) for _ in range(2)]
    layer = collect(model, batches).summary(top_n=3, min_count=1)[0]
    tokens = torch.cat([b.flatten() for b in batches])
    freq = torch.bincount(tokens, minlength=V).double()
    assert layer["selected_per_expert"] == [int(freq[e::E].sum()) for e in range(E)]
    for e, over in enumerate(layer["over_represented"]):
        assert over and all(t["id"] % E == e for t in over)
        for t in over:
            assert math.isclose(t["lift"], round(len(tokens) / freq[e::E].sum().item(), 4))
        p = freq[e::E] / freq[e::E].sum()
        p = p[p > 0]
        assert math.isclose(
            layer["effective_tokens"][e], math.exp(-(p * p.log()).sum().item()), rel_tol=1e-9
        )
        assert layer["effective_tokens"][e] < layer["data_effective_tokens"]

    from moe.evaluation.report import _checkpoint_section, _piece

    md = "\n".join(
        _checkpoint_section(
            {
                "label": "x",
                "checkpoint": "c",
                "batch_size": 4,
                "seq_len": 30,
                "capacity_factor": None,
                "experts": [layer],
            },
            None,
        )
    )
    assert "### Expert specialisation" in md
    best = layer["over_represented"][1][0]
    assert (
        f"| 1 | {layer['effective_tokens'][1]:.1f} | {_piece(best['piece'])} {best['lift']:.1f}"
        in md
    )
