"""Exporting a checkpoint saved with any parallel layout, on one CPU process:

- ``fp32``: the consolidated single-device state dict in safetensors (fp32 master weights when
  the checkpoint has ZeRO partitions), with the run config and the tokenizer;
- ``hf``: a Hugging Face ``transformers`` model directory (config.json, safetensors weights and a
  tokenizer ``AutoTokenizer`` loads) for configurations an architecture there computes exactly:
  Mixtral (no shared experts), Qwen2-MoE (shared experts, dense layers allowed) or Llama (every
  layer dense). An imported model (``moe-import``) gets its own tokenizer files back (none when
  the directory it came from held none: :func:`no_tokenizer_note` says so). What each
  target holds of every config field is stated in ``moe/tools/hf_support.py``; anything else is
  refused before anything is written, and every tensor of the checkpoint must be placed;
- ``deepspeed``: the whole training state re-saved as a DeepSpeed checkpoint of one rank with
  expert parallelism 1, the layout DeepSpeed's own tools (``zero_to_fp32``) read whatever layout
  saved the original.

Weight layout: our stacked experts are ``w_in`` (E, D, 2H) = [gate | up] along the last dim and
``w_out`` (E, H, D); transformers' fused experts are ``gate_up_proj`` (E, 2H, D) = [gate; up] and
``down_proj`` (E, D, H): one transpose each. Qwen2-MoE scales its shared expert by
``sigmoid(shared_expert_gate(x))``: our ``moe.shared_expert_gate`` is exactly that gate; without
it a zero gate gives exactly 1/2, so the shared expert's output projection is exported times 2
(exact in floating point).

Every export is written into a temporary directory next to the destination and renamed into
place at the end; an existing destination is never overwritten.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from data_pipeline.progress import Progress
from moe.checkpoint.consolidate import state_files
from moe.checkpoint.files import (
    MARKER,
    RUN_CONFIG,
    TOKENIZER_COPY,
    resolve_checkpoint,
    verify_files,
)
from moe.config.run import RunConfig, dump_config, load_config
from moe.core.config_schema import from_dict, to_dict
from moe.core.errors import CheckpointError
from moe.core.fileio import STORAGE_CAUSES
from moe.model.adapters.lora import BASE_DTYPES, base_fingerprint, is_factor
from moe.model.transformer import MoETransformer
from moe.tools import hf_support
from moe.tools.hf_tokenizer import hf_tokenizer
from moe.weights.hf import links, to_hf
from moe.weights.load import build_model, load_consolidated, merged_adapters

FP32_FILE = "model.safetensors"
HF_TOKENIZER_DIR = "hf_tokenizer"
"""Where ``moe-import`` keeps the tokenizer files of the model it read (tokenizer.json, ...)."""


def tokenizer_source(tag_dir: Path) -> Path | None:
    """Where a checkpoint keeps its tokenizer: the SentencePiece model training saves with
    every checkpoint, the directory of Hugging Face tokenizer files ``moe-import`` copied, or
    None (an import of a directory that held weights and config only)."""
    if (tag_dir / TOKENIZER_COPY).is_file():
        return tag_dir / TOKENIZER_COPY
    if (tag_dir / HF_TOKENIZER_DIR).is_dir():
        return tag_dir / HF_TOKENIZER_DIR
    return None


def no_tokenizer_note(tag_dir: Path) -> str:
    """What an export of a checkpoint without a tokenizer lacks, and how to complete it."""
    return (
        f"{tag_dir} holds no tokenizer (imported from a directory without tokenizer "
        "files), so the export has none: copy the model's tokenizer files (tokenizer.json "
        "or tokenizer.model, tokenizer_config.json, special_tokens_map.json) into it"
    )


def _copy_tokenizer(tag_dir: Path, tmp: Path) -> None:
    """The checkpoint's tokenizer files into an fp32 export, as the checkpoint holds them."""
    source = tokenizer_source(tag_dir)
    if source is not None and source.is_dir():
        shutil.copytree(source, tmp / HF_TOKENIZER_DIR)
    elif source is not None:
        shutil.copy(source, tmp / TOKENIZER_COPY)


