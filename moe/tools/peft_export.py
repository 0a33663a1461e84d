"""``moe-export --format peft``: a LoRA fine-tune's factors as an adapter the ``peft`` library
loads (``PeftModel.from_pretrained``) onto the Hugging Face export of the run's base model.

The adapter goes onto ``--base-hf DIR``: the ``--format hf`` export of ``model.init_from`` (or,
for an ``hf:`` base, the directory it names). DIR must hold exactly the tensors the Hugging Face
export of the fine-tune's frozen base weights holds, so an adapter is never written for another
base; the architecture (Mixtral, Qwen2-MoE or Llama) is the directory's config.json's.

Layout (peft 0.21; every base tensor is placed by the export's name table, moe/weights/hf.py):

- ``target_modules`` (LoRA on an ``nn.Linear``): attention ``q/k/v/o_proj``, dense FFN and
  shared-expert ``gate_proj`` / ``up_proj`` / ``down_proj``. Our ``lora_A`` (r, in) and
  ``lora_B`` (out, r) are PEFT's own layout. Our fused SwiGLU input ``w_in`` = [gate; up] is two
  modules there: both get our A, each its half of B (B's rows split like the weight's).
- ``target_parameters`` (LoRA on an ``nn.Parameter``, peft's ``ParamWrapper``): the routed
  experts' fused ``mlp.experts.gate_up_proj`` (E, 2H, D) and ``down_proj`` (E, D, H), and the
  router ``mlp.gate.weight`` (E, D), which transformers holds as bare parameters. For a 3D
  parameter (E, out, in) peft keeps ``lora_A`` (E*r, in), expert-major, and ``lora_B``
  (out, r*E), expert-minor: delta[e] = B.view(out, r, E)[:, :, e] @ A.view(E, r, in)[e]. Ours
  are A (E, in, r) and B (E, r, out) with delta[e] = (A[e] B[e])^T in their layout, hence
  A.transpose(1, 2).reshape(E*r, in) and B.permute(2, 1, 0).reshape(out, r*E); the [gate | up]
  order of our w_in is the order of gate_up_proj's rows after the transpose.
- A base weight the export scales (the routed scaling factor on down_proj, 2 on an ungated
  Qwen2-MoE shared expert's down_proj) scales B alike, so the update scales with its weight.
- Scaling alpha / r per module (``rank_pattern`` gives the routed experts their own rank with
  ``expert_rank: per_top_k``). ``lora_dropout`` is ours, but 0 when parameters are targeted:
  peft has no dropout for them, and dropout acts in training only.
- Routers trained in full (``finetune.lora.train_router``) are saved whole, as peft saves a
  module of ``modules_to_save`` (``mlp.gate``), with their LoRA update (if targeted) folded in.

Refused before anything is written, naming the key: a run that is not a LoRA fine-tune
(``finetune.method``), no ``--base-hf``, a directory that is not this run's base.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import torch

from data_pipeline.progress import Progress
from moe.checkpoint.consolidate import state_files
from moe.checkpoint.files import RUN_CONFIG, resolve_checkpoint
from moe.config.run import RunConfig, load_config
from moe.core.errors import CheckpointError, ConfigError
from moe.model.adapters.lora import is_factor
from moe.tools import hf_support
from moe.tools.export import _publish, adapter_metadata
from moe.training.upcycle import HF_PREFIX
from moe.weights.hf import links, read_hf_config, read_hf_tensors, to_hf
from moe.weights.load import load_consolidated

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
"""Where PeftModel puts the transformers model, in the adapter's tensor names."""
_NESTED = {"gate_up_proj": ".base_layer", "down_proj": ""}
"""peft wraps each targeted parameter of a module around the wrappers of those before it, in the
order the module declares them: gate_up_proj's factors sit one ``base_layer`` deeper."""


def peft_problems(cfg: RunConfig) -> list[str]:
    """The run config keys that keep a checkpoint from exporting as a PEFT adapter."""
    ft = cfg.finetune
    if ft.method != "lora":
        return [
            f"finetune.method: {ft.method}: only LoRA fine-tunes (lora) export as a PEFT "
            "adapter; --format fp32 or hf exports the whole model"
        ]
    return []


def _rank_of(a: torch.Tensor) -> int:
    return a.shape[-1] if a.ndim == 3 else a.shape[0]  # stacked (E, in, r), else (r, in)


