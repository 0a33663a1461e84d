"""Evaluating checkpoints on one process: load any expert-parallel layout, compute perplexity."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from data_pipeline.reader import validation_windows
from moe.errors import CheckpointError
from moe.model import MoETransformer
from moe.parallel.deepspeed_adapter import consolidated_state_dict, expert_file_ids
from moe.training.checkpoint import RUN_CONFIG, find_latest
from moe.training.config import RunConfig, load_config

MAIN_STATES = "mp_rank_00_model_states.pt"


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a checkpoint tag directory, a checkpoints directory (uses ``latest``) or a run
    directory (uses its checkpoints' ``latest``)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if (path / MAIN_STATES).exists():
        return path
    for ckpt_dir in (path, path / "checkpoints"):
        if (ckpt_dir / "latest").exists():
            tag = find_latest(ckpt_dir)
            return ckpt_dir / tag
    raise CheckpointError(f"{path}: neither a checkpoint ({MAIN_STATES}) nor a directory with a "
                          "'latest' checkpoint")


def _load(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing checkpoint file") from None
    except Exception as e:  # torch raises many types for truncated or foreign files
        raise CheckpointError(f"{path}: unreadable checkpoint file ({type(e).__name__}: {e})") from e


def load_model(path: str | Path) -> tuple[MoETransformer, RunConfig, Path]:
    """Build the single-device model from a DeepSpeed checkpoint saved with any layout."""
    tag_dir = resolve_checkpoint(path)
    cfg_path = tag_dir / RUN_CONFIG
    if not cfg_path.exists():
        raise CheckpointError(f"{tag_dir}: no {RUN_CONFIG}; was it saved by moe-train?")
    cfg = load_config(cfg_path)
    main = _load(tag_dir / MAIN_STATES)
    experts = {}
    for f in sorted(tag_dir.iterdir()):
        ids = expert_file_ids(f.name)
        if ids is not None:
            experts[ids] = _load(f)
    state = consolidated_state_dict(main["module"], experts)
    model = MoETransformer(cfg.model)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # A tied head shares the embedding: its key may be absent from the checkpoint.
    missing = [k for k in missing if not (cfg.model.tie_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise CheckpointError(f"{tag_dir}: checkpoint does not match its config: missing "
                              f"{missing[:5]}, unexpected {unexpected[:5]}")
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