def consolidated_fp32(
    path: str | Path, progress: bool = False, merge_adapters: bool = False
) -> tuple[dict[str, torch.Tensor], RunConfig, Path]:
    """Single-device fp32 state dict of a checkpoint saved with any layout, checked for
    integrity: the fp32 master weights whatever the training precision (load_consolidated reads
    them from the ZeRO partitions of a bf16 run), buffers from the model states. ``progress``:
    a bar over the files read on a terminal, log lines otherwise (a big checkpoint is mostly
    reading). A fine-tuned checkpoint with adapters (LoRA) is exported only with
    ``merge_adapters``: the adapters folded into the base weights, the config a plain model's."""
    tag_dir = resolve_checkpoint(path)
    if merge_adapters:  # before reading any tensor: an option that would do nothing is refused
        method = load_config(tag_dir / RUN_CONFIG).finetune.method
        if method not in ("lora", "qlora"):
            raise CheckpointError(
                f"{tag_dir}: --merge-adapters: the checkpoint holds no LoRA "
                f"adapters to merge (finetune.method {method} in its "
                f"{RUN_CONFIG}); export it without --merge-adapters"
            )
    bar = Progress(f"export: read {tag_dir}", len(state_files(tag_dir)), progress, unit="files")
    state, cfg, tag_dir = load_consolidated(tag_dir, on_file=lambda: bar.update(1))
    bar.close()
    if cfg.finetune.method in ("lora", "qlora") and not merge_adapters:
        raise CheckpointError(
            f"{tag_dir}: the checkpoint holds LoRA adapters (finetune.method "
            f"{cfg.finetune.method} in its run_config.yaml); pass --merge-adapters to fold them "
            "into the base weights and export a plain model"
        )
    state, cfg = merged_adapters(state, cfg)
    if cfg.model.tie_embeddings:
        state.pop("lm_head.weight", None)  # the same tensor as embed.weight
    return {k: v.float().contiguous() for k, v in state.items()}, cfg, tag_dir


def _publish(out_dir: Path, write) -> Path:
    """Run ``write(tmp_dir)`` and rename the result to ``out_dir``; nothing half-written stays.
    A full, read-only or over-quota disk is an OSError naming ``out_dir``, whichever library
    was writing."""
    out_dir = Path(out_dir)
    if out_dir.exists() or out_dir.is_symlink():
        raise CheckpointError(f"{out_dir}: already exists; choose a new output directory")
    tmp = None
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the export is an ordinary directory
        write(tmp)
        for f in tmp.rglob("*"):
            f.chmod((0o777 if f.is_dir() else 0o666) & ~umask)
        tmp.rename(out_dir)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        cause = _storage_errno(e)
        if cause is None:
            raise
        raise OSError(cause, os.strerror(cause), str(out_dir)) from None
    return out_dir


def _storage_errno(e: BaseException) -> int | None:
    """The errno of STORAGE_CAUSES behind a failed write, or None: an OSError in the chain
    (torch.save through a file object raises a RuntimeError over it), or the "(os error N)"
    that safetensors' own writer puts in its message."""
    while e is not None:
        if isinstance(e, OSError):
            return e.errno if e.errno in STORAGE_CAUSES else None
        found = re.search(r"\(os error (\d+)\)", str(e))
        if found:
            return int(found[1]) if int(found[1]) in STORAGE_CAUSES else None
        e = e.__cause__ or e.__context__
    return None


def export_fp32(
    checkpoint: str | Path,
    out_dir: str | Path,
    progress: bool = False,
    merge_adapters: bool = False,
) -> Path:
    from safetensors.torch import save_file

    state, cfg, tag_dir = consolidated_fp32(checkpoint, progress, merge_adapters)

    def write(tmp: Path) -> None:
        save_file(state, str(tmp / FP32_FILE), metadata={"format": "pt", "source": str(tag_dir)})
        _write_run_config(cfg, tag_dir, tmp, merge_adapters)
        _copy_tokenizer(tag_dir, tmp)

    return _publish(Path(out_dir), write)


ADAPTER_FILE = "adapter.safetensors"
"""``--format adapters``: the LoRA factors alone, with the base's fingerprint and the LoRA
settings in its metadata (``finetune.lora.init_from`` applies it)."""


