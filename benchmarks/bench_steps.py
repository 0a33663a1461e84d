"""The training step the GPU benchmarks time and profile (benchmarks/gpu_train_bench.py and the
settings matrix), the bench's own knobs, and the capture of a step profile: a torch.profiler
trace of a few steps and the host syncs of a few more, summarised by profile_summary.py."""

from __future__ import annotations

import contextlib
import copy
import json
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from profile_summary import Dims, summarise
from torch.profiler import ProfilerActivity, profile, record_function

from moe.config.run import RunConfig
from moe.core.errors import ConfigError
from moe.model.regions import region

ROOT = Path(__file__).resolve().parents[1]
SYNC_WARNING = "synchronizing CUDA operation"
"""The text of the warning ``torch.cuda.set_sync_debug_mode("warn")`` gives for each sync."""


@dataclass(frozen=True)
class Knobs:
    """What ``--set bench.KEY=VALUE`` changes: the bench's own settings, not the config's."""

    expert_kernel: str = "auto"
    """auto: what the experts choose (the grouped GEMM where it runs); loop: the per-expert
    loop, as on a device without the grouped kernel."""
    doc_len: int = 512
    """Mean document length of the packed batches when model.document_masking is on."""
    step_read: bool = True
    """Read the step's loss and gradient norm on the host after its optimizer step, in one
    transfer, as the trainer does every step (moe/training/step.py): on a GPU the host then
    waits for the step to end before it prepares the next, as in training. false: steps are
    queued back to back (how the figures recorded up to 28 November were taken)."""
    finetune: str = "none"
    """A fine-tuning method (``finetune.method``) prepared on the preset's fresh weights as a
    run started from a checkpoint prepares them: adapters added, the rest frozen (ESFT: every
    routed expert trains, as if all were selected; LoRA and QLoRA on a dense model: the FFNs
    in place of the experts among the default targets). Its speed does not depend on the
    weights, so no checkpoint is read. none: pretraining."""


FINETUNE_METHODS = ("none", "full", "lora", "qlora", "esft", "prompt", "prefix", "adapter")


def with_finetune(cfg: RunConfig, knobs: Knobs) -> RunConfig:
    """``cfg`` with the fine-tuning method of ``knobs.finetune`` (a copy; ``cfg`` itself when
    none). Set past the config's checks, which ask a method for the checkpoint it starts from:
    the bench starts from fresh weights (see Knobs.finetune)."""
    if knobs.finetune == "none":
        return cfg
    out = copy.deepcopy(cfg)
    out.finetune.method = knobs.finetune
    lora = out.finetune.lora
    if (
        not any(map(out.model.is_moe_layer, range(out.model.n_layers)))
        and "experts" in lora.targets
    ):
        # A dense model has no experts: its FFNs take their place among LoRA's default targets.
        lora.targets = [t for t in lora.targets if t != "experts"] + ["ffn"]
    return out


def split_knobs(overrides: list[str]) -> tuple[list[str], Knobs]:
    """The config overrides, and the ``bench.*`` ones as Knobs (unknown or bad ones refused)."""
    config, knobs, problems = [], {}, []
    for item in overrides:
        key, _, value = item.partition("=")
        key = key.strip()
        if not key.startswith("bench."):
            config.append(item)
        elif key == "bench.expert_kernel" and value in ("auto", "loop"):
            knobs["expert_kernel"] = value
        elif key == "bench.doc_len" and value.isdigit() and int(value) >= 1:
            knobs["doc_len"] = int(value)
        elif key == "bench.step_read" and value in ("true", "false"):
            knobs["step_read"] = value == "true"
        elif key == "bench.finetune" and value in FINETUNE_METHODS:
            knobs["finetune"] = value
        else:
            problems.append(
                f"{item}: the bench knobs are bench.expert_kernel=auto|loop, "
                "bench.doc_len=N (N >= 1), bench.step_read=true|false and "
                f"bench.finetune={'|'.join(FINETUNE_METHODS)}"
            )
    if problems:
        raise ConfigError(problems)
    return config, Knobs(**knobs)


@contextlib.contextmanager
def expert_kernel(kind: str):
    """Inside: the experts run the per-expert loop when ``kind`` is "loop" (the grouped
    kernel is reported unsupported, so the layers and their compile probes choose the loop)."""
    if kind != "loop":
        yield
        return
    from moe.model import experts

    saved = experts.grouped_mm_supported
    experts.grouped_mm_supported = lambda dtype, device: False
    try:
        yield
    finally:
        experts.grouped_mm_supported = saved