def peft_adapter(
    state: dict[str, torch.Tensor], cfg: RunConfig, arch: str
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json's fields, adapter tensors by peft's names) of a LoRA fine-tune's
    single-device state dict, for the transformers model ``arch`` of its base."""
    lora = cfg.finetune.lora
    table = {link.ours: link for link in links(cfg.model, arch)}
    tensors, modules, params, ranks = {}, set(), set(), {}
    for key in sorted(k for k in state if is_factor(k) and k.endswith("lora_A")):
        stem = key[: -len("lora_A")]
        # Stacked experts: <experts>.w_in_lora_A for <experts>.w_in; else <m>.lora_A for <m>.weight
        weight = stem[:-1] if stem.endswith("_") else stem + "weight"
        if lora.train_router and _is_router(weight):
            continue  # folded into the whole router below
        a, b = state[key].float(), state[stem + "lora_B"].float()
        link = table[weight]
        b = b * link.scale
        r = _rank_of(a)
        for theirs, pair in zip(link.theirs, _factors(a, b, link.op)):
            module, param = theirs.rsplit(".", 1)
            if link.op == "transpose" or _is_router(weight):
                site, where = f"{module}.{param}", f"{module}{_NESTED.get(param, '')}"
                params.add(_suffix(site))
            else:
                site = where = module
                modules.add(_suffix(site))
            for name, t in zip(("lora_A", "lora_B"), pair):
                # A copy each: safetensors refuses tensors that share memory (gate and up).
                tensors[f"{_PREFIX}{where}.{name}.weight"] = t.contiguous().clone()
            ranks.setdefault(_suffix(site), r)
            assert ranks[_suffix(site)] == r, site  # rank_pattern goes by name suffix
    saved = _whole_routers(state, table.values(), lora.alpha, tensors) if lora.train_router else []
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "target_modules": sorted(modules) or None,
        "target_parameters": sorted(params) or None,
        "rank_pattern": {s: r for s, r in sorted(ranks.items()) if r != lora.rank},
        "alpha_pattern": {},
        "lora_dropout": 0.0 if params else lora.dropout,
        "use_rslora": False,
        "use_dora": False,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": sorted(saved) or None,
    }
    return config, tensors


def _is_router(weight: str) -> bool:
    return weight.endswith("router.weight")


def _whole_routers(
    state: dict[str, torch.Tensor], table, alpha: float, tensors: dict[str, torch.Tensor]
) -> set[str]:
    """Put each router (trained in full: ``train_router``) into ``tensors`` whole, with its LoRA
    update folded in, as peft saves a module of ``modules_to_save``; their module suffixes."""
    saved = set()
    for link in table:
        if link.ours is None or not _is_router(link.ours):
            continue
        w = state[link.ours].float()
        stem = link.ours[: -len("weight")]
        if stem + "lora_A" in state:  # W + (alpha / r) B A, in the weight's (E, D) layout
            a, b = state[stem + "lora_A"].float(), state[stem + "lora_B"].float()
            w = w + alpha / a.shape[0] * (b @ a)
        tensors[_PREFIX + link.theirs[0]] = (w * link.scale).contiguous()
        saved.add(_suffix(link.theirs[0].rsplit(".", 1)[0]))
    return saved


def _factors(a: torch.Tensor, b: torch.Tensor, op: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """peft's (lora_A, lora_B) for each transformers tensor of a link (see the module doc)."""
    if op == "transpose":  # a (E, in, r), b (E, r, out)
        experts, _, r = a.shape
        return [
            (
                a.transpose(1, 2).reshape(experts * r, -1),
                b.permute(2, 1, 0).reshape(b.shape[2], r * experts),
            )
        ]
    if op == "halves":  # [gate; up] rows of the weight are B's rows
        return [(a, half) for half in b.chunk(2, dim=0)]
    return [(a, b)]


def _suffix(name: str) -> str:
    """A layer's module or parameter name without ``model.layers.<i>.``: peft matches targets
    by name suffix, and every layer of a kind is adapted alike."""
    return re.sub(r"^model\.layers\.\d+\.", "", name)


