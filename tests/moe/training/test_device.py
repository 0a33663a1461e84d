"""Device and backend choice, and moving batches (CPU side; tests/gpu covers CUDA)."""

from __future__ import annotations

import torch

from data_pipeline.reader import PackedBatch
from moe.training import device as device_mod
from moe.training.device import comm_device, device_and_backend, pin, to_device


def test_cuda_rank_gets_its_local_device_and_nccl():
    assert device_and_backend(3, cuda_available=True) == (torch.device("cuda", 3), "nccl")
    assert device_and_backend(0, cuda_available=False) == (torch.device("cpu"), "gloo")


def test_default_follows_cuda_availability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device_and_backend(1) == (torch.device("cuda", 1), "nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_and_backend(1) == (torch.device("cpu"), "gloo")


def test_collectives_use_cpu_tensors_without_nccl():
    assert comm_device() == torch.device("cpu")  # no process group here


def test_pin_is_a_no_op_without_cuda_and_pins_with_it(monkeypatch):
    batch = PackedBatch(torch.arange(6).view(2, 3), torch.zeros(2, 3, dtype=torch.int32))
    monkeypatch.setattr(device_mod.torch.cuda, "is_available", lambda: False)
    assert pin(batch) is batch
    pinned = []
    monkeypatch.setattr(device_mod.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pinned.append(t) or t.clone())
    out = pin(batch)
    assert len(pinned) == 2 and torch.equal(out.tokens_BS, batch.tokens_BS)
    assert torch.equal(out.doc_ids_BS, batch.doc_ids_BS)


def test_to_device_copies_asynchronously(monkeypatch):
    batch = PackedBatch(torch.arange(6).view(2, 3), None)
    assert to_device(batch, torch.device("cpu")) is batch
    calls = []
    real_to = torch.Tensor.to

    def spy(t, *args, **kwargs):
        calls.append((args, kwargs))
        return real_to(t, torch.float64)  # stands in for another device

    monkeypatch.setattr(torch.Tensor, "to", spy)
    out = to_device(batch, torch.device("meta"))
    assert calls == [((torch.device("meta"),), {"non_blocking": True})]
    assert out.doc_ids_BS is None and out.tokens_BS.dtype == torch.float64


def test_peak_flops_from_the_device_name(monkeypatch):
    from moe.training.device import peak_bf16_flops

    cuda = torch.device("cuda", 0)
    for name, want in [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("Tesla T4", None),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d, name=name: name)
        assert peak_bf16_flops(cuda) == want, name
    assert peak_bf16_flops(torch.device("cpu")) is None


def test_trainer_mfu_peak_prefers_the_config_and_needs_bf16(monkeypatch):
    from moe.config.run import RunConfig
    from moe.core.config_schema import from_dict
    from moe.training.trainer import peak_flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda", 0)
    base = {"name": "x", "data": {"dir": "unused"}}
    bf16 = from_dict(RunConfig, {**base, "train": {"precision": "bf16"}})
    fp32 = from_dict(RunConfig, {**base, "train": {"precision": "fp32"}})
    given = from_dict(
        RunConfig,
        {**base, "train": {"precision": "bf16"}, "logging": {"peak_flops_per_device": 1e15}},
    )
    assert peak_flops(bf16, cuda) == 989e12
    assert peak_flops(fp32, cuda) is None  # a bf16 peak would understate fp32 utilization
    assert peak_flops(given, cuda) == 1e15
    assert peak_flops(bf16, torch.device("cpu")) is None


def test_a_cpu_rank_peak_counts_its_threads():
    """The configured CPU peak is one core's; a rank with two threads computes on two cores
    (a one-rank run on two cores read 181% MFU before)."""
    from moe.config.run import RunConfig
    from moe.core.config_schema import from_dict
    from moe.training.trainer import peak_flops

    cfg = from_dict(
        RunConfig,
        {"name": "x", "data": {"dir": "unused"}, "logging": {"peak_flops_per_device": 8e10}},
    )
    cpu = torch.device("cpu")
    assert peak_flops(cfg, cpu, threads=1) == 8e10
    assert peak_flops(cfg, cpu, threads=2) == 16e10
    assert peak_flops(cfg, cpu) == 8e10 * torch.get_num_threads()
    assert peak_flops(cfg, torch.device("cuda", 0), threads=2) == 8e10  # a GPU's is the device's
