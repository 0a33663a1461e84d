"""A run's checkpoint as one single-device model, on one process: the consolidated weights of
any expert-parallel layout, checked against the run config saved with them. Used wherever a
checkpoint is read outside a training engine: evaluation, export, ``model.init_from``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from moe.checkpoint.consolidate import read_consolidated
from moe.checkpoint.files import RUN_CONFIG, resolve_checkpoint, verify_files
from moe.config.run import FinetuneConfig, RunConfig, load_config
from moe.core.errors import CheckpointError
from moe.model.adapters.bottleneck import apply_bottleneck_adapters
from moe.model.adapters.lora import apply_lora, merge_lora
from moe.model.adapters.prefix import apply_prefix
from moe.model.adapters.prompt import apply_prompt
from moe.model.adapters.qlora import dequantize_base, quantize_base
from moe.model.transformer import MoETransformer


def build_model(cfg: RunConfig) -> MoETransformer:
    """The single-device model a run trains: the base model and its adapters (finetune). A
    qlora model's NF4 base is left empty, for a checkpoint's to be loaded into it."""
    model = MoETransformer(cfg.model)
    if cfg.finetune.method in ("lora", "qlora"):
        apply_lora(model, cfg.finetune.lora)
    if cfg.finetune.method == "qlora":  # NF4 buffers shaped for a checkpoint's (no torchao)
        quantize_base(model, quantize=False)
    elif cfg.finetune.method == "adapter":  # kept by loaded models: adapters do not merge
        apply_bottleneck_adapters(model, cfg.finetune.adapter)
    elif cfg.finetune.method == "prompt":  # the soft prompt goes before every sequence
        apply_prompt(model, cfg.finetune.prompt)
    elif cfg.finetune.method == "prefix":
        apply_prefix(model, cfg.finetune.prefix)
    return model


def load_consolidated(
    path: str | Path, on_file: Callable[[], None] | None = None
) -> tuple[dict, RunConfig, Path]:
    """The single-device state dict of a checkpoint saved with any layout, its run config and
    its directory, after checking it: complete, no file missing or truncated, every expert of
    every layer present exactly once and holding the weights saved under its id, every tensor
    shaped as the config says. A bf16 run gives the fp32 master weights its optimizer trained.
    ``on_file``: called after each file read (progress).

    One way through the checkpoint: resolve the path, verify the files against the marker, read
    the config, read the tensors, check them against the model the config builds."""
    tag_dir = resolve_checkpoint(path)
    marker = verify_files(tag_dir)
    cfg = load_config(tag_dir / RUN_CONFIG)
    if cfg.model.vocab_size is None:
        raise CheckpointError(f"{tag_dir / RUN_CONFIG}: model.vocab_size is not resolved")
    state, _ = read_consolidated(
        tag_dir, on_file, marker, master_weights=cfg.train.precision != "fp32"
    )
    problems = _shape_problems(state, cfg)
    if problems:
        raise CheckpointError(
            f"{tag_dir}: checkpoint does not match its config "
            f"({tag_dir / RUN_CONFIG}):\n" + "\n".join(f"  - {p}" for p in problems)
        )
    return state, cfg, tag_dir


def _shape_problems(state: dict, cfg: RunConfig) -> list[str]:
    """Every tensor the model needs and lacks, shaped otherwise, or that the model does not have."""
    expected = {k: v.shape for k, v in build_model(cfg).state_dict().items()}
    problems = []
    for key, shape in expected.items():
        if key not in state and not (cfg.model.tie_embeddings and key == "lm_head.weight"):
            problems.append(f"{key}: missing")
        elif key in state and state[key].shape != shape:
            problems.append(
                f"{key}: shape {tuple(state[key].shape)}, the config needs {tuple(shape)}"
            )
    return problems + [f"{key}: not part of the model" for key in state if key not in expected]


def merged_adapters(state: dict, cfg: RunConfig) -> tuple[dict, RunConfig]:
    """A fine-tuned run's single-device state dict with its adapters folded into the base
    weights (moe/model/adapters/lora.py, merge_lora), and its config as a plain model's
    (finetune.method none); other runs' are returned as they are. A qlora base is dequantised
    first: the merged weight is the NF4 base's value plus the LoRA update."""
    if cfg.finetune.method not in ("lora", "qlora"):
        return state, cfg
    model = build_model(cfg)
    model.load_state_dict(state, strict=not cfg.model.tie_embeddings)
    dequantize_base(model)
    merge_lora(model)
    return model.state_dict(), dataclasses.replace(cfg, finetune=FinetuneConfig())


def load_model(path: str | Path) -> tuple[MoETransformer, RunConfig, Path]:
    """Build the single-device model from a DeepSpeed checkpoint saved with any layout. The
    adapters of a fine-tuning run (LoRA, QLoRA) are merged into the base weights: the model is a plain
    one, computing the fine-tuned function. Adapters that do not merge (bottleneck adapters,
    prompt and prefix tuning) are kept as modules."""
    state, cfg, tag_dir = load_consolidated(path)
    state, plain = merged_adapters(state, cfg)
    model = build_model(plain)
    model.load_state_dict(state, strict=not cfg.model.tie_embeddings)
    model.eval()
    return model, cfg, tag_dir
