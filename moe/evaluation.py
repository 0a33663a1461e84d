"""Evaluating checkpoints on one process: load any expert-parallel layout, compute perplexity."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from data_pipeline.reader import validation_windows
from moe.errors import CheckpointError
from moe.model import MoETransformer
from moe.parallel.deepspeed_adapter import (consolidated_state_dict, duplicated_experts,
                                            expert_file_ids)
from moe.training.checkpoint import (MAIN_STATES, MARKER, RUN_CONFIG, find_latest, load_file,
                                     verify_files)
from moe.training.config import RunConfig, load_config


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a checkpoint directory, a checkpoints directory or a run directory (their newest
    complete checkpoint)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if (path / MARKER).exists() or (path / MAIN_STATES).exists():
        return path
    for ckpt_dir in (path, path / "checkpoints"):
        tag = find_latest(ckpt_dir)
        if tag is not None:
            return ckpt_dir / tag
    raise CheckpointError(f"{path}: neither a checkpoint ({MARKER}) nor a directory with a "
                          "complete checkpoint")


def load_consolidated(path: str | Path) -> tuple[dict, RunConfig, Path]:
    """The single-device state dict of a checkpoint saved with any layout, after checking it:
    complete, no file missing or truncated, every expert of every layer present exactly once,
    shapes as the config says, no two experts with identical weights."""
    tag_dir = resolve_checkpoint(path)
    verify_files(tag_dir)
    cfg = load_config(tag_dir / RUN_CONFIG)
    main = load_file(tag_dir / MAIN_STATES)
    experts = {}
    for f in sorted(tag_dir.iterdir()):
        ids = expert_file_ids(f.name)
        if ids is not None:
            experts[ids] = load_file(f)
    try:
        state = consolidated_state_dict(main["module"], experts, str(tag_dir))
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if cfg.model.vocab_size is None:
        raise CheckpointError(f"{tag_dir / RUN_CONFIG}: model.vocab_size is not resolved")
    expected = {k: v.shape for k, v in MoETransformer(cfg.model).state_dict().items()}
    problems = []
    for key, shape in expected.items():
        if key not in state and not (cfg.model.tie_embeddings and key == "lm_head.weight"):
            problems.append(f"{key}: missing")
        elif key in state and state[key].shape != shape:
            problems.append(f"{key}: shape {tuple(state[key].shape)}, the config needs {tuple(shape)}")
    problems += [f"{key}: not part of the model" for key in state if key not in expected]
    for key, value in state.items():
        if key.endswith(".experts.w_in") or key.endswith(".experts.w_out"):
            dup = duplicated_experts(value)
            if dup:
                problems.append(f"{key}: experts {dup} hold identical weights (saved twice under "
                                "different ids?)")
    if problems:
        raise CheckpointError(f"{tag_dir}: checkpoint does not match its config "
                              f"({tag_dir / RUN_CONFIG}):\n" + "\n".join(f"  - {p}" for p in problems))
    return state, cfg, tag_dir


def load_model(path: str | Path) -> tuple[MoETransformer, RunConfig, Path]:
    """Build the single-device model from a DeepSpeed checkpoint saved with any layout."""
    state, cfg, tag_dir = load_consolidated(path)
    model = MoETransformer(cfg.model)
    model.load_state_dict(state, strict=not cfg.model.tie_embeddings)
    model.eval()
    return model, cfg, tag_dir


@torch.no_grad()
def evaluate_perplexity(model: MoETransformer, data_dir: str | Path, seq_len: int,
                        batch_size: int = 8, max_tokens: int | None = None) -> dict:
    """Token-weighted mean next-token loss over the validation split, and its perplexity."""
    total_loss, total_tokens = 0.0, 0
    pending: list[torch.Tensor] = []

    def flush():
        nonlocal total_loss, total_tokens
        batch = torch.stack(pending)
        logits = model(batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
        total_loss += float(loss)
        total_tokens += batch[:, 1:].numel()
        pending.clear()

    for window in validation_windows(data_dir, seq_len, max_tokens):
        if pending and len(window) != len(pending[0]):
            flush()
        pending.append(window)
        if len(pending) == batch_size:
            flush()
    if pending:
        flush()
    if total_tokens == 0:
        raise CheckpointError(f"{data_dir}: the validation split has no tokens to evaluate")
    mean = total_loss / total_tokens
    return {"loss": mean, "perplexity": math.exp(mean), "tokens": total_tokens}
