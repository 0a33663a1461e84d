"""Where a rank computes and communicates: its device, the process-group backend, and moving
batches there."""

from __future__ import annotations

import torch
import torch.distributed as dist

from data_pipeline.reader import PackedBatch


def device_and_backend(
    local_rank: int, cuda_available: bool | None = None
) -> tuple[torch.device, str]:
    """``cuda:LOCAL_RANK`` and NCCL when CUDA is present, the CPU and gloo otherwise."""
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if cuda_available:
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def device_type() -> str:
    """The kind of device this process trains on: "cuda" where CUDA is present (as
    device_and_backend decides), "cpu" otherwise; what the config's by-device settings follow."""
    return "cuda" if torch.cuda.is_available() else "cpu"


PEAK_BF16_DENSE = [
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("B200", 2250e12),
]
"""Peak dense bf16 FLOP/s by CUDA device-name substring (vendor data sheets; first match wins)."""


def peak_bf16_flops(device: torch.device) -> float | None:
    """The device's peak dense bf16 FLOP/s where its name is known, else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_DENSE if key in name), None)


def comm_device() -> torch.device:
    """The device of tensors handed to collectives: NCCL only takes CUDA tensors (the current
    device, set to ``cuda:LOCAL_RANK`` at start-up), gloo CPU tensors."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def pin(batch: PackedBatch) -> PackedBatch:
    """Page-locked copies (only when CUDA is present), so the copy to the GPU can overlap
    compute."""
    if not torch.cuda.is_available():
        return batch
    return PackedBatch(
        *(
            None if t is None else t.pin_memory()
            for t in (batch.tokens_BS, batch.doc_ids_BS, batch.targets_BS)
        )
    )


def to_device(batch: PackedBatch, device: torch.device) -> PackedBatch:
    """Asynchronous when the batch is pinned: the host goes on queuing kernels."""
    if batch.tokens_BS.device == device:
        return batch
    move = lambda t: None if t is None else t.to(device, non_blocking=True)
    return PackedBatch(move(batch.tokens_BS), move(batch.doc_ids_BS), move(batch.targets_BS))
