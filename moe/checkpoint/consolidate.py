"""Reading a checkpoint saved with any expert-parallel layout into single-device tensors.

- :func:`read_consolidated`: the model weights under the single-device model's names (experts
  stacked over all global ids), from DeepSpeed's model-states file and its per-expert files,
  after checking the files and the expert fingerprints.
- :func:`read_layout_free`: the fp32 master weights and Adam moments of every parameter under
  the same names, from the ZeRO stage 1/2 optimizer files of every rank. It uses the per-rank
  fragment map DeepSpeed stores with each partition (``param_slice_mappings``): a parameter's
  fragments, taken in partition order, concatenate to the parameter.

DeepSpeed's naming: MoE layers' non-expert weights carry ``.deepspeed_moe.`` in their keys, and
expert ``e`` of a layer is ``<layer>.deepspeed_moe.experts.deepspeed_experts.<e>.<name>`` in the
file of that (MoE layer, expert).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from moe.checkpoint.files import (
    EXPERT_DIR,
    MAIN_STATES,
    expert_file_ids,
    load_file,
    read_marker,
    verify_files,
)
from moe.checkpoint.fingerprints import fingerprint_problems
from moe.core.errors import CheckpointError

EXPERT_KEY = "deepspeed_experts"
"""DeepSpeed's name for the list of experts inside an MoE layer's state-dict keys."""
_EXPERT_NAMES = ("w_in", "w_out")


def single_device_name(name: str) -> str:
    return name.replace(".deepspeed_moe.", ".")


def consolidated_state_dict(
    main_module_state: dict, expert_states: dict[tuple[int, int], dict], source: str = "checkpoint"
) -> dict:
    """Map a DeepSpeed MoE checkpoint onto the single-device model's keys.

    ``main_module_state`` is the ``module`` entry of ``mp_rank_00_model_states.pt`` (non-expert
    parameters, with ``.deepspeed_moe.`` in MoE layer keys); ``expert_states`` maps
    (moe layer id, global expert id) to that expert file's dict (global ids in its keys). Each
    file must hold exactly its own expert, and each expert must come from exactly one file."""
    out = {}
    for key, value in main_module_state.items():
        out[key.replace(".deepspeed_moe.", ".")] = value
    per_layer: dict[str, dict[int, torch.Tensor]] = {}
    pattern = re.compile(r"^(.*)\.deepspeed_moe\.experts\." + EXPERT_KEY + r"\.(\d+)\.(\w+)$")
    for (layer_id, expert_id), state in sorted(expert_states.items()):
        where = f"{source}: expert file of MoE layer {layer_id}, expert {expert_id}"
        for key, value in state.items():
            m = pattern.match(key)
            if m is None:
                raise ValueError(f"{where}: unexpected key {key!r}")
            prefix, gid, name = m.group(1), int(m.group(2)), m.group(3)
            if gid != expert_id:
                raise ValueError(f"{where}: holds expert {gid} ({key})")
            by_expert = per_layer.setdefault(f"{prefix}.experts.{name}", {})
            if gid in by_expert:
                raise ValueError(f"{where}: {key} is present twice")
            by_expert[gid] = value
    for key, by_expert in per_layer.items():
        ids = sorted(by_expert)
        if ids != list(range(len(ids))):
            raise ValueError(f"{source}: {key}: expert ids {ids} are not 0..{len(ids) - 1}")
        out[key] = torch.stack([by_expert[i] for i in ids])
    return out


def state_files(tag_dir: Path) -> list[Path]:
    """The files :func:`read_consolidated` reads: the main model states, then every expert file."""
    tag_dir = Path(tag_dir)
    experts = sorted(
        f
        for f in [*tag_dir.iterdir(), *(tag_dir / EXPERT_DIR).glob("*")]
        if expert_file_ids(f.name) is not None
    )
    return [tag_dir / MAIN_STATES, *experts]


def read_consolidated(
    tag_dir: Path,
    on_file: Callable[[], None] | None = None,
    marker: dict | None = None,
    master_weights: bool = False,
) -> tuple[dict[str, torch.Tensor], dict]:
    """(single-device state dict, completion marker) of the checkpoint ``tag_dir`` saved with
    any layout, after checking it: complete, no file missing or truncated, every expert of every
    layer present exactly once, and each expert holding the weights its fingerprint recorded (or,
    for a checkpoint without fingerprints, no two experts with identical weights). ``on_file``
    is called after each of :func:`state_files` is read (progress). ``marker``: the one
    :func:`verify_files` returned, when the caller verified already. ``master_weights``: replace
    the parameters by the fp32 master weights of the ZeRO files where the run kept them (a bf16
    run's model states hold the bf16 copies its forward used)."""
    tag_dir = Path(tag_dir)
    if marker is None:
        marker = verify_files(tag_dir)
    main_file, *expert_files = state_files(tag_dir)
    main = load_file(main_file)
    if on_file:
        on_file()
    experts = {}
    for f in expert_files:
        ids = expert_file_ids(f.name)
        if ids is None:
            raise CheckpointError(f"{f}: not an expert file")
        if ids in experts:
            raise CheckpointError(f"{f}: expert {ids[1]} of MoE layer {ids[0]} has two files")
        experts[ids] = load_file(f)
        if on_file:
            on_file()
    try:
        state = consolidated_state_dict(main["module"], experts, str(tag_dir))
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    saved = marker.get("expert_fingerprints")
    problems = []
    for key, value in state.items():
        if key.endswith(tuple(f".experts.{n}" for n in _EXPERT_NAMES)):
            problems += fingerprint_problems(key, value, None if saved is None else saved.get(key))
    if problems:
        raise CheckpointError(
            f"{tag_dir}: experts do not hold the weights saved under their ids:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    if master_weights and find_zero_file(tag_dir, 0) is not None:
        for name, value in read_layout_free(tag_dir, marker)["params"].items():
            if name not in state or state[name].shape != value.shape:
                raise CheckpointError(
                    f"{tag_dir}: the optimizer's copy of {name} does not match the model states"
                )
            state[name] = value
    return state, marker


MOMENTS = ("exp_avg", "exp_avg_sq")


def zero_file(rank: int, bf16: bool = False) -> str:
    """DeepSpeed's name for a rank's ZeRO optimizer file; bf16 runs prefix it with ``bf16_``."""
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def find_zero_file(tag_dir: Path, rank: int) -> Path | None:
    """The ZeRO optimizer file of ``rank`` in ``tag_dir``, whichever precision saved it."""
    for bf16 in (False, True):
        path = Path(tag_dir) / zero_file(rank, bf16)
        if path.is_file():
            return path
    return None


def _load_zero_file(path: Path) -> dict:
    """ZeRO files pickle a few DeepSpeed value types besides tensors; allow exactly those."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
        return load_file(path)


def read_layout_free(tag_dir: Path, marker: dict | None = None) -> dict:
    """{"params": {name: fp32}, "exp_avg": {...}, "exp_avg_sq": {...}, "step": {name: float}}
    under single-device names, from a ZeRO stage 1/2 checkpoint saved with any layout.
    ``marker``: its completion marker, when the caller read it already."""
    tag_dir = Path(tag_dir)
    marker = marker or read_marker(tag_dir)
    if marker is None:
        raise CheckpointError(f"{tag_dir}: incomplete checkpoint (no completion marker)")
    world, ep = marker["world_size"], marker["expert_parallel_size"]
    shapes = {}
    for group in load_file(tag_dir / MAIN_STATES)["param_shapes"]:
        shapes.update(group)
    # (name, owning expert-parallel rank or None) -> [(partition index, rank file, group, fragment)]
    fragments: dict[tuple[str, int | None], list] = defaultdict(list)
    files = {}
    for rank in range(world):
        path = find_zero_file(tag_dir, rank)
        if path is None:
            raise CheckpointError(
                f"{tag_dir / zero_file(rank)}: missing; converting the layout needs the ZeRO optimizer "
                "files of every rank (ZeRO stage 1 or 2)"
            )
        sd = _load_zero_file(path)["optimizer_state_dict"]
        files[rank] = sd
        for g, mapping in enumerate(sd["param_slice_mappings"]):
            is_expert = bool(sd["base_optimizer_state"]["param_groups"][g].get("moe"))
            owner, part = (rank % ep, rank // ep) if is_expert else (None, rank)
            for name, frag in mapping.items():
                fragments[(name, owner)].append((part, rank, g, frag))

    out: dict[str, dict] = {"params": {}, "exp_avg": {}, "exp_avg_sq": {}, "step": {}}
    experts: dict[str, dict[int, dict]] = defaultdict(dict)
    for (name, owner), frags in fragments.items():
        frags.sort(key=lambda f: f[0])
        pieces: dict[str, list] = defaultdict(list)
        step = None
        for _, rank, g, frag in frags:
            sd = files[rank]
            state = sd["base_optimizer_state"]["state"][g]
            sources = {
                "params": sd["single_partition_of_fp32_groups"][g],
                "exp_avg": state["exp_avg"],
                "exp_avg_sq": state["exp_avg_sq"],
            }
            for key, flat in sources.items():
                pieces[key].append(flat.narrow(0, frag.start, frag.numel))
            step = float(state["step"])
        shape = tuple(shapes[name])
        if owner is not None and sum(f[3].numel for f in frags) * ep == torch.Size(shape).numel():
            # The stacked experts' global shape (see report_global_expert_shapes): this owner's
            # fragments hold its E / ep experts.
            shape = (shape[0] // ep, *shape[1:])
        full = {k: torch.cat(v).view(shape) for k, v in pieces.items()}
        if any(t.numel() != torch.Size(shape).numel() for t in full.values()):
            raise CheckpointError(f"{tag_dir}: fragments of {name} do not add up to {shape}")
        if owner is None:
            for key, tensor in full.items():
                out[key][single_device_name(name)] = tensor
            out["step"][single_device_name(name)] = step
        else:
            experts[name][owner] = {**full, "step": step}
    for name, by_owner in experts.items():
        if sorted(by_owner) != list(range(ep)):
            raise CheckpointError(
                f"{tag_dir}: {name}: optimizer state of expert-parallel ranks "
                f"{sorted(by_owner)}, expected 0..{ep - 1}"
            )
        key = single_device_name(name)
        for k in ("params", *MOMENTS):
            out[k][key] = torch.cat([by_owner[r][k] for r in range(ep)])
        out["step"][key] = by_owner[0]["step"]
    return out