def check_base(base_hf: Path, state: dict, cfg: RunConfig, where: Path) -> str:
    """The architecture of ``base_hf``, after checking that it holds exactly what the
    Hugging Face export of the fine-tune's base weights holds (CheckpointError naming --base-hf
    otherwise)."""
    try:
        arch, _ = read_hf_config(base_hf)
    except (CheckpointError, ConfigError) as e:
        raise CheckpointError(f"--base-hf {base_hf}: not a model the importer reads: {e}") from None
    if arch not in hf_support.TARGETS:
        raise CheckpointError(
            f"--base-hf {base_hf}: a {arch} model; the PEFT export goes onto "
            f"{', '.join(hf_support.TARGETS)} exports"
        )
    problems = hf_support.problems(cfg.model, arch, state)
    if problems:
        raise CheckpointError(
            f"--base-hf {base_hf}: this run's model is not a {arch} model:\n"
            + "".join(f"  - {p}\n" for p in problems)
        )
    table = [link for link in links(cfg.model, arch) if link.op != "fresh"]
    theirs, extra = read_hf_tensors(
        base_hf, [n for link in table for n in link.theirs], arch, cfg.model.moe.num_experts
    )
    if cfg.finetune.lora.train_router:  # the run's own routers replace the base's
        table = [link for link in table if not (link.ours and _is_router(link.ours))]
    differ = []
    for link in table:
        ours = None if link.ours is None else state[link.ours]
        want = to_hf(link, None if ours is None else ours.float())
        if not all(_same(theirs.get(name), w, ours) for name, w in zip(link.theirs, want)):
            differ.append(link.ours or link.theirs[0])
    if differ or extra:
        init_from = cfg.model.init_from
        fix = base_hint(init_from)
        found = []
        if differ:
            found.append(f"{len(differ)} of {len(table)} weights differ ({', '.join(differ[:3])})")
        if extra:
            found.append(f"it has tensors the base lacks ({', '.join(extra[:3])})")
        raise CheckpointError(
            f"--base-hf {base_hf}: not the base model the adapters of {where} "
            f"were trained on (model.init_from: {init_from}): "
            f"{'; '.join(found)}; {fix}"
        )
    return arch


def base_hint(init_from: str) -> str:
    """Which directory --base-hf takes for a run whose ``model.init_from`` is ``init_from``: the
    Hugging Face directory itself (``hf:DIR``), else the --format hf export of the checkpoint."""
    if init_from.startswith(HF_PREFIX):
        where = init_from[len(HF_PREFIX) :]
        return (
            f"this run's base (model.init_from: {init_from}) is that directory: "
            f"--base-hf {shlex.quote(where)}"
        )
    return (
        f"the --format hf export of this run's base (model.init_from: {init_from}); export "
        f"it with: moe-export {shlex.quote(init_from)} DIR --format hf, then pass "
        "--base-hf DIR"
    )


def _same(theirs: torch.Tensor | None, want: torch.Tensor, ours: torch.Tensor | None) -> bool:
    """Equal up to the rounding of the precision the run held its frozen base in (a bf16 run
    rounds it) and of the export's scalings."""
    rtol = 1e-6 if ours is None or ours.dtype == torch.float32 else torch.finfo(ours.dtype).eps
    return (
        theirs is not None
        and theirs.shape == want.shape
        and torch.allclose(theirs, want, rtol=rtol, atol=1e-30)
    )


def export_peft(
    checkpoint: str | Path, out_dir: str | Path, base_hf: str | Path | None, progress: bool = False
) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` for ``base_hf`` (module
    doc); anything PEFT cannot hold exactly is refused before anything is written."""
    from safetensors.torch import save_file

    tag_dir = resolve_checkpoint(checkpoint)
    cfg = load_config(tag_dir / RUN_CONFIG)
    problems = peft_problems(cfg)
    if problems:
        raise CheckpointError(
            f"{tag_dir / RUN_CONFIG}: cannot export as a PEFT adapter:\n"
            + "".join(f"  - {p}\n" for p in problems)
        )
    if base_hf is None:
        raise CheckpointError(
            "--format peft needs --base-hf DIR, the Hugging Face model the "
            f"adapter goes onto: {base_hint(cfg.model.init_from)}"
        )
    bar = Progress(f"export: read {tag_dir}", len(state_files(tag_dir)), progress, unit="files")
    state, cfg, tag_dir = load_consolidated(tag_dir, on_file=lambda: bar.update(1))
    bar.close()
    base_hf = Path(base_hf).resolve()
    arch = check_base(base_hf, state, cfg, tag_dir)
    config, tensors = peft_adapter(state, cfg, arch)
    config["base_model_name_or_path"] = str(base_hf)
    metadata = adapter_metadata(state, cfg, tag_dir)

    def write(tmp: Path) -> None:
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata=metadata)

    return _publish(Path(out_dir), write)
