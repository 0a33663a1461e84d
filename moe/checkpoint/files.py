"""The checkpoint directory on disk: names, the completion marker, finding and checking
checkpoints, and reading files. Pure file work (no process group, no engine): the trainer, the
DeepSpeed adapter, the evaluation, the exporters and upcycling all build on it."""

from __future__ import annotations

import json
import pickle
import re
import zipfile
from pathlib import Path

import torch

from moe.core.config_schema import dotted_get, function_keys, resume_keys, to_dict
from moe.core.errors import CheckpointError, DamagedCheckpointError
from moe.core.run_dir import RunDir

RUN_CONFIG = "run_config.yaml"


MARKER = "checkpoint.json"


LATEST = "latest"


TOKENIZER_COPY = "tokenizer.model"


MAIN_STATES = "mp_rank_00_model_states.pt"

EXPERT_DIR = "experts"
"""Subdirectory of a tag directory that holds DeepSpeed's per-expert files."""


FORMAT_VERSION = 1


_TAG = re.compile(r"^step_(\d{7,})$")


_EXPERT_FILE = re.compile(r"(?:^|/)layer_(\d+)_expert_(\d+)_mp_rank_00_model_states\.pt$")


def tag_for(step: int) -> str:
    return f"step_{step:07d}"


def rng_file(rank: int) -> str:
    return f"rng_rank_{rank:05d}.pt"


def read_marker(tag_dir: Path) -> dict | None:
    """The completion marker of a checkpoint directory, or None if the save never finished."""
    try:
        marker = json.loads((tag_dir / MARKER).read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as e:
        raise DamagedCheckpointError(
            f"{tag_dir / MARKER}: unreadable completion marker ({e})"
        ) from None
    if not isinstance(marker, dict) or marker.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{tag_dir / MARKER}: not a checkpoint marker of format {FORMAT_VERSION}"
        )
    return marker


