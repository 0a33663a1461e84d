"""Starting a model from another checkpoint's weights, upcycling dense FFNs into MoE layers.

Sparse upcycling (Komatsuzaki et al., 2022): every expert of an MoE layer starts as a copy of
the dense FFN it replaces (optionally perturbed so that experts can diverge), the router starts
fresh, and every other weight is copied. With dropless routing whose combine weights sum to 1
(top-k then softmax, or renormalized softmax-then-top-k, scaling factor 1) and no noise, the
upcycled model computes exactly the dense model's function at step 0: sum_k w_k FFN(x) = FFN(x).

Use it from a run with ``model.init_from: <dense checkpoint>`` (or ``hf:<transformers directory>``;
and ``model.upcycle_noise_std``);
the experts' width (``model.moe.expert_hidden``) must equal the dense FFN's hidden width.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from moe.checkpoint.files import read_marker, resolve_checkpoint
from moe.core.config_schema import dotted_get, function_keys, to_dict
from moe.core.errors import CheckpointError, ConfigError
from moe.model.transformer import ModelConfig, MoETransformer
from moe.weights.hf import read_hf_config, read_hf_model, refuse_nonfinite, tokenizer_record
from moe.weights.load import load_model

_DENSE_FFN = re.compile(r"^blocks\.(\d+)\.ffn\.(w_in|w_out)\.weight$")
_FRESH = re.compile(r"^blocks\.\d+\.ffn\.(router\.weight|router\.score_bias)$")


def _may_differ(key: str) -> bool:
    """Upcycling replaces the feed-forward layers: their kind and the MoE section may differ
    (widths are checked weight by weight), except the activation, which every expert copies;
    the context may grow (learned positions then differ in shape and are refused by name)."""
    return key in ("ffn", "max_seq_len") or (key.startswith("moe.") and key != "moe.activation")


def _effective(cfg: ModelConfig) -> dict:
    """``cfg`` as plain data with the sizes that null derives filled in, so that a null and the
    value it stands for compare equal."""
    out = to_dict(cfg)
    out.update(n_kv_heads=cfg.kv_heads, head_dim=cfg.head_size)
    return out


def incompatibilities(source: ModelConfig, target: ModelConfig) -> list[str]:
    """The function-changing fields (``arch``, moe/core/config_schema.py) on which the source's and
    this run's model configs disagree, outside the feed-forward layers upcycling replaces."""
    src, tgt = _effective(source), _effective(target)
    out = []
    for key in function_keys(type(target)):
        theirs, ours = dotted_get(src, key), dotted_get(tgt, key)
        if not _may_differ(key) and theirs != ours:
            out.append(f"model.{key}: this run has {ours!r}, the source checkpoint {theirs!r}")
    return out