def export_adapters(checkpoint: str | Path, out_dir: str | Path, progress: bool = False) -> Path:
    """Write the LoRA factors of a fine-tuned checkpoint alone (single-device names, routed
    experts' stacks over all global experts) into ``out_dir/adapter.safetensors``."""
    from safetensors.torch import save_file

    tag_dir = resolve_checkpoint(checkpoint)
    bar = Progress(f"export: read {tag_dir}", len(state_files(tag_dir)), progress, unit="files")
    state, cfg, tag_dir = load_consolidated(tag_dir, on_file=lambda: bar.update(1))
    bar.close()
    if cfg.finetune.method == "qlora":
        raise CheckpointError(
            f"{tag_dir}: a qlora checkpoint holds its base in NF4, and an "
            "adapter file names its base by the fingerprint of fp32 weights; "
            "export the whole model with --merge-adapters"
        )
    if cfg.finetune.method != "lora":
        raise CheckpointError(
            f"{tag_dir}: no adapters to export (finetune.method is "
            f"{cfg.finetune.method} in its run_config.yaml)"
        )
    if cfg.finetune.lora.train_router:
        raise CheckpointError(
            f"{tag_dir}: the routers trained too (finetune.lora.train_router), "
            "which the adapters alone do not hold; export the whole model "
            "with --merge-adapters"
        )
    factors = {k: v.float().contiguous() for k, v in state.items() if is_factor(k)}
    metadata = adapter_metadata(state, cfg, tag_dir)
    return _publish(
        Path(out_dir), lambda tmp: save_file(factors, str(tmp / ADAPTER_FILE), metadata=metadata)
    )


def adapter_metadata(
    state: dict[str, torch.Tensor], cfg: RunConfig, tag_dir: Path
) -> dict[str, str]:
    """safetensors metadata of an adapter file: its source, the fingerprint of the base it
    was trained on (at the precision the run held that base in) and the LoRA settings."""
    with torch.device("meta"):
        names = [name for name, _ in build_model(cfg).named_parameters()]
    base_dtype = "bfloat16" if cfg.train.precision == "bf16" else "float32"
    return {
        "format": "pt",
        "source": str(tag_dir),
        "base_dtype": base_dtype,
        "base_sha256": base_fingerprint({n: state[n] for n in names}, BASE_DTYPES[base_dtype]),
        "lora": json.dumps(to_dict(cfg.finetune.lora)),
    }


def _write_run_config(cfg: RunConfig, tag_dir: Path, tmp: Path, merged: bool) -> None:
    """The checkpoint's run config as saved, or a merged model's own (finetune.method none)."""
    if merged:
        (tmp / RUN_CONFIG).write_text(dump_config(cfg))
    else:
        shutil.copy(tag_dir / RUN_CONFIG, tmp / RUN_CONFIG)


def export_deepspeed(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Re-save a checkpoint of any layout as a DeepSpeed checkpoint of one rank with expert
    parallelism 1: weights, fp32 master weights, Adam moments, LR schedule, router state, data
    position and counters, through the trainer's own layout conversion (a resume with nothing
    left to train, then the final save). ``out_dir`` becomes a checkpoints directory (``latest``,
    DeepSpeed's ``zero_to_fp32.py``, ``step_N/``) that ``moe-train --resume`` also accepts.

    Runs in this process on one gloo rank (the whole model in memory, as zero_to_fp32 needs it
    too) and reads the run's prepared data directory (its manifest and tokenizer)."""
    from moe.training.trainer import DistEnv, train  # imports DeepSpeed

    tag_dir = resolve_checkpoint(checkpoint)
    marker = verify_files(tag_dir)
    d = to_dict(load_config(tag_dir / RUN_CONFIG))
    world = marker["world_size"]

    def write(tmp: Path) -> None:
        d.update(name="converted", output_dir=str(tmp / "run"))
        d["parallel"].update(world_size=1, expert_parallel_size=1)
        d["train"].update(
            max_steps=marker["step"],  # same global batch, one rank
            grad_accum_steps=d["train"]["grad_accum_steps"] * world,
        )
        d["logging"]["tensorboard"] = False
        d["eval"]["every_n_steps"] = 0
        cfg = from_dict(RunConfig, d)
        with _one_rank_process_group():
            train(cfg, DistEnv(0, 1, 0, 1), resume=str(tag_dir))
        ckpt_dir = cfg.run_files.checkpoints
        for f in ckpt_dir.iterdir():
            f.rename(tmp / f.name)
        shutil.rmtree(tmp / "run")

    return _publish(Path(out_dir), write)


class _one_rank_process_group:
    """A gloo process group (through DeepSpeed) of this process alone, unless one exists."""

    KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")

    def __enter__(self):
        import deepspeed
        import torch.distributed as dist

        from moe.training.ports import free_port

        self.created = not dist.is_initialized()
        if self.created:
            self.saved_env = {k: os.environ.get(k) for k in self.KEYS}
            os.environ.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()),
                RANK="0",
                WORLD_SIZE="1",
                LOCAL_RANK="0",
                LOCAL_WORLD_SIZE="1",
            )
            deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        if self.created:
            dist.destroy_process_group()
            for k, v in self.saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


# --- Hugging Face -------------------------------------------------------------------------------


