"""Resuming on another parallel layout (world size, expert-parallel size).

DeepSpeed's ZeRO files hold each rank's flat partition of every optimizer group, and its MoE
files hold experts by global id; neither can be loaded into an engine whose data-parallel or
expert-parallel size differs. This module goes through a layout-free form instead:

- :func:`read_layout_free` rebuilds, from the files of any ZeRO stage 1/2 checkpoint, the full
  fp32 master weight and Adam moments (``exp_avg``, ``exp_avg_sq``) and step of every parameter
  under its single-device name (experts stacked over all global ids). It uses the per-rank
  fragment map DeepSpeed stores with each partition (``param_slice_mappings``): a parameter's
  fragments, taken in partition order, concatenate to the parameter.
- :func:`load_other_layout` writes that state into a freshly built engine: the model weights
  (this rank's experts), this rank's fragment of every fp32 master partition and of the Adam
  moments, the LR schedule and step counters, and the buffers (the router's ``score_bias``).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

from moe.errors import CheckpointError
from moe.training.checkpoint import MAIN_STATES, load_file, read_marker

MOMENTS = ("exp_avg", "exp_avg_sq")


def zero_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _load_zero_file(path: Path) -> dict:
    """ZeRO files pickle a few DeepSpeed value types besides tensors; allow exactly those."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
        return load_file(path)


def single_device_name(name: str) -> str:
    return name.replace(".deepspeed_moe.", ".")


def read_layout_free(tag_dir: Path) -> dict:
    """{"params": {name: fp32}, "exp_avg": {...}, "exp_avg_sq": {...}, "step": {name: float}}
    under single-device names, from a ZeRO stage 1/2 checkpoint saved with any layout."""
    tag_dir = Path(tag_dir)
    marker = read_marker(tag_dir)
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
        path = tag_dir / zero_file(rank)
        if not path.is_file():
            raise CheckpointError(f"{path}: missing; converting the layout needs the ZeRO optimizer "
                                  "files of every rank (ZeRO stage 1 or 2)")
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
            sources = {"params": sd["single_partition_of_fp32_groups"][g],
                       "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
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
            raise CheckpointError(f"{tag_dir}: {name}: optimizer state of expert-parallel ranks "
                                  f"{sorted(by_owner)}, expected 0..{ep - 1}")
        key = single_device_name(name)
        for k in ("params", *MOMENTS):
            out[k][key] = torch.cat([by_owner[r][k] for r in range(ep)])
        out["step"][key] = by_owner[0]["step"]
    return out


@torch.no_grad()
def load_other_layout(engine, model, tag_dir: Path) -> dict:
    """Load a checkpoint saved with another layout into ``engine``. Returns the client state."""
    from moe.parallel.deepspeed_adapter import DeepSpeedMoE

    tag_dir = Path(tag_dir)
    opt = engine.optimizer
    if not hasattr(opt, "single_partition_of_fp32_groups"):
        raise CheckpointError(f"{tag_dir}: resuming on another layout needs ZeRO stage 1 or 2 "
                              "(parallel.zero_stage)")
    state = read_layout_free(tag_dir)
    main = load_file(tag_dir / MAIN_STATES)

    # Which slice of the stacked experts this rank holds, per parameter.
    expert_slice = {}
    for mname, module in model.named_modules():
        if isinstance(module, DeepSpeedMoE):
            lo = module.ep_rank * module.num_local_experts
            for pname, _ in module.named_parameters():
                if ".experts." in f".{pname}":
                    expert_slice[f"{mname}.{pname}"] = slice(lo, lo + module.num_local_experts)
    names = {id(p): n for n, p in model.named_parameters()}

    def local(key: str, name: str) -> torch.Tensor:
        full = state[key].get(single_device_name(name))
        if full is None:
            raise CheckpointError(f"{tag_dir}: no saved {key} for parameter "
                                  f"{single_device_name(name)}")
        return full[expert_slice[name]] if name in expert_slice else full

    base = opt.optimizer
    for g, params in enumerate(opt.bit16_groups):
        hp = opt.single_partition_of_fp32_groups[g]
        moments = {k: torch.zeros_like(hp) for k in MOMENTS}
        step = None
        for p in params:
            name = names[id(p)]
            value = local("params", name)
            if value.shape != p.shape:
                raise CheckpointError(f"{tag_dir}: {single_device_name(name)} has shape "
                                      f"{tuple(value.shape)}, the model {tuple(p.shape)}")
            p.data.copy_(value)
            step = state["step"][single_device_name(name)]
            m = getattr(p, "_hp_mapping", None)
            if m is None:  # no fragment of this parameter in this rank's partition
                continue
            lp, hp_addr = m.lp_fragment_address, m.hp_fragment_address
            for key, target in (("params", hp), *((k, moments[k]) for k in MOMENTS)):
                src = local(key, name).reshape(-1).narrow(0, lp.start, lp.numel)
                target.narrow(0, hp_addr.start, hp_addr.numel).copy_(src)
        if step is not None:
            base.state[hp] = {"step": torch.tensor(step), **moments}

    saved_module = main["module"]
    for name, buf in model.named_buffers():
        if name in saved_module:
            buf.copy_(saved_module[name])
    if engine.lr_scheduler is not None and main.get("lr_scheduler"):
        engine.lr_scheduler.load_state_dict(main["lr_scheduler"])
        for group, lr in zip(base.param_groups, engine.lr_scheduler.get_last_lr()):
            group["lr"] = lr
    engine.global_steps = main["global_steps"]
    engine.global_samples = main.get("global_samples", 0)
    engine.skipped_steps = main.get("skipped_steps", 0)
    return {k: main[k] for k in ("step", "tokens", "data") if k in main}