def upcycle_state_dict(
    dense_state: dict[str, torch.Tensor],
    model: MoETransformer,
    noise_std: float = 0.0,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A state dict for ``model`` built from ``dense_state`` (a single-device state dict).

    Same-named, same-shaped tensors are copied. Where ``model`` has an MoE layer and the source
    a dense FFN (``blocks.i.ffn.w_in/w_out``), each expert gets that FFN's weights, plus
    Gaussian noise of std ``noise_std * std(weight)`` if ``noise_std > 0``; the router keeps the
    model's fresh initialization. Anything else that does not line up is an error.
    """
    target = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    gen = torch.Generator().manual_seed(seed)
    used = set()
    for key, value in target.items():
        if key in dense_state and dense_state[key].shape == value.shape:
            out[key] = dense_state[key].clone()
            used.add(key)
        elif _FRESH.match(key):
            out[key] = value.clone()
        elif key.endswith((".ffn.experts.w_in", ".ffn.experts.w_out")):
            src_key = key.replace(".experts.", ".") + ".weight"
            if src_key not in dense_state:
                problems.append(f"{key}: the source has no dense FFN weight {src_key}")
                continue
            w = dense_state[src_key].t()  # nn.Linear (out, in) -> expert layout (in, out)
            if w.shape != value.shape[1:]:
                problems.append(
                    f"{key}: experts of shape {tuple(value.shape[1:])} cannot copy the "
                    f"dense FFN's {tuple(w.shape)}; set model.moe.expert_hidden to the "
                    "dense FFN's hidden width"
                )
                continue
            experts = w.expand_as(value).clone()
            if noise_std > 0:
                noise = torch.randn(experts.shape, generator=gen, dtype=torch.float32)
                experts = experts + (noise * noise_std * w.float().std()).to(experts.dtype)
            out[key] = experts
            used.add(src_key)
        elif key in dense_state:
            problems.append(
                f"{key}: shape {tuple(value.shape)} here, "
                f"{tuple(dense_state[key].shape)} in the source"
            )
        else:
            problems.append(f"{key}: not in the source checkpoint")
    unused = [k for k in dense_state if k not in used]
    if unused:
        problems.append(
            f"source weights with no place in this model: {unused[:5]} (a checkpoint of an "
            "adapter, prompt or prefix fine-tuning keeps its added modules: export it with "
            "moe-export, or start from the checkpoint it was fine-tuned from)"
        )
    if problems:
        raise CheckpointError(
            "cannot initialize the model from the source checkpoint:\n  - "
            + "\n  - ".join(problems)
        )
    return out


HF_PREFIX = "hf:"
"""``model.init_from: hf:PATH`` reads a transformers model directory (moe/weights/hf.py)."""


class InitFromError(ConfigError, CheckpointError):
    """``model.init_from`` gives no usable weights: a problem of the checkpoint it names, and of
    the configuration (launch/train.py does not restart it)."""


def init_from_problem(path: str | Path) -> str | None:
    """Why ``model.init_from: path`` cannot give a run its weights, or None: a checkpoint (or a
    run or checkpoints directory with a complete one), or ``hf:DIR`` with a transformers
    config. Cheap (no tensor is read): the launcher asks it before anything starts."""
    try:
        if str(path).startswith(HF_PREFIX):
            read_hf_config(Path(str(path)[len(HF_PREFIX) :]))
        else:
            resolve_checkpoint(path)
    except CheckpointError as e:
        hint = ""
        if not str(path).startswith(HF_PREFIX) and (Path(path) / "config.json").is_file():
            hint = f" (a transformers model directory is given as hf:{path})"
        return f"model.init_from: {e}{hint}"
    return None


def source_tokenizer(path: str | Path, finetune: bool = False) -> dict | None:
    """{"file", "sha256"} of the tokenizer a source checkpoint expects: a transformers
    directory's own (``hf:DIR``), the one ``moe-import`` recorded, or, for a fine-tuning
    (``finetune``), the one the checkpoint was trained with; None for the source of an
    upcycling, which may have been trained with another tokenizer before its embeddings are
    trained again."""
    if str(path).startswith(HF_PREFIX):
        return tokenizer_record(Path(str(path)[len(HF_PREFIX) :]))
    marker = read_marker(resolve_checkpoint(path)) or {}
    return marker.get("tokenizer") if finetune or marker.get("imported_from") else None


def check_source_tokenizer(
    path: str | Path, data_sha256: str, data_dir: str, finetune: bool = False
) -> None:
    """Refuse data tokenized otherwise than the source model ``path`` expects (an open-weights
    model, or any checkpoint a fine-tuning starts from): its ids would mean other text to the
    model. A source that is not one is a ConfigError too: a configuration no restart can fix."""
    problem = init_from_problem(path)
    if problem:
        raise InitFromError([problem])
    expected = source_tokenizer(path, finetune)
    if expected and expected["sha256"] != data_sha256:
        raise ConfigError(
            [
                f"model.init_from: {path} expects the tokenizer {expected['file']} "
                f"(sha256 {expected['sha256']}), the data in {data_dir} was prepared "
                f"with sha256 {data_sha256}; prepare it with data.tokenizer.model_file "
                "pointing at the model's tokenizer"
            ]
        )


def initialize_from_checkpoint(
    model: MoETransformer, path: str | Path, noise_std: float = 0.0, seed: int = 0
) -> None:
    """Load ``path`` (any layout, dense or MoE; ``hf:DIR`` a transformers directory) into
    ``model``, upcycling where needed."""
    try:
        if str(path).startswith(HF_PREFIX):
            arch, source_cfg, state = read_hf_model(str(path)[len(HF_PREFIX) :])
            refuse_nonfinite(state, str(path)[len(HF_PREFIX) :], arch, source_cfg)
            where = str(path)
        else:
            source, run_cfg, tag_dir = load_model(path)
            source_cfg, state, where = run_cfg.model, source.state_dict(), str(tag_dir)
    except CheckpointError as e:
        # A configuration no restart can fix (launch/train.py's final causes), by its key.
        raise InitFromError([f"model.init_from: {e}"]) from e
    problems = incompatibilities(source_cfg, model.cfg)
    if problems:
        raise ConfigError(problems, f"model.init_from ({where})")
    try:
        upcycled = upcycle_state_dict(state, model, noise_std, seed)
    except CheckpointError as e:
        raise InitFromError([f"model.init_from: {where}: {e}"]) from e
    model.load_state_dict(upcycled)