def tags_by_step(ckpt_dir: Path) -> list[tuple[int, str]]:
    """(step, tag) of every checkpoint directory in ``ckpt_dir``, complete or not, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = [
        (int(m.group(1)), p.name)
        for p in ckpt_dir.iterdir()
        if p.is_dir() and (m := _TAG.match(p.name))
    ]
    return sorted(found)


def complete_tags(ckpt_dir: Path) -> list[str]:
    """Tags of the complete checkpoints in ``ckpt_dir``, oldest first."""
    return [tag for _, tag in tags_by_step(ckpt_dir) if (ckpt_dir / tag / MARKER).is_file()]


def find_latest(ckpt_dir: Path) -> str | None:
    """The newest complete checkpoint's tag. Directories without a completion marker are saves
    that were interrupted; they are never chosen."""
    tags = complete_tags(Path(ckpt_dir))
    return tags[-1] if tags else None


def verify_files(tag_dir: Path) -> dict:
    """Check that ``tag_dir`` is a complete checkpoint whose files are all present with the sizes
    recorded at save time, and that every expert of every MoE layer has exactly one file.
    Returns the marker."""
    tag_dir = Path(tag_dir)
    if not tag_dir.is_dir():
        raise CheckpointError(f"{tag_dir}: no such checkpoint directory")
    marker = read_marker(tag_dir)
    if marker is None:
        raise CheckpointError(
            f"{tag_dir}: incomplete checkpoint (no {MARKER}); its save was "
            "interrupted. Resume from an earlier one (--resume auto picks the "
            "newest complete checkpoint)"
        )
    problems = []
    for name, size in marker["files"].items():
        path = tag_dir / name
        if not path.is_file():
            problems.append(f"{path}: missing (the checkpoint recorded {size} bytes)")
        elif path.stat().st_size != size:
            problems.append(
                f"{path}: truncated or altered: {path.stat().st_size} bytes, the "
                f"checkpoint recorded {size}"
            )
    expected = {
        (layer, e)
        for layer in range(marker["num_moe_layers"])
        for e in range(marker["num_experts"])
    }
    present = {
        (int(m.group(1)), int(m.group(2))): name
        for name in marker["files"]
        if (m := _EXPERT_FILE.search(name))
    }
    missing = sorted(expected - present.keys())
    extra = sorted(present.keys() - expected)
    if missing:
        problems.append(f"{tag_dir}: no file for (MoE layer, expert) {missing[:8]}")
    if extra:
        problems.append(f"{tag_dir}: unexpected expert files {[present[k] for k in extra[:8]]}")
    if problems:
        raise DamagedCheckpointError(
            "damaged checkpoint:\n" + "\n".join(f"  - {p}" for p in problems)
        )
    return marker


def config_mismatches(saved_model: dict, model_cfg) -> list[str]:
    """Settings that change the computed function (the fields ``model_cfg``'s dataclass declares
    with ``arch``, moe/core/config_schema.py) on which a saved model config and ``model_cfg``
    disagree. A key the saved config lacks (a checkpoint older than the option) holds its
    default."""
    current = to_dict(model_cfg)
    defaults = to_dict(type(model_cfg)())
    out = []
    for key in function_keys(type(model_cfg)):
        saved = dotted_get(saved_model, key, absent=dotted_get(defaults, key))
        if saved != dotted_get(current, key):
            out.append(
                f"model.{key}: the checkpoint has {saved!r}, the config has "
                f"{dotted_get(current, key)!r}"
            )
    return out


def finetune_mismatches(saved_finetune: dict | None, finetune_cfg) -> list[str]:
    """The settings of ``finetune_cfg`` that decide which parameters exist and train (declared
    ``arch`` or ``fixed``, moe/core/config_schema.py) on which a saved ``finetune`` section
    disagrees; a checkpoint without one (before fine-tuning existed, or not fine-tuned) holds
    the defaults."""
    current = to_dict(finetune_cfg)
    defaults = to_dict(type(finetune_cfg)())
    keys = [
        k for k in resume_keys(type(finetune_cfg)) if k == "method" or current["method"] != "none"
    ]
    out = []
    for key in keys:
        saved = dotted_get(saved_finetune or {}, key, absent=dotted_get(defaults, key))
        if saved != dotted_get(current, key):
            out.append(
                f"finetune.{key}: the checkpoint has {saved!r}, the config has "
                f"{dotted_get(current, key)!r}"
            )
    return out


def verify_checkpoint(tag_dir: Path, cfg=None, tokenizer_sha256: str | None = None) -> dict:
    """Everything checkable before loading: complete, no missing or truncated file, every expert
    present once, the same function-changing model settings as ``cfg`` (config_mismatches) and
    the same tokenizer. Returns the marker."""
    import yaml

    marker = verify_files(tag_dir)
    problems = []
    if cfg is not None:
        saved = yaml.safe_load((Path(tag_dir) / RUN_CONFIG).read_text())
        changed = config_mismatches(saved.get("model", {}), cfg.model)
        changed += finetune_mismatches(saved.get("finetune"), cfg.finetune)
        problems += [f"{p} ({Path(tag_dir) / RUN_CONFIG})" for p in changed]
        if changed:
            problems.append(
                "these settings change the function the model computes or which "
                "parameters train, so a run resumes only with the checkpoint's "
                "values; to start a different model from its weights, set "
                "model.init_from to the checkpoint in a new run instead of resuming"
            )
    saved_tok = marker.get("tokenizer") or {}
    if tokenizer_sha256 is not None and saved_tok.get("sha256") != tokenizer_sha256:
        problems.append(
            f"tokenizer: the checkpoint was trained with {saved_tok.get('file')} "
            f"(sha256 {str(saved_tok.get('sha256'))[:12]}...), the data uses sha256 "
            f"{tokenizer_sha256[:12]}...; token ids would mean different text"
        )
    if problems:
        raise CheckpointError(
            f"checkpoint {tag_dir} does not match this run:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    return marker


def load_file(path: Path) -> dict:
    """torch.load restricted to tensors and plain data, with errors that name the file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise DamagedCheckpointError(f"{path}: missing checkpoint file") from None
    except Exception as e:  # torch raises many types for truncated or foreign files
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        if refused:
            # torch's refusal goes on for paragraphs and suggests weights_only=False, which would
            # run whatever code the file holds.
            raise DamagedCheckpointError(
                f"{path}: holds Python objects other than tensors and plain data "
                f"({refused[1]}), which are never unpickled (a file of another program, or not "
                "saved by this one)"
            ) from e
        cause = str(e).split("WeightsUnpickler error:", 1)[-1]  # the rest: torch's advice
        first = next((line.strip() for line in cause.splitlines() if line.strip()), "")
        raise DamagedCheckpointError(
            f"{path}: unreadable checkpoint file ({type(e).__name__}: {first})"
        ) from e


def unreadable(e: BaseException) -> bool:
    """Whether ``e``, raised while a checkpoint file was deserialized (torch.load, also inside
    DeepSpeed), says that the file's bytes are not what was saved, rather than that the machine
    failed (memory, a collective)."""
    if isinstance(e, (UnicodeDecodeError, pickle.UnpicklingError, EOFError, zipfile.BadZipFile)):
        return True
    damage = ("PytorchStreamReader", "invalid load key", "unpickl", "archive")
    return isinstance(e, RuntimeError) and any(m in str(e) for m in damage)


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a checkpoint directory, a checkpoints directory or a run directory (their newest
    complete checkpoint)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if (path / MARKER).exists() or (path / MAIN_STATES).exists():
        return path
    for ckpt_dir in (path, RunDir(path).checkpoints):
        tag = find_latest(ckpt_dir)
        if tag is not None:
            return ckpt_dir / tag
    raise CheckpointError(
        f"{path}: neither a checkpoint ({MARKER}) nor a directory with a complete checkpoint"
    )


def expert_file_ids(filename: str) -> tuple[int, int] | None:
    m = _EXPERT_FILE.search(filename)
    return (int(m.group(1)), int(m.group(2))) if m else None
