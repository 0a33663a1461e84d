"""Resuming on another parallel layout (world size, expert-parallel size).

DeepSpeed's ZeRO files hold each rank's flat partition of every optimizer group, and its MoE
files hold experts by global id; neither can be loaded into an engine whose data-parallel or
expert-parallel size differs. This module goes through a layout-free form instead:

- :func:`~moe.checkpoint.consolidate.read_layout_free` rebuilds, from the files of any ZeRO
  stage 1/2 checkpoint, the full fp32 master weight and Adam moments (``exp_avg``,
  ``exp_avg_sq``) and step of every parameter under its single-device name (experts stacked
  over all global ids);
- :func:`load_other_layout` writes that state into a freshly built engine: the model weights
  (this rank's experts), this rank's fragment of every fp32 master partition and of the Adam
  moments, the LR schedule and step counters, and the buffers (the router's ``score_bias``),
  and returns the client state whole: every registered part's state under its name
  (moe/training/checkpoint.py), whatever parts the run registered.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moe.checkpoint.consolidate import MOMENTS, read_layout_free, single_device_name
from moe.checkpoint.files import MAIN_STATES, load_file
from moe.core.errors import CheckpointError


@torch.no_grad()
def load_other_layout(engine, model, tag_dir: Path) -> dict:
    """Load a checkpoint saved with another layout into ``engine``. Returns the client state:
    the model-states file's entries but the module weights, as DeepSpeed's own load returns
    them on the saving layout."""
    from moe.parallel.deepspeed_adapter import DeepSpeedMoE

    tag_dir = Path(tag_dir)
    opt = engine.optimizer
    # ZeRO 1/2's optimizer, or DeepSpeed's BF16_Optimizer (bf16 at ZeRO stage 1 with fp32
    # gradient accumulation): both keep this rank's fp32 partition of each group.
    lp_groups = getattr(opt, "bit16_groups", None) or getattr(opt, "bf16_groups", None)
    hp_groups = getattr(opt, "single_partition_of_fp32_groups", None) or getattr(
        opt, "fp32_groups_flat_partition", None
    )
    if lp_groups is None or hp_groups is None:
        raise CheckpointError(
            f"{tag_dir}: resuming on another layout needs ZeRO stage 1 or 2 (parallel.zero_stage)"
        )
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
            raise CheckpointError(
                f"{tag_dir}: no saved {key} for parameter {single_device_name(name)}"
            )
        return full[expert_slice[name]] if name in expert_slice else full

    base = opt.optimizer
    for g, params in enumerate(lp_groups):
        hp = hp_groups[g]
        moments = {k: torch.zeros_like(hp) for k in MOMENTS}
        step = None
        for p in params:
            name = names[id(p)]
            value = local("params", name)
            if value.shape != p.shape:
                raise CheckpointError(
                    f"{tag_dir}: {single_device_name(name)} has shape "
                    f"{tuple(value.shape)}, the model {tuple(p.shape)}"
                )
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

    saved_module = main.pop("module")
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
    return main
