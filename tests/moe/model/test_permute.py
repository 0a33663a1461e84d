"""``model.moe.permute``: the two ways token copies move to their experts and back.

The layer's outputs and gradients against the float64 reference are in test_moe_layer.py (both
settings, dropless and dropping), the two-rank all-to-all in
tests/moe/parallel/test_expert_parallel_dispatch.py and the compiled graph in
test_compile_fullgraph.py. Here: what ``gather`` is for, no scatter-add in either direction,
each token's copies summed and rounded once, and the inverse of the sort."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe.core.config_schema import from_dict
from moe.core.errors import ConfigError
from moe.model.dispatcher import LocalDispatcher, copy_slots, sum_copies
from moe.model.moe_layer import MoEConfig, MoELayer
from moe.model.router import RouterConfig
from moe.model.transformer import ModelConfig

D, E = 32, 8
SCATTERS = ("index_add", "scatter_add", "index_put", "scatter_reduce", "_index_put_impl_")


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def layer_ops(permute: str, **moe) -> list[str]:
    """The aten ops of the layer's dispatch and combine in a forward and backward."""
    torch.manual_seed(0)
    layer = MoELayer(
        D, MoEConfig(num_experts=E, expert_hidden=16, router=RouterConfig(top_k=4), **moe)
    )
    layer.cfg.permute = permute
    layer.dispatcher = LocalDispatcher(E, permute)
    x = torch.randn(2, 24, D)
    routing = layer.router(x.reshape(-1, D), seq_len=24)
    keep = None
    if moe.get("capacity_factor"):
        from moe.model.dispatcher import capacity_keep_mask

        keep = capacity_keep_mask(routing.indices_TK, routing.weights_TK, E, 8)
    plan = layer.dispatcher.plan(routing.indices_TK, keep)
    leaf = x.reshape(-1, D).detach().requires_grad_(True)
    with Ops() as ops:
        weights = routing.weights_TK.detach().requires_grad_(True)
        x_ND, w_N, _ = layer.dispatcher.dispatch(leaf, weights, plan)
        y_TD = layer.dispatcher.combine(x_ND * w_N[:, None], plan)
        y_TD.square().sum().backward()
    return ops.names


@pytest.mark.parametrize("moe", [{}, {"capacity_factor": 1.0}], ids=["dropless", "dropping"])
def test_gather_moves_rows_without_a_scatter_add_in_either_direction(moe):
    scatters = [n for n in layer_ops("index_add", **moe) if n in SCATTERS]
    assert scatters, "the default's combine and gather gradient are scatter-adds"
    got = layer_ops("gather", **moe)
    assert not [n for n in got if n in SCATTERS], got
    assert "index_select" in got and "sum" in got


@pytest.mark.parametrize("top_k", [2, 8])
def test_each_tokens_copies_are_summed_and_rounded_once_in_bf16(top_k):
    """The combine of bf16 rows and the dispatch's bf16 gradient equal the exact sums rounded
    once (a sum in bf16, one copy after another, would round K - 1 times)."""
    g = torch.Generator().manual_seed(top_k)
    T, D_ = 256, 64
    idx = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :top_k]
    gather = LocalDispatcher(E, "gather")
    plan = gather.plan(idx, None)
    y = (torch.randn(T * top_k, D_, generator=g) * 8).bfloat16()
    exact = LocalDispatcher(E).combine(y.double(), plan)
    assert torch.equal(gather.combine(y, plan), exact.bfloat16())
    # what one bf16 addition after another would give is not that, for K = 8
    stepwise = torch.zeros(T, D_, dtype=torch.bfloat16)
    for k in range(top_k):
        stepwise += y[plan.slots_TK[:, k]]
    assert (stepwise != exact.bfloat16()).any() == (top_k > 2)

    x = torch.randn(T, D_, generator=g).bfloat16().requires_grad_(True)
    x_ND = gather.dispatch(x, torch.ones(T, top_k), plan)[0]
    x_ND.backward(y)
    assert torch.equal(x.grad, exact.bfloat16())


