"""Fine-tuning (``finetune:`` in the run config): which parameters of a model started from
``model.init_from`` train. The adapters themselves are model code (moe/model/adapters/); this
module adds them to the single-device model before it is wrapped for expert parallelism, and
freezes the rest: a frozen parameter has ``requires_grad`` False, so it gets no gradient and,
left out of the optimizer's groups (moe/parallel/deepspeed_adapter.py), no optimizer state."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from moe.config.run import FinetuneConfig
from moe.core.config_schema import function_keys
from moe.core.errors import ConfigError
from moe.model.adapters.bottleneck import apply_bottleneck_adapters
from moe.model.adapters.esft import freeze_all_but_routed_experts
from moe.model.adapters.lora import (
    BASE_DTYPES,
    LoRAConfig,
    apply_lora,
    base_fingerprint,
    is_factor,
)
from moe.model.adapters.prefix import apply_prefix
from moe.model.adapters.prompt import apply_prompt
from moe.model.adapters.qlora import quantized_numel
from moe.model.experts import GroupedExperts
from moe.model.router import TopKRouter

log = logging.getLogger("moe.train")


def prepare_finetune(model: nn.Module, cfg: FinetuneConfig) -> None:
    """Add ``cfg``'s adapters to ``model`` and freeze what the method leaves frozen (method
    none and full: nothing)."""
    if cfg.method == "esft":  # which experts train is decided on the data (moe/training/esft.py)
        freeze_all_but_routed_experts(model)
        return
    # Methods whose added parameters are all that trains.
    added = {
        "adapter": lambda: apply_bottleneck_adapters(model, cfg.adapter),
        "prompt": lambda: apply_prompt(model, cfg.prompt),
        "prefix": lambda: apply_prefix(model, cfg.prefix),
    }
    if cfg.method in added:
        try:
            _train_only(model, added[cfg.method]())
        except ValueError as e:  # the config check catches it first; a direct caller gets this
            raise ConfigError([f"finetune.{cfg.method}: {e}"]) from None
        return
    if cfg.method not in ("lora", "qlora"):  # qlora's base is quantised once wrapped (trainer)
        return
    try:
        trainable = {id(p) for p in apply_lora(model, cfg.lora)}
    except ValueError as e:  # the config check catches these first; a direct caller gets this
        raise ConfigError([f"finetune.lora: {e}"]) from None
    if cfg.lora.init_from:
        load_adapters(model, cfg.lora)
    if cfg.lora.train_router:
        trainable |= {id(m.weight) for m in model.modules() if isinstance(m, TopKRouter)}
    for p in model.parameters():
        p.requires_grad_(id(p) in trainable)


def parameter_counts(model: nn.Module, ep_size: int = 1) -> dict[str, float]:
    """Trainable and total parameters of the whole model (expert parameters, which this rank
    holds 1/ep_size of, counted for all ranks; tied weights once; weights held in NF4 counted
    as frozen parameters), and the trainable share. A
    parameter marked ``trainable_fraction`` (an ESFT expert stack, moe/training/esft.py) counts
    that fraction of its global size as trainable."""
    trainable = total = 0
    for m in model.modules():  # weights held in NF4 (qlora) are frozen buffers
        total += quantized_numel(m) * (ep_size if isinstance(m, GroupedExperts) else 1)
    for p in model.parameters():
        n = p.numel() * (ep_size if getattr(p, "allreduce", True) is False else 1)
        total += n
        trainable += round(n * getattr(p, "trainable_fraction", 1)) if p.requires_grad else 0
    return {
        "trainable_params": trainable,
        "total_params": total,
        "trainable_share": trainable / total,
    }


def log_parameter_counts(counts: dict[str, float], method: str) -> None:
    log.info(
        f"finetune.method {method}: {counts['trainable_params']:,} of "
        f"{counts['total_params']:,} parameters train "
        f"({100 * counts['trainable_share']:.3f}%)"
    )


ADAPTERS_KEY = "finetune.lora.init_from"


def adapter_file_problem(path: str) -> str | None:
    """Why ``finetune.lora.init_from: path`` is not an adapter file we can read, or None. Cheap
    (the header only, no tensor is read): the launcher can ask it before anything starts."""
    from safetensors import SafetensorError, safe_open

    if Path(path).is_dir():  # safetensors would say "No such device"
        return (
            f"{ADAPTERS_KEY}: {path} is a directory; name the adapter file itself "
            "(moe-export CHECKPOINT OUT --format adapters writes OUT/adapter.safetensors)"
        )
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
    except (OSError, SafetensorError) as e:
        return f"{ADAPTERS_KEY}: cannot read {path} ({e})"
    if _saved_settings(meta) is None:
        return f"{ADAPTERS_KEY}: {path} is not an adapter file (moe-export --format adapters)"
    base_dtype = meta.get("base_dtype", "float32")  # files written before it was recorded: fp32
    if base_dtype not in BASE_DTYPES:
        return (
            f"{ADAPTERS_KEY}: {path} says base_dtype {base_dtype!r} "
            f"(known: {', '.join(BASE_DTYPES)})"
        )
    return None


def _saved_settings(meta: dict[str, str]) -> dict | None:
    """The LoRA settings an adapter file's metadata records; None if it records none (another
    safetensors file, or its metadata damaged)."""
    if "base_sha256" not in meta or "lora" not in meta:
        return None
    try:
        saved = json.loads(meta["lora"])
    except json.JSONDecodeError:
        return None
    return saved if isinstance(saved, dict) else None


@torch.no_grad()
def load_adapters(model: nn.Module, cfg: LoRAConfig) -> None:
    """Copy the factors of the adapter file ``cfg.init_from`` into ``model`` (single-device, its
    LoRA factors added): refused, naming the file, when it is not an adapter file
    (:func:`adapter_file_problem`), was trained on another base (fingerprint of the base
    weights), with other LoRA settings, or holds other tensors."""
    from safetensors import safe_open

    path, key = Path(cfg.init_from), ADAPTERS_KEY
    problem = adapter_file_problem(str(path))
    if problem:
        raise ConfigError([problem])
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        factors = {k: f.get_tensor(k) for k in f.keys()}
    saved = _saved_settings(meta)
    params = dict(model.named_parameters())
    base_dtype = BASE_DTYPES[meta.get("base_dtype", "float32")]
    problems = []
    if meta["base_sha256"] != base_fingerprint(params, base_dtype):
        problems.append(
            f"{key}: {path} was trained on another base model (its base fingerprint "
            f"{meta['base_sha256'][:12]}... differs from this run's, "
            "model.init_from); apply it to the checkpoint it was trained from"
        )
    # The settings that shape the factors and what they compute (arch fields of LoRAConfig).
    problems += [
        f"finetune.lora.{name}: {getattr(cfg, name)!r} here, {saved.get(name)!r} in {path}"
        for name in function_keys(LoRAConfig)
        if saved.get(name) != _plain(getattr(cfg, name))
    ]
    ours = {n: p for n, p in params.items() if is_factor(n)}
    if not problems and (
        factors.keys() != ours.keys() or any(factors[n].shape != p.shape for n, p in ours.items())
    ):
        problems.append(f"{key}: the factors in {path} do not match this model's")
    if problems:
        raise ConfigError(problems)
    for name, p in ours.items():
        p.copy_(factors[name])


def _plain(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def _train_only(model: nn.Module, params: list[nn.Parameter]) -> None:
    keep = {id(p) for p in params}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)
