"""The all-to-all dispatcher on 2 ranks against the single-device layer, including experts and
whole ranks that receive zero tokens, and capacity dropping; with either way of moving rows
(``model.moe.permute``) on the ranks, against the default on one device."""

import pytest
import torch

from moe.model.moe_layer import MoEConfig, MoELayer
from moe.model.router import RouterConfig
from tests.helpers.distributed import run_distributed
from tests.moe.model.test_permute import Ops

pytestmark = pytest.mark.multiprocess

D, E, H = 16, 4, 8


def make_layer(capacity_factor, permute="index_add"):
    torch.manual_seed(5)
    return MoELayer(
        D,
        MoEConfig(
            num_experts=E,
            expert_hidden=H,
            capacity_factor=capacity_factor,
            router=RouterConfig(top_k=2),
            permute=permute,
        ),
    )


def inputs(rank: int, skew: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(1, 12, D, generator=g)
    if skew == "to_rank0" or (skew == "rank1_keeps_none" and rank == 1):
        x[..., 0] = 50.0  # the forced router below sends these tokens to experts 0 and 1
    return x


def force_router(layer, skew):
    if skew != "none":
        with torch.no_grad():
            layer.router.weight.zero_()
            layer.router.weight[0, 0] = 1.0
            layer.router.weight[1, 0] = 0.5


def _worker(rank, world, capacity_factor, skew, permute, out_dir):
    from moe.parallel.deepspeed_adapter import DeepSpeedMoE

    layer = make_layer(capacity_factor, permute)
    force_router(layer, skew)
    wrapped = DeepSpeedMoE(layer, ep_size=2, ep_rank=rank)
    wrapped.set_deepspeed_parallelism()
    assert wrapped.deepspeed_moe.dispatcher.permute == permute  # kept by the all-to-all one
    x = inputs(rank, skew).requires_grad_(True)
    with Ops() as ops:
        y, aux = wrapped(x)
        (y.square().sum() + aux).backward()
    # gather: no scatter-add in the dispatch, the regrouping or the combine, either direction
    assert ("index_add" in ops.names) == (permute == "index_add"), ops.names
    torch.save(
        {
            "y": y.detach(),
            "dx": x.grad,
            "dw_in": layer.experts.w_in.grad,
            "dw_router": layer.router.weight.grad,
            "counts": layer.stats["tokens_per_expert"],
        },
        f"{out_dir}/rank{rank}.pt",
    )


@pytest.mark.parametrize("permute", ["index_add", "gather"])
@pytest.mark.parametrize("capacity_factor", [None, 0.75], ids=["dropless", "cf0.75"])
@pytest.mark.parametrize("skew", ["none", "to_rank0", "rank1_keeps_none"])
def test_two_rank_dispatch_equals_single_device(tmp_path, capacity_factor, skew, permute):
    run_distributed(_worker, 2, capacity_factor, skew, permute, str(tmp_path))
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]

    ref_layer = make_layer(capacity_factor)
    force_router(ref_layer, skew)
    dw_in = torch.zeros_like(ref_layer.experts.w_in)
    dw_router = torch.zeros_like(ref_layer.router.weight)
    for rank in range(2):
        ref_layer.zero_grad()
        x = inputs(rank, skew).requires_grad_(True)
        y, aux = ref_layer(x)
        (y.square().sum() + aux).backward()
        torch.testing.assert_close(got[rank]["y"], y.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[rank]["dx"], x.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[rank]["counts"], ref_layer.stats["tokens_per_expert"])
        dw_in += ref_layer.experts.w_in.grad
        dw_router += ref_layer.router.weight.grad
        # Each rank's router gradient comes from its own tokens only.
        torch.testing.assert_close(
            got[rank]["dw_router"], ref_layer.router.weight.grad, rtol=1e-5, atol=1e-6
        )
    # Each rank's local experts got the gradient of both ranks' tokens routed to them.
    torch.testing.assert_close(
        torch.cat([got[0]["dw_in"], got[1]["dw_in"]]), dw_in, rtol=1e-5, atol=1e-6
    )
    if skew == "to_rank0":  # experts 2 and 3 (all of rank 1's) received no token
        assert dw_in[2:].abs().sum() == 0 and got[1]["dw_in"].abs().sum() == 0
