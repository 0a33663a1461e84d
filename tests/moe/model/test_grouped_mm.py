"""Grouped expert GEMMs: torch._grouped_mm where supported, the loop over experts elsewhere;
both give the loop's result, with experts that receive no tokens."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe.model import experts as experts_mod
from moe.model.experts import GroupedExperts, grouped_mm, grouped_mm_supported
from tests.helpers.syncs import count_host_reads

COUNTS = [5, 0, 9, 0, 3, 7]  # experts 1 and 3 get no tokens


def loop_reference(x_ND, w_EIO, counts):
    out, start = [], 0
    for e, n in enumerate(counts):
        out.append(x_ND[start : start + n].double() @ w_EIO[e].double())
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("kernel", [True, False], ids=["grouped", "loop"])
def test_grouped_mm_matches_the_loop_forward_and_backward(kernel, monkeypatch):
    if kernel and not grouped_mm_supported(torch.float32, torch.device("cpu")):
        pytest.skip("torch._grouped_mm does not take fp32 on the CPU in this torch")
    if not kernel:
        monkeypatch.setattr(experts_mod, "grouped_mm_supported", lambda dtype, device: False)
    torch.manual_seed(0)
    x = torch.randn(sum(COUNTS), 16, requires_grad=True)
    w = torch.randn(len(COUNTS), 16, 8, requires_grad=True)
    counts_E = torch.tensor(COUNTS)
    with count_host_reads() as reads:
        y = grouped_mm(x, w, counts_E)
    assert sum(reads.values()) == (0 if kernel else 1), reads
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, [x, w], g)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    yr = loop_reference(xr, wr, COUNTS)
    gxr, gwr = torch.autograd.grad(yr, [xr, wr], g.double())
    torch.testing.assert_close(y.double(), yr, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx.double(), gxr, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw.double(), gwr, rtol=1e-5, atol=1e-5)
    assert gw[1].abs().max() == 0 and gw[3].abs().max() == 0  # no tokens, no gradient


def test_kernel_and_loop_agree_in_an_expert_layer(monkeypatch):
    if not grouped_mm_supported(torch.float32, torch.device("cpu")):
        pytest.skip("torch._grouped_mm does not take fp32 on the CPU in this torch")
    torch.manual_seed(1)
    layer = GroupedExperts(len(COUNTS), 16, 32, "swiglu")
    x = torch.randn(sum(COUNTS), 16)
    scale = torch.rand(sum(COUNTS))
    counts_E = torch.tensor(COUNTS)
    fast = layer(x, counts_E, scale)
    monkeypatch.setattr(experts_mod, "grouped_mm_supported", lambda dtype, device: False)
    with count_host_reads() as reads:
        slow = layer(x, counts_E, scale)
    # The loop reads the counts once for both products, and not at all when given them.
    assert sum(reads.values()) == 1, reads
    with count_host_reads() as reads:
        given = layer(x, counts_E, scale, counts_host=COUNTS)
    assert sum(reads.values()) == 0, reads
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(given, slow)


def test_unsupported_dtypes_and_devices_use_the_loop():
    assert not grouped_mm_supported(torch.float64, torch.device("meta"))
    x = torch.randn(sum(COUNTS), 16, dtype=torch.float64)
    w = torch.randn(len(COUNTS), 16, 8, dtype=torch.float64)
    torch.testing.assert_close(grouped_mm(x, w, torch.tensor(COUNTS)), loop_reference(x, w, COUNTS))


def test_cuda_needs_bf16_and_a_capable_gpu(monkeypatch):
    monkeypatch.setattr(experts_mod, "_probe", lambda dtype, device: True)
    monkeypatch.setattr(experts_mod, "_probed", {})
    cuda = torch.device("cuda", 0)
    for cap, version, dtype, want in [
        ((9, 0), (2, 11), torch.bfloat16, True),
        ((9, 0), (2, 11), torch.float32, False),
        ((8, 0), (2, 11), torch.bfloat16, False),
        ((8, 0), (2, 13), torch.bfloat16, True),
        ((7, 5), (2, 13), torch.bfloat16, False),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, cap=cap: cap)
        monkeypatch.setattr(experts_mod, "_torch_version", lambda version=version: version)
        assert grouped_mm_supported(dtype, cuda) == want, (cap, version, dtype)


@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "cf1.0"])
@pytest.mark.parametrize("kernel", [True, False], ids=["grouped", "loop"])
def test_host_reads_of_one_moe_layer_forward_and_backward(kernel, capacity_factor, monkeypatch):
    """Dropless with the kernel: none. The loop: one (the counts, read once for both GEMMs). A
    capacity factor: one (the kept count, which brings the counts for the loop with it)."""
    from moe.model.moe_layer import MoEConfig, MoELayer

    if kernel and not grouped_mm_supported(torch.float32, torch.device("cpu")):
        pytest.skip("torch._grouped_mm does not take fp32 on the CPU in this torch")
    if not kernel:
        monkeypatch.setattr(experts_mod, "grouped_mm_supported", lambda dtype, device: False)
    torch.manual_seed(0)
    layer = MoELayer(
        16, MoEConfig(num_experts=4, expert_hidden=16, capacity_factor=capacity_factor)
    )
    x = torch.randn(2, 24, 16, requires_grad=True)
    with count_host_reads() as reads:
        y, aux = layer(x)
        (y.square().sum() + aux).backward()
    want = 0 if kernel and capacity_factor is None else 1
    assert sum(reads.values()) == want, reads


class _Copies(TorchDispatchMode):
    """Shapes of the tensors that copying operators return (clone, contiguous, copy_, to)."""

    NAMES = ("clone", "copy", "_to_copy", "contiguous")

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(n in func.__name__ for n in self.NAMES) and isinstance(out, torch.Tensor):
            self.shapes.append(tuple(out.shape))
        return out


def test_bf16_experts_copy_no_weight_in_forward_or_backward():
    """The layout the grouped kernel takes: w_in (E, D, 2H) and w_out (E, H, D) are multiplied as
    they are stored, and the backward uses transposed views (torch._grouped_mm takes row- or
    column-major operands): no per-step copy or transpose of an expert weight. bf16 runs
    torch._grouped_mm's own autograd, the path CUDA takes."""
    if not grouped_mm_supported(torch.bfloat16, torch.device("cpu")):
        pytest.skip("torch._grouped_mm does not take bf16 on the CPU in this torch")
    torch.manual_seed(0)
    experts = GroupedExperts(len(COUNTS), 32, 16, "swiglu").bfloat16()
    x = torch.randn(sum(COUNTS), 32, dtype=torch.bfloat16, requires_grad=True)
    weights = {
        s
        for p in experts.parameters()  # as stored or transposed
        for s in (tuple(p.shape), tuple(p.transpose(1, 2).shape))
    }
    with _Copies() as mode:
        y = experts(x, torch.tensor(COUNTS), torch.rand(sum(COUNTS)))
        y.float().square().sum().backward()
    assert experts.w_in.grad is not None and experts.w_out.grad is not None
    assert not weights & set(mode.shapes), mode.shapes