@pytest.mark.slow  # an inductor compile (C++ on the CPU)
@pytest.mark.parametrize("dropping", [False, True])
def test_compiled_the_sum_is_a_gather_and_reduction_rounded_once(dropping):
    """Under compile the copies are summed by a gather and a sum (which inductor fuses), not
    ``embedding_bag``: the graph holds no embedding_bag, and bf16 sums are still the exact sums
    rounded once (a dropped copy, past the kept ones, adds nothing)."""
    g = torch.Generator().manual_seed(3)
    T, K, D_ = 128, 8, 32
    idx = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K]
    keep = torch.rand(T, K, generator=g) > 0.25 if dropping else None
    plan = LocalDispatcher(E, "gather").plan(idx, keep)
    n = plan.copy_N.numel()
    y = (torch.randn(n, D_, generator=g) * 8).bfloat16()
    exact = LocalDispatcher(E).combine(y.double(), plan).bfloat16()
    torch._dynamo.reset()
    ops: list[str] = []

    def backend(gm, inputs):
        ops.extend(str(node.target) for node in gm.graph.nodes)
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, inputs)

    compiled = torch.compile(sum_copies, backend=backend, fullgraph=True)
    assert torch.equal(compiled(y, plan.slots_TK, dropping), exact)
    assert not any("embedding_bag" in op for op in ops), ops
    # eagerly, the same sums through embedding_bag (fp32 rows: bf16 on the CPU avoids it)
    y32 = y.float()
    torch.testing.assert_close(
        compiled(y32, plan.slots_TK, dropping), sum_copies(y32, plan.slots_TK, dropping)
    )


def test_copy_slots_invert_the_sort_and_point_dropped_copies_past_the_kept():
    order = torch.tensor([3, 0, 5, 1, 4, 2])  # a permutation of T * K = 6 copies, K = 2
    slots = copy_slots(order, 6, 2, dropping=False)
    assert slots.shape == (3, 2)
    assert torch.equal(order[slots.reshape(-1)], torch.arange(6))
    kept = torch.tensor([4, 0, 3])  # copies 1, 2 and 5 dropped
    slots = copy_slots(kept, 6, 2, dropping=True)
    assert slots.reshape(-1).tolist() == [1, 3, 3, 2, 0, 3]


def test_dropped_copies_add_nothing_and_get_no_gradient():
    idx = torch.tensor([[0, 1], [1, 2], [0, 2]])
    keep = torch.tensor([[True, False], [True, True], [False, True]])
    x = torch.randn(3, 4, requires_grad=True)
    # Kept copies in expert order: token 0 (expert 0), token 1 (expert 1), tokens 1 and 2
    # (expert 2); scaled 1, 2, 3 and 4 in that order.
    scale = torch.arange(1.0, 5.0)[:, None]
    factor = torch.tensor([1.0, 2.0 + 3.0, 4.0])[:, None]
    for permute in ("index_add", "gather"):
        d = LocalDispatcher(3, permute)
        plan = d.plan(idx, keep)
        x_ND, _, counts = d.dispatch(x, torch.ones(3, 2), plan)
        assert counts.tolist() == [1, 1, 2] and x_ND.shape == (4, 4)
        y = d.combine(x_ND * scale, plan)
        torch.testing.assert_close(y, x.detach() * factor)
        (grad,) = torch.autograd.grad(y.sum(), x)
        torch.testing.assert_close(grad, factor.expand(3, 4))


def test_an_unknown_permute_is_refused_by_name():
    with pytest.raises(ConfigError, match="moe.permute"):
        from_dict(ModelConfig, {"moe": {"permute": "scatter"}})
    assert from_dict(ModelConfig, {"moe": {"permute": "gather"}}).moe.permute == "gather"
    with pytest.raises(ValueError, match="permute"):
        LocalDispatcher(E, "scatter")  # type: ignore[arg-type]
