"""Our MoE layer against DeepSpeed's own ``deepspeed.moe.layer.MoE`` on the same weights.

DeepSpeed's dropless top-1 gate weights a token's expert by its softmax score; its top-2 gate
renormalizes the two selected scores. With the same router and SwiGLU expert weights, our layer
in the matching mode must give the same output and the same gradients."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe.model.moe_layer import MoEConfig, MoELayer
from moe.model.router import RouterConfig
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.multiprocess

D, E, H, T = 16, 4, 12, 24


class SwiGLUExpert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w_in = nn.Linear(D, 2 * H, bias=False)
        self.w_out = nn.Linear(H, D, bias=False)

    def forward(self, x):
        gate, up = self.w_in(x).split(H, dim=-1)
        return self.w_out(F.silu(gate) * up)


def _worker(rank, world, k, out_dir):
    from deepspeed.moe.layer import MoE

    torch.manual_seed(0)
    ours = MoELayer(
        D,
        MoEConfig(
            num_experts=E,
            expert_hidden=H,
            router=RouterConfig(top_k=k, renormalize=k == 2, aux_loss_coef=0),
        ),
    )
    ds = MoE(
        hidden_size=D,
        expert=SwiGLUExpert(),
        num_experts=E,
        ep_size=1,
        k=k,
        drop_tokens=False,
        use_rts=False,
        top2_2nd_expert_sampling=False,
        min_capacity=0,
    )
    ds.set_deepspeed_parallelism()
    with torch.no_grad():
        ds.deepspeed_moe.gate.wg.weight.copy_(ours.router.weight)
        for e, expert in enumerate(ds.deepspeed_moe.experts.deepspeed_experts):
            expert.w_in.weight.copy_(ours.experts.w_in[e].T)
            expert.w_out.weight.copy_(ours.experts.w_out[e].T)
    x = torch.randn(1, T, D)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_ours, _ = ours(x1)
    y_ds = ds(x2)[0]
    g = torch.randn_like(y_ours)
    y_ours.backward(g)
    y_ds.backward(g)
    ds_w_in = torch.stack(
        [ex.w_in.weight.grad.T for ex in ds.deepspeed_moe.experts.deepspeed_experts]
    )
    torch.save(
        {
            "y": (y_ours.detach(), y_ds.detach()),
            "dx": (x1.grad, x2.grad),
            "router": (ours.router.weight.grad, ds.deepspeed_moe.gate.wg.weight.grad),
            "w_in": (ours.experts.w_in.grad, ds_w_in),
        },
        f"{out_dir}/result.pt",
    )


@pytest.mark.parametrize("k", [1, 2])
def test_matches_deepspeed_moe_dropless(tmp_path, k):
    run_distributed(_worker, 1, k, str(tmp_path))
    res = torch.load(tmp_path / "result.pt", weights_only=True)
    for name, (ours, theirs) in res.items():
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=name)
    assert res["router"][0].abs().sum() > 0
