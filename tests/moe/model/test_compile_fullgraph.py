"""The MoE layer compiles as one graph (``fullgraph=True``: any graph break is an error) for every
dropless router setting, in fp32 (the experts' custom op) and bf16 (``torch._grouped_mm`` itself),
and compiles nothing after its first call although every call routes other token counts.

This is also the CPU proxy for "no host synchronisation inside a layer": a ``.item()``,
``.tolist()``, ``bool(tensor)``, ``nonzero`` or a data-dependent shape (``torch.bincount``,
boolean indexing) in the router, dispatch, experts or combine is a graph break, which
fullgraph turns into an error. On a GPU, tests/gpu/test_levers.py checks the same layer under
``torch.cuda.set_sync_debug_mode("error")``.

Backend ``aot_eager``: dynamo's tracing and guards and AOT autograd's joint forward/backward
graph, without inductor's code generation (tests/moe/model/test_compile.py runs inductor)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from moe.model.experts import grouped_mm_supported
from moe.model.moe_layer import MoEConfig, MoELayer, counting_routes
from moe.model.router import RouterConfig

pytestmark = pytest.mark.slow  # about 60 CPU seconds of tracing for the file

D, B, S = 32, 2, 24

VARIANTS = {
    "softmax_top2": {},
    "sigmoid_bias_scaled": {
        "router": {
            "score_func": "sigmoid",
            "bias_update_rate": 0.01,
            "scaling_factor": 2.5,
            "top_k": 3,
        }
    },
    "topk_then_softmax_renormalized": {
        "router": {"order": "topk_then_softmax", "renormalize": True}
    },
    "sequence_aux_z_loss": {"router": {"aux_loss_type": "sequence", "z_loss_coef": 0.01}},
    "global_batch_aux": {"router": {"aux_loss_scope": "global_batch"}},
    "noise_and_jitter": {"router": {"jitter_eps": 0.1, "logit_noise_std": 0.5}},
    "shared_gated_gelu": {
        "num_shared_experts": 1,
        "shared_expert_gate": True,
        "activation": "gelu",
    },
    "gather_permute": {"permute": "gather", "router": {"top_k": 3}},
}


def layer(variant: str, dtype: torch.dtype) -> MoELayer:
    spec = copy.deepcopy(VARIANTS[variant])
    router = RouterConfig(**spec.pop("router", {}))
    torch.manual_seed(0)
    return MoELayer(D, MoEConfig(num_experts=8, expert_hidden=16, router=router, **spec)).to(dtype)


def steps(module, dtype, n: int = 3) -> list[torch.Tensor]:
    """n forward/backward calls on different inputs (so different token counts per expert)."""
    out = []
    for i in range(n):
        x = torch.randn(B, S, D, generator=torch.Generator().manual_seed(i)).to(dtype)
        x.requires_grad_()
        y, aux = module(x)
        (y.float().square().mean() + aux).backward()
        out.append(torch.cat([y.detach().float().flatten(), x.grad.float().flatten()]))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_moe_layer_is_one_graph_compiled_once(variant, dtype):
    if not grouped_mm_supported(dtype, torch.device("cpu")):
        pytest.skip("torch._grouped_mm does not take this dtype on the CPU in this torch")
    torch._dynamo.reset()
    counters.clear()
    eager = layer(variant, dtype)
    compiled = copy.deepcopy(eager)
    compiled.compile(backend="aot_eager", fullgraph=True)
    noisy = variant == "noise_and_jitter"
    torch.manual_seed(1)
    want = steps(eager, dtype)
    torch.manual_seed(1)
    got = steps(compiled, dtype)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    if not noisy:  # compiled random draws are not eager's
        tol = (
            {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        )
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **tol)
    torch.testing.assert_close(compiled.step_load_E, eager.step_load_E)


def test_a_counting_pass_is_one_graph_too():
    """The global-batch counting pass (counting_routes) adds each layer's routed copies to
    batch_counts_E without a host read."""
    torch._dynamo.reset()
    counters.clear()
    eager = layer("global_batch_aux", torch.float32)
    compiled = copy.deepcopy(eager)
    compiled.compile(backend="aot_eager", fullgraph=True)
    x = torch.randn(B, S, D)
    with torch.no_grad():
        for module in (eager, compiled):
            with counting_routes([module]):
                module(x)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert torch.equal(compiled.batch_counts_E, eager.batch_counts_E)
    assert compiled.batch_counts_E.sum() == B * S * 2


def test_global_batch_routing_counts_without_bincount(monkeypatch):
    """torch.bincount reads the largest id back to the host on CUDA (a sync per call, and its
    length depends on the data): the counting pass and the global-batch aux loss use a
    fixed-length scatter-add instead."""

    def refuse(*args, **kwargs):
        raise AssertionError("torch.bincount in the MoE path")

    module = layer("global_batch_aux", torch.float32)
    monkeypatch.setattr(torch, "bincount", refuse)
    x = torch.randn(B, S, D)
    with torch.no_grad(), counting_routes([module]):
        module(x)
    y, aux = module(x)
    (y.sum() + aux).backward()
    assert module.batch_counts_E.sum() == B * S * 2 and torch.isfinite(aux)
