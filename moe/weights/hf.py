"""Hugging Face ``transformers`` weights and our model: which tensor holds which, both ways.

:func:`links` is the one table of names: for a model config and a transformers architecture it
lists, for every tensor of ours, the transformers tensors that hold it and how (copied,
transposed, split in halves, scaled). The Hugging Face export (``moe/tools/export.py``) applies
it forward; :func:`read_hf_model` applies it backward to start from open weights.

Names on the transformers side are those of the model in memory (transformers 5): stacked
experts ``mlp.experts.gate_up_proj`` (E, 2H, D) = [gate; up] and ``mlp.experts.down_proj``
(E, D, H). Checkpoint files on disk usually hold one tensor per expert (Mixtral:
``block_sparse_moe.experts.<e>.w1/w3/w2``; the others ``mlp.experts.<e>.gate_proj/up_proj/
down_proj``), which :class:`SafetensorsDir` stacks on reading; files with the stacked names are
read as they are.

Importing (:func:`read_hf_model`): config.json is turned into our model config
(``moe/weights/hf_config.py``), and anything the model cannot express (sliding-window attention,
RoPE scaling, biases on the output projection, quantized weights, ...) is refused before any
tensor is read, naming every field.
Tensors are then read one at a time with ``safetensors.safe_open`` (each stacked expert tensor
is built from its experts' files and the pieces are dropped at once), so the memory held is our
model plus the largest tensor. A missing shard, a tensor nobody maps, a tensor the model needs
and the files lack, a wrong shape or a dtype we cannot hold is a :class:`CheckpointError` naming
the file and the tensor.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from moe.core.config_schema import from_dict
from moe.core.errors import CheckpointError
from moe.model.transformer import ModelConfig, MoETransformer
from moe.weights.hf_config import hf_model_config

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
"""safetensors dtypes we read (converted to fp32; every one of them is exact in fp32)."""


@dataclass(frozen=True)
class Link:
    """``ours`` (a key of our single-device state dict, or None) is held by ``theirs``:

    - ``copy``: theirs[0] = ours * scale;
    - ``transpose``: theirs[0] = (ours * scale) with its last two dims swapped (stacked experts);
    - ``halves``: theirs = ours split in two along dim 0 (a dense SwiGLU's [gate; up]);
    - ``zeros``: ours is None; theirs[0] is a zero tensor of ``shape`` (a part transformers
      always has and we lack: it adds nothing);
    - ``fresh``: theirs is empty; ours is a buffer that cannot change the function (the router's
      selection bias, zero or unused) and starts at its initial value, zero, on import.
    """

    ours: str | None
    theirs: tuple[str, ...]
    op: Literal["copy", "transpose", "halves", "zeros", "fresh"] = "copy"
    scale: float = 1.0
    shape: tuple[int, ...] = ()


def links(m: ModelConfig, arch: str) -> list[Link]:
    """Every tensor of ours and where ``arch`` (a value of hf_config.ARCHITECTURES) holds it."""
    out = [
        Link("embed.weight", ("model.embed_tokens.weight",)),
        Link("norm.weight", ("model.norm.weight",)),
    ]
    if not m.tie_embeddings:
        out.append(Link("lm_head.weight", ("lm_head.weight",)))
    moe = m.moe
    for i in range(m.n_layers):
        src, dst = f"blocks.{i}.", f"model.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out.append(Link(f"{src}attn.{proj}.weight", (f"{dst}self_attn.{proj}.weight",)))
        if m.qkv_bias:
            out += [
                Link(f"{src}attn.{p}.bias", (f"{dst}self_attn.{p}.bias",))
                for p in ("q_proj", "k_proj", "v_proj")
            ]
        if m.qk_norm != "none":
            out += [
                Link(f"{src}attn.{n}.weight", (f"{dst}self_attn.{n}.weight",))
                for n in ("q_norm", "k_norm")
            ]
        out.append(Link(f"{src}attn_norm.weight", (f"{dst}input_layernorm.weight",)))
        out.append(Link(f"{src}ffn_norm.weight", (f"{dst}post_attention_layernorm.weight",)))
        if not m.is_moe_layer(i):
            out += _dense(f"{src}ffn.", f"{dst}mlp.")
            continue
        out.append(Link(f"{src}ffn.router.weight", (f"{dst}mlp.gate.weight",)))
        out.append(Link(f"{src}ffn.router.score_bias", (), "fresh"))  # zero or unused (hf_support)
        out.append(Link(f"{src}ffn.experts.w_in", (f"{dst}mlp.experts.gate_up_proj",), "transpose"))
        # The routed scaling factor multiplies each expert's output, which is linear in w_out.
        out.append(
            Link(
                f"{src}ffn.experts.w_out",
                (f"{dst}mlp.experts.down_proj",),
                "transpose",
                moe.router.scaling_factor,
            )
        )
        if arch != "qwen2_moe":
            continue
        # Qwen2-MoE always has a shared expert and its sigmoid gate; without our gate a zero
        # gate gives exactly 1/2, so the output projection is held times 2 (exact).
        gated = moe.shared_expert_gate
        if moe.num_shared_experts:
            out += _dense(
                f"{src}ffn.shared_mlp.", f"{dst}mlp.shared_expert.", 1.0 if gated else 2.0
            )
        else:  # width 0: adds 0
            out += [
                Link(None, (f"{dst}mlp.shared_expert.{p}.weight",), "zeros", shape=s)
                for p, s in (
                    ("gate_proj", (0, m.d_model)),
                    ("up_proj", (0, m.d_model)),
                    ("down_proj", (m.d_model, 0)),
                )
            ]
        out.append(
            Link(f"{src}ffn.shared_gate.weight", (f"{dst}mlp.shared_expert_gate.weight",))
            if gated
            else Link(None, (f"{dst}mlp.shared_expert_gate.weight",), "zeros", shape=(1, m.d_model))
        )
    return out


def _dense(src: str, dst: str, scale: float = 1.0) -> list[Link]:
    return [
        Link(f"{src}w_in.weight", (f"{dst}gate_proj.weight", f"{dst}up_proj.weight"), "halves"),
        Link(f"{src}w_out.weight", (f"{dst}down_proj.weight",), "copy", scale),
    ]


def to_hf(link: Link, ours: torch.Tensor | None) -> list[torch.Tensor]:
    """Our tensor as the transformers tensors ``link.theirs``."""
    if link.op == "zeros":
        return [torch.zeros(link.shape)]
    if link.op == "halves":
        return list(ours.chunk(2, dim=0))
    t = ours * link.scale if link.scale != 1.0 else ours
    return [t.transpose(1, 2) if link.op == "transpose" else t]


def from_hf(link: Link, theirs: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of :func:`to_hf` for ``copy``, ``transpose`` and ``halves``."""
    if link.op == "halves":
        return torch.cat(theirs, dim=0)
    t = theirs[0].transpose(1, 2) if link.op == "transpose" else theirs[0]
    return t / link.scale if link.scale != 1.0 else t


# --- config.json -> ModelConfig ------------------------------------------------------------------


# Keys that never change the function a checkpoint computes (bookkeeping, generation defaults,
# outputs requested at call time).
class SafetensorsDir:
    """The tensors of a transformers directory (``model.safetensors`` or shards listed in
    ``model.safetensors.index.json``), read one at a time; each name is read at most once and
    :meth:`unread` lists what nobody asked for."""

    def __init__(self, hf_dir: Path):
        from safetensors import safe_open

        self.dir = hf_dir
        index = hf_dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
            _check_weight_map(weight_map, index)
        elif (hf_dir / "model.safetensors").is_file():
            weight_map = None
        else:
            pickles = sorted(p.name for p in hf_dir.glob("*.bin"))
            raise CheckpointError(
                f"{hf_dir}: no model.safetensors and no model.safetensors.index.json"
                + (
                    f" ({', '.join(pickles)}: pickle files, which are never loaded; "
                    "save the model with safe_serialization=True)"
                    if pickles
                    else ""
                )
            )
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        missing = [f for f in files if not (hf_dir / f).is_file()]
        if missing:
            raise CheckpointError(
                f"{index}: shards listed in the index are missing: "
                + ", ".join(str(hf_dir / f) for f in missing)
            )
        self.handles, self.where = {}, {}
        unlisted = []  # in a shard, but the index places them nowhere or in another shard
        for f in files:
            try:
                handle = safe_open(str(hf_dir / f), framework="pt")
            except Exception as e:  # safetensors raises its own error types for damaged files
                raise CheckpointError(f"{hf_dir / f}: unreadable safetensors file ({e})") from None
            self.handles[f] = handle
            for name in handle.keys():
                if weight_map is None or weight_map.get(name) == f:
                    self.where[name] = f
                else:
                    unlisted.append(
                        f"{hf_dir / f}: {name}: "
                        + (
                            f"the index places it in {weight_map[name]}"
                            if name in weight_map
                            else "not listed in the index"
                        )
                    )
        if weight_map:
            absent = [n for n, f in weight_map.items() if n not in self.where]
            problems = (
                [
                    f"tensors listed in the index are not in their shard: "
                    f"{', '.join(f'{n} ({weight_map[n]})' for n in absent[:5])}"
                ]
                if absent
                else []
            )
            # transformers reads every tensor of the shards the index names, those the index
            # leaves out too (as unexpected): a shard holding more than its index says is
            # refused, as a tensor the model has no place for is.
            problems += unlisted[:10] + (
                [f"... and {len(unlisted) - 10} more"] if len(unlisted) > 10 else []
            )
            if problems:
                raise CheckpointError(
                    f"{index}: the index and its shards disagree:\n"
                    + "".join(f"  - {p}\n" for p in problems)
                )
        self.read: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def file(self, name: str) -> Path:
        return self.dir / self.where[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.handles[self.where[name]].get_slice(name).get_shape())

    def dtype_problem(self, name: str) -> str | None:
        dtype = self.handles[self.where[name]].get_slice(name).get_dtype()
        if dtype not in DTYPES:
            return (
                f"{self.file(name)}: {name}: dtype {dtype}; the importer reads {', '.join(DTYPES)}"
            )
        return None

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor as fp32, read through a mapping of its file opened for this read alone:
        the file's pages leave this process's resident memory with it."""
        from safetensors import safe_open

        self.read.add(name)
        with safe_open(str(self.file(name)), framework="pt") as handle:
            return handle.get_tensor(name).float()

    def unread(self) -> list[str]:
        return sorted(set(self.where) - self.read)


def _check_weight_map(weight_map, index: Path) -> None:
    """A CheckpointError unless the index maps tensor names to plain file names of its own
    directory: a shard named by a path (``../other/model.safetensors``) would be read from
    wherever it points."""
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names")
    outside = sorted({f for f in weight_map.values() if f in ("", ".", "..") or f != Path(f).name})
    if outside:
        raise CheckpointError(
            f"{index}: shards must be files of its own directory, not paths: "
            + ", ".join(map(repr, outside[:5]))
        )


def _disk_sources(
    files: SafetensorsDir, arch: str, name: str, num_experts: int
) -> list[tuple[str, ...]] | None:
    """The file tensors that hold the in-memory tensor ``name``: [(name,)] when the files hold
    it as it is; for stacked experts one tuple per expert ((gate, up) or (down,)); None when
    absent."""
    if name in files:
        return [(name,)]
    block = "block_sparse_moe" if arch == "mixtral" else "mlp"
    if name.endswith(".mlp.gate.weight"):
        alt = name.replace(".mlp.", f".{block}.")
        return [(alt,)] if alt in files else None
    for stacked, parts in (
        (".mlp.experts.gate_up_proj", ("gate_proj", "up_proj")),
        (".mlp.experts.down_proj", ("down_proj",)),
    ):
        if name.endswith(stacked):
            prefix = name[: -len(stacked)] + f".{block}.experts."
            if arch == "mixtral":
                parts = tuple(
                    {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[p] for p in parts
                )
            return [tuple(f"{prefix}{e}.{p}.weight" for p in parts) for e in range(num_experts)]
    return None


def tokenizer_record(hf_dir: Path) -> dict | None:
    """{"file", "sha256"} of a transformers directory's tokenizer (tokenizer.json first, else
    tokenizer.model), or None."""
    for name in ("tokenizer.json", "tokenizer.model"):
        if (hf_dir / name).is_file():
            return {
                "file": name,
                "sha256": hashlib.sha256((hf_dir / name).read_bytes()).hexdigest(),
            }
    return None


def read_hf_config(hf_dir: str | Path) -> tuple[str, ModelConfig]:
    """The model type and our model config of a transformers directory (config.json only)."""
    hf_dir = Path(hf_dir)
    path = hf_dir / "config.json"
    if not hf_dir.is_dir():
        raise CheckpointError(
            f"{hf_dir}: {'not a directory' if hf_dir.exists() else 'does not exist'}; "
            "give the transformers model directory (config.json and safetensors weights)"
        )
    try:
        hf = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; a transformers model directory has one") from None
    except OSError as e:  # a directory, or no permission to read it
        raise CheckpointError(f"{path}: cannot be read ({e.strerror})") from None
    except ValueError as e:
        raise CheckpointError(f"{path}: not JSON ({e})") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    arch, model = hf_model_config(hf, str(path))
    return arch, from_dict(ModelConfig, model, str(path))


def read_hf_model(hf_dir: str | Path) -> tuple[str, ModelConfig, dict[str, torch.Tensor]]:
    """(model type, model config, our single-device fp32 state dict) of a transformers
    directory, every tensor placed and checked (module docstring)."""
    hf_dir = Path(hf_dir)
    arch, cfg = read_hf_config(hf_dir)
    files = SafetensorsDir(hf_dir)
    with torch.device("meta"):
        meta = MoETransformer(cfg).state_dict()
    table = links(cfg, arch)
    plan, problems = [], []
    for link in table:  # every name, dtype and shape, before reading any tensor
        if link.op == "fresh":
            plan.append((link, []))
            continue
        with torch.device("meta"):
            wanted = [tuple(t.shape) for t in to_hf(link, meta.get(link.ours))]
        sources = []
        for name, want in zip(link.theirs, wanted):
            found = _disk_sources(files, arch, name, cfg.moe.num_experts)
            missing = [n for group in found or [(name,)] for n in group if n not in files]
            if missing:
                problems += [f"{n}: missing (needed for {link.ours or name})" for n in missing[:3]]
                continue
            for group in found:
                # Per expert: the stacked tensor's rows split evenly over its parts.
                part = (
                    tuple(want)
                    if len(found) == 1 and len(group) == 1
                    else (want[1] // len(group), *want[2:])
                )
                for n in group:
                    if files.shape(n) != part:
                        problems.append(
                            f"{files.file(n)}: {n}: shape {files.shape(n)}, "
                            f"config.json describes {part}"
                        )
                    elif p := files.dtype_problem(n):
                        problems.append(p)
            sources.append(found)
        plan.append((link, sources))
    named = {n for _, sources in plan for found in sources for group in found for n in group}
    problems += [
        f"{files.file(n)}: {n}: no tensor of the model corresponds to it"
        for n in sorted(set(files.where) - named)
    ]
    if problems:
        raise CheckpointError(
            f"{hf_dir}: the weights do not fit the {arch} model its config.json "
            "describes:\n" + "".join(f"  - {p}\n" for p in problems)
        )
    state = {}
    for link, sources in plan:
        theirs = [_assemble(files, found) for found in sources]
        if link.op == "fresh":
            state[link.ours] = torch.zeros(meta[link.ours].shape)  # its initial value
        elif link.op != "zeros":  # zeros: a part that adds nothing, read for its checks only
            state[link.ours] = from_hf(link, theirs).contiguous()
    if cfg.tie_embeddings:  # one matrix under both names, as in our model's state dict
        state["lm_head.weight"] = state["embed.weight"]
    return arch, cfg, state


def refuse_nonfinite(
    tensors: dict[str, torch.Tensor], hf_dir: str | Path, arch: str, cfg: ModelConfig
) -> None:
    """CheckpointError when one of ``tensors`` (keys of our state dict, as read_hf_model gives
    them) holds NaN or infinite values (a diverged run's weights, a damaged file), naming the
    transformers tensors it was read from and the count. Callers run it where the values are
    touched anyway (fp32 tensors stay backed by the files' pages until then, see read_hf_model):
    moe-import just before it writes each group, ``model.init_from: hf:DIR`` before loading."""
    for key, t in tensors.items():
        # The sum is finite when every value is (one pass, no tensor-sized mask); only a
        # suspicious one is counted exactly (a sum of large finite values can overflow).
        if torch.isfinite(t.sum()):
            continue
        bad = int(t.numel() - torch.isfinite(t).sum())
        if bad:
            theirs = next((link.theirs for link in links(cfg, arch) if link.ours == key), ())
            raise CheckpointError(
                f"{hf_dir}: {', '.join(theirs) or key} ({key} in our model): "
                f"{bad:,} of {t.numel():,} values are NaN or infinite; these "
                "weights cannot be used"
            )


def read_hf_tensors(
    hf_dir: str | Path, names: list[str], arch: str, num_experts: int
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The transformers tensors ``names`` (in-memory names: stacked experts) as fp32, each that
    the directory holds whole (files of one tensor per expert are stacked), and the names of the
    directory's tensors none of them used."""
    files = SafetensorsDir(Path(hf_dir))
    out = {}
    for name in names:
        found = _disk_sources(files, arch, name, num_experts)
        if not found or any(n not in files for group in found for n in group):
            continue
        # Every expert's files shaped alike (else they do not stack: not this tensor).
        if len({tuple(files.shape(n) for n in group) for group in found}) == 1:
            out[name] = _assemble(files, found)
    return out, files.unread()


def _assemble(files: SafetensorsDir, found: list[tuple[str, ...]]) -> torch.Tensor:
    """One in-memory tensor from its file tensors: as it is, or stacked over experts with each
    expert's (gate, up) concatenated."""
    if len(found) == 1 and len(found[0]) == 1:
        return files.tensor(found[0][0])
    first = [files.shape(n) for n in found[0]]
    rows = sum(shape[0] for shape in first)
    out = torch.empty((len(found), rows, *first[0][1:]))  # filled in place: no second copy
    for e, group in enumerate(found):
        start = 0
        for n in group:
            t = files.tensor(n)
            out[e, start : start + t.shape[0]] = t
            start += t.shape[0]
    return out