ADDED_MODULES = {
    "prompt": "its soft prompt",
    "prefix": "its attention prefixes",
    "adapter": "its bottleneck adapters",
}
"""Fine-tuning methods whose checkpoints hold modules of their own, which no transformers
architecture we export to has a place for."""


def hf_problems(cfg: RunConfig, arch: str, state: dict) -> list[str]:
    """Why the model cannot be expressed exactly as ``arch`` (empty when it can), one entry per
    offending config key, from the statement in ``moe/tools/hf_support.py``, and the fine-tuning
    method where it added modules of its own."""
    out = []
    method = cfg.finetune.method
    added = sorted(k for k in state if k not in _base_keys(cfg)) if method in ADDED_MODULES else []
    if added:
        shown = ", ".join(added[:3]) + (f", ... ({len(added)} in all)" if len(added) > 3 else "")
        out.append(
            f"finetune.method: {method!r}: a {arch} model has no place for "
            f"{ADDED_MODULES[method]} ({shown})"
        )
    return out + hf_support.problems(cfg.model, arch, state)


def _base_keys(cfg: RunConfig) -> set[str]:
    """The parameter and buffer names of the plain model of ``cfg.model``."""
    with torch.device("meta"):
        return set(MoETransformer(cfg.model).state_dict())


def choose_arch(cfg: RunConfig, arch: str, state: dict, where: Path) -> str:
    """The target to export to, or a CheckpointError naming every key that stands in the way
    (for ``auto``: every target's reasons) and the formats that hold any checkpoint."""
    fallback = (
        "Formats that hold this checkpoint exactly: --format fp32 (consolidated fp32 "
        "safetensors with our parameter names, the run config and the tokenizer, which "
        "MoETransformer loads; moe-eval evaluates the checkpoint itself) or --format "
        "deepspeed."
    )
    if arch != "auto":
        problems = hf_problems(cfg, arch, state)
        if not problems:
            return arch
        others = [a for a in hf_support.TARGETS if a != arch and not hf_problems(cfg, a, state)]
        hint = f" (--arch {others[0]} can hold it)" if others else ""
        raise CheckpointError(
            f"{where}: the model cannot be exported as {arch}{hint}:\n"
            + "".join(f"  - {p}\n" for p in problems)
            + fallback
        )
    reasons = {}
    for candidate in hf_support.TARGETS:
        reasons[candidate] = hf_problems(cfg, candidate, state)
        if not reasons[candidate]:
            return candidate
    raise CheckpointError(
        f"{where}: no Hugging Face architecture can hold this model exactly "
        f"(--arch auto tried {', '.join(reasons)}):\n"
        + "".join(f"  {a}:\n" + "".join(f"    - {p}\n" for p in ps) for a, ps in reasons.items())
        + fallback
    )


def _hf_config(cfg: RunConfig, arch: str, tokenizer_ids: dict) -> dict:
    m, moe, r = cfg.model, cfg.model.moe, cfg.model.moe.router
    common = dict(
        vocab_size=m.vocab_size,
        hidden_size=m.d_model,
        num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads,
        num_key_value_heads=m.kv_heads,
        head_dim=m.head_size,
        max_position_embeddings=m.max_seq_len,
        rms_norm_eps=m.norm_eps,
        hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
        tie_word_embeddings=m.tie_embeddings,
        initializer_range=m.init_std,
        attention_dropout=0.0,
        torch_dtype="float32",
        **tokenizer_ids,
    )
    if arch == "llama":
        return dict(
            common,
            model_type="llama",
            architectures=["LlamaForCausalLM"],
            intermediate_size=moe.dense_width,
            attention_bias=False,
            mlp_bias=False,
        )
    common["num_experts_per_tok"] = r.top_k
    if arch == "mixtral":
        return dict(
            common,
            model_type="mixtral",
            architectures=["MixtralForCausalLM"],
            intermediate_size=moe.expert_hidden,
            num_local_experts=moe.num_experts,
            router_jitter_noise=0.0,
            sliding_window=None,
            router_aux_loss_coef=r.aux_loss_coef,
        )
    return dict(
        common,
        model_type="qwen2_moe",
        architectures=["Qwen2MoeForCausalLM"],
        moe_intermediate_size=moe.expert_hidden,
        num_experts=moe.num_experts,
        shared_expert_intermediate_size=moe.num_shared_experts * moe.expert_hidden,
        intermediate_size=moe.dense_width,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(m.n_layers) if not m.is_moe_layer(i)],
        norm_topk_prob=r.order == "topk_then_softmax" or r.renormalize,
        qkv_bias=m.qkv_bias,
        use_sliding_window=False,
        router_aux_loss_coef=r.aux_loss_coef,
    )