def document_ids(B: int, S: int, mean_len: int, gen: torch.Generator) -> torch.Tensor:
    """(B, S) document ids of packed rows: about S / mean_len documents per row, cut at random
    places (a new id at each cut)."""
    cuts = max(S // mean_len - 1, 0)
    starts = torch.zeros(B, S, dtype=torch.long)
    if cuts:
        starts.scatter_(1, torch.randint(1, S, (B, cuts), generator=gen), 1)
    return starts.cumsum(1)


def step(engine, cfg: RunConfig, device: torch.device, knobs: Knobs = Knobs()) -> None:
    """One optimizer step: ``train.grad_accum_steps`` micro-batches (DeepSpeed steps the
    optimizer after the last), then the step's read."""
    for _ in range(cfg.train.grad_accum_steps):
        loss = micro_step(engine, cfg, device, knobs)
    if knobs.step_read:
        with region("bench.step_read"):
            read_step_figures(loss, engine.get_global_grad_norm())


def micro_step(engine, cfg: RunConfig, device: torch.device, knobs: Knobs) -> torch.Tensor:
    B, S, V = cfg.train.micro_batch_size, cfg.data.seq_len, cfg.model.vocab_size
    tokens = torch.randint(0, V, (B, S + 1))
    docs = (
        document_ids(B, S, knobs.doc_len, torch.Generator().manual_seed(int(tokens[0, 0])))
        if cfg.model.document_masking
        else None
    )
    if device.type == "cuda":
        tokens = tokens.pin_memory()
        docs = docs.pin_memory() if docs is not None else None
    tokens = tokens.to(device, non_blocking=True)
    docs = docs.to(device, non_blocking=True) if docs is not None else None
    # The logits are freed, as in the trainer.
    loss = engine(tokens[:, :-1], tokens[:, 1:], doc_ids_BS=docs).loss
    with region("bench.backward"):  # DeepSpeed's gradient handling after autograd
        engine.backward(loss)
    with region("optimizer"):
        engine.step()  # at the accumulation boundary; before it, DeepSpeed's bookkeeping only
    return loss


def read_step_figures(loss: torch.Tensor, grad_norm) -> list[float]:
    """The trainer's one read of a step (moe/training/step.py): loss and gradient norm in one
    transfer to the host."""
    parts = [loss.detach().float().reshape(1)]
    if torch.is_tensor(grad_norm):
        parts.append(grad_norm.detach().float().reshape(1).to(loss.device))
    return torch.cat(parts).tolist()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gemm_dims(cfg: RunConfig) -> Dims:
    """The widths that name a matrix product's layer (profile_summary.gemm_region)."""
    m, moe = cfg.model, cfg.model.moe
    glu = 2 if moe.activation == "swiglu" else 1
    ffn = set()
    if any(not m.is_moe_layer(i) for i in range(m.n_layers)):
        ffn |= {moe.dense_width, glu * moe.dense_width}
    if m.ffn == "moe" and moe.num_shared_experts:
        width = moe.num_shared_experts * moe.expert_hidden
        ffn |= {width, glu * width}
    return Dims(
        tokens=cfg.train.micro_batch_size * cfg.data.seq_len,
        vocab=m.vocab_size,
        d_model=m.d_model,
        experts=moe.num_experts if m.ffn == "moe" else 0,
        attention={m.n_heads * m.head_size, m.kv_heads * m.head_size},
        ffn=ffn,
    )


def profiled_trace(
    engine, cfg: RunConfig, device: torch.device, knobs: Knobs, steps: int
) -> tuple[dict, float]:
    """The Chrome trace of ``steps`` steps (operator shapes recorded), and their wall time."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=activities, record_shapes=True) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            with record_function("bench.step"):
                step(engine, cfg, device, knobs)
        sync(device)
        window = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text()), window


def count_syncs(
    engine, cfg: RunConfig, device: torch.device, knobs: Knobs, steps: int
) -> dict | None:
    """Host syncs per step under ``torch.cuda.set_sync_debug_mode("warn")`` and the lines that
    made them (None off CUDA: nothing to count)."""
    if device.type != "cuda" or steps < 1:
        return None
    sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every sync, not the first per source line
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step(engine, cfg, device, knobs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    sync(device)
    sites = Counter(where(w.filename, w.lineno) for w in caught if SYNC_WARNING in str(w.message))
    return {
        "per_step": round(sum(sites.values()) / steps, 2),
        "sites": [[site, round(n / steps, 2)] for site, n in sites.most_common()],
    }


def where(filename: str, lineno: int) -> str:
    """A source line as ``path:line``, the path from the checkout or from site-packages."""
    path = Path(filename)
    try:
        return f"{path.resolve().relative_to(ROOT)}:{lineno}"
    except ValueError:
        parts = path.parts
        tail = parts[parts.index("site-packages") + 1 :] if "site-packages" in parts else parts[-3:]
        return f"{'/'.join(tail)}:{lineno}"


def profile_entry(
    engine,
    cfg: RunConfig,
    device: torch.device,
    knobs: Knobs,
    steps: int,
    sync_steps: int,
    step_s: float,
    dims: Dims,
    info: dict,
) -> dict:
    """The profile summary of this engine's step (profile_summary.summarise); ``info`` (model,
    setting, device name, ...) is copied into it."""
    trace, window = profiled_trace(engine, cfg, device, knobs, steps)
    syncs = count_syncs(engine, cfg, device, knobs, sync_steps)
    return summarise(trace, steps, step_s, dims=dims, window_s=window, syncs=syncs, **info)