class _Tensors:
    """Hands out the consolidated state dict's tensors, each exactly once; :meth:`finish`
    names any tensor the mapping never used, so nothing is dropped without a word."""

    def __init__(self, state: dict[str, torch.Tensor], arch: str):
        self.left, self.arch = dict(state), arch

    def take(self, key: str) -> torch.Tensor:
        if key not in self.left:
            raise CheckpointError(
                f"{self.arch} export: the checkpoint has no tensor {key} (or "
                "the mapping used it twice)"
            )
        return self.left.pop(key)

    def discard(self, key: str) -> None:
        """Consume a tensor that cannot change the exported function (the rule that allows it
        is in hf_support)."""
        self.take(key)

    def finish(self) -> None:
        if self.left:
            raise CheckpointError(
                f"{self.arch} export: tensors of the checkpoint that the "
                f"mapping does not place: {sorted(self.left)}"
            )


def _hf_state(state: dict, cfg: RunConfig, arch: str) -> dict[str, torch.Tensor]:
    """The transformers state dict, placed by the one name table (moe/weights/hf.py)."""
    t = _Tensors(state, arch)
    out = {}
    for link in links(cfg.model, arch):
        if link.op == "fresh":
            t.discard(link.ours)  # the selection bias: zero or unused (hf_support)
            continue
        ours = None if link.ours is None else t.take(link.ours)
        out.update(zip(link.theirs, to_hf(link, ours)))
    t.finish()
    return {k: v.contiguous() for k, v in out.items()}


def _require(package: str, what: str) -> None:
    """A CheckpointError saying how to install ``package`` when it is missing."""
    import importlib.util

    if importlib.util.find_spec(package) is None:
        raise CheckpointError(f"{what} needs {package}: pip install -c constraints.txt {package}")


def hf_model(
    state: dict[str, torch.Tensor], cfg: RunConfig, arch: str, token_ids: dict | None = None
):
    """The transformers model (in memory, fp32) holding a plain model's single-device state
    dict as ``arch``, every tensor placed and shaped as transformers expects."""
    import transformers

    hf_state = _hf_state(state, cfg, arch)
    hf_cfg = transformers.AutoConfig.for_model(**_hf_config(cfg, arch, token_ids or {}))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if cfg.model.tie_embeddings:
        expected.pop("lm_head.weight", None)  # the embedding, tied after loading
    wrong = (
        [f"{k}: not filled" for k in expected if k not in hf_state]
        + [f"{k}: not part of the {arch} model" for k in hf_state if k not in expected]
        + [
            f"{k}: shape {tuple(v.shape)}, {arch} needs {tuple(expected[k])}"
            for k, v in hf_state.items()
            if k in expected and v.shape != expected[k]
        ]
    )
    if wrong:
        raise CheckpointError(
            f"{arch} export does not line up with transformers "
            f"{transformers.__version__}:\n" + "\n".join(f"  - {w}" for w in wrong)
        )
    model.load_state_dict(hf_state, strict=not cfg.model.tie_embeddings, assign=True)
    if cfg.model.tie_embeddings:
        model.tie_weights()
    return model


def export_hf(
    checkpoint: str | Path,
    out_dir: str | Path,
    arch: str = "auto",
    progress: bool = False,
    merge_adapters: bool = False,
) -> Path:
    """Write a transformers model directory; ``arch``: one of ``hf_support.TARGETS`` or auto
    (the first that can hold the model). A model no target holds exactly is refused before
    anything is written, naming every offending config key."""
    _require("transformers", "the Hugging Face export")
    state, cfg, tag_dir = consolidated_fp32(checkpoint, progress, merge_adapters)
    arch = choose_arch(cfg, arch, state, tag_dir / RUN_CONFIG)
    source = tokenizer_source(tag_dir)
    # An imported model's own files (moe-import) are copied as they are, and its config.json's
    # token ids written back; none: no tokenizer.
    if source is not None and source.is_file():
        tokenizer, token_ids = hf_tokenizer(source)
    else:
        marker = json.loads((tag_dir / MARKER).read_text())
        tokenizer, token_ids = None, marker.get("imported_from", {}).get("token_ids", {})
    model = hf_model(state, cfg, arch, token_ids)

    def write(tmp: Path) -> None:
        model.save_pretrained(str(tmp), safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        elif source is not None:
            for f in source.iterdir():
                shutil.copy(f, tmp / f.name)
        _write_run_config(cfg, tag_dir, tmp, merge_adapters)

    return _publish(Path(out_dir), write)
