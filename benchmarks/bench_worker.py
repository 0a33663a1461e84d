"""The worker of the settings matrix (benchmarks/gpu_speed_matrix.py), started as
``gpu_train_bench.py --serve``: it keeps one process (CUDA context, imports, dynamo's compiled
code) across runs, and runs one task per line of stdin:

    {"id": 3, "model": "moe-125m", "overrides": ["train.compile=true"], "needs": ["cuda"],
     "where": [[["model.moe.permute=gather"], ["moe"]]], "steps": 10, "warmup": 3,
     "profile_steps": 0, "sync_steps": 0, "label": "compile", "check": false}

and answers each with one line on the original stdout (library output goes to stderr):
``{"id": 3, "status": "ok" | "skipped" | "error", "reason": ..., "row": {...},
"profile": {...} | null, "wall_s": ...}``. ``check: true`` only says whether the run applies
(its needs, whether moe-plan fits it in the device's memory) without building anything.
``where`` (optional): overrides applied only on a model that meets their needs (a combination
of levers, some of them for MoE models only); the row's ``applied`` lists them.
The first line it writes is ``{"hello": {device, torch, peak_flops, memory}}``.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from argparse import Namespace

import torch
from bench_steps import split_knobs, with_finetune
from gpu_train_bench import bench, device_name, planned_bytes, preset, tiny_models

from moe.core.errors import ConfigError
from moe.model.attention import FLEX_AVAILABLE
from moe.model.loss import liger_problem
from moe.training.device import peak_bf16_flops

FIT_FRACTION = 0.95
"""A run whose planned memory (moe-plan's total) exceeds this share of the device is skipped."""


DEVICE_NEEDS = ("cuda", "flex", "liger")
"""Preconditions on the machine alone, checked before the config is built (a config with
``model.cross_entropy=liger`` is refused where Liger-Kernel is missing)."""


def unmet(needs: list[str], cfg, device: torch.device) -> list[str]:
    """The preconditions of a lever that this device (and model, unless ``cfg`` is None) do
    not meet."""
    have = {
        "cuda": device.type == "cuda",
        "flex": FLEX_AVAILABLE and device.type == "cuda",  # flex has no backward on the CPU
        "liger": liger_problem() is None,
    }
    if cfg is not None:
        have.update(
            {
                "moe": cfg.model.ffn == "moe",
                "bf16": cfg.train.precision == "bf16",
                "unaligned-experts": cfg.model.ffn == "moe"
                and cfg.model.moe.expert_hidden % 64 != 0,
            }
        )
    known = (*DEVICE_NEEDS, "moe", "bf16", "unaligned-experts")
    unknown = [n for n in needs if n not in known]
    if unknown:
        raise ConfigError([f"needs: unknown precondition(s) {unknown} (known: {sorted(known)})"])
    return [n for n in needs if n in have and not have[n]]


def same_run(a, b, device: torch.device) -> bool:
    """Whether two (config, knobs) pairs train the same on ``device``: equal once the settings
    they leave to the device are resolved for it, the MoE section ignored on a model without
    MoE layers (its permutation does nothing there)."""

    def resolved(cfg, knobs):
        # With the fine-tuning method a knob asks for: its device settings differ (adapter
        # methods keep eager blocks on CUDA).
        cfg = with_finetune(cfg, knobs).for_device(device.type)
        if not any(map(cfg.model.is_moe_layer, range(cfg.model.n_layers))):
            cfg.model.moe = type(cfg.model.moe)()
        return cfg

    return a[1] == b[1] and resolved(*a) == resolved(*b)


def config_for(task: dict, tiny: bool, micro_batch: int | None):
    overrides, knobs = split_knobs(list(task.get("overrides", [])))
    if tiny:
        models = dict(tiny_models(overrides))
        if task["model"] not in models:
            raise ConfigError([f"model: {task['model']!r} is not a tiny model ({sorted(models)})"])
        return models[task["model"]], knobs
    return preset(task["model"], micro_batch, overrides), knobs


def run_task(task: dict, device: torch.device, args) -> dict:
    needs = list(task.get("needs", []))
    missing = unmet(needs, None, device)
    if not missing:
        # The model's needs are the model's as it is, before the setting changes it: the lever
        # that makes unaligned experts aligned needs them unaligned, and one that needs bf16 is
        # skipped on an fp32 model rather than refused by config validation.
        model, _ = config_for({**task, "overrides": []}, args.tiny, args.micro_batch)
        missing = unmet(needs, model, device)
    if missing:
        return {"status": "skipped", "reason": "needs " + ", ".join(missing)}
    applied = [
        o
        for overrides, part_needs in task.get("where", [])
        if not unmet(list(part_needs), model, device)
        for o in overrides
    ]
    task = {**task, "overrides": [*task.get("overrides", []), *applied]}
    cfg, knobs = config_for(task, args.tiny, args.micro_batch)
    if task.get("label", "default") != "default" and same_run(
        (cfg, knobs), config_for({**task, "overrides": []}, args.tiny, args.micro_batch), device
    ):
        return {"status": "skipped", "reason": f"already the default on {device.type}"}
    label = task.get("label", "")
    if label.endswith("+compile"):
        # Where compiled blocks are the device's default (CUDA), a lever's compiled variant
        # trains as the lever alone does: measured once, not twice.
        plain = [o for o in task["overrides"] if o.replace(" ", "") != "train.compile=true"]
        if same_run(
            (cfg, knobs),
            config_for({**task, "overrides": plain}, args.tiny, args.micro_batch),
            device,
        ):
            return {
                "status": "skipped",
                "reason": f"the same run as {label.removesuffix('+compile')} on {device.type}",
            }
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        if planned_bytes(cfg) > FIT_FRACTION * total:
            return {
                "status": "skipped",
                "reason": f"moe-plan: {planned_bytes(cfg) / 2**30:.1f} GiB of {total / 2**30:.0f}",
            }
    if task.get("check"):
        return {"status": "ok"}
    run_args = Namespace(
        steps=task.get("steps", args.steps),
        warmup=task.get("warmup", args.warmup),
        profile_steps=task.get("profile_steps", 0),
        sync_steps=task.get("sync_steps", 0),
        peak_flops=args.peak_flops,
    )
    try:
        row, entry = bench(task["model"], cfg, device, run_args, knobs, task.get("label", ""))
    finally:
        if cfg.train.cuda_graphs:
            release_cuda_graphs()
    return {"status": "ok", "row": {**row, "applied": applied}, "profile": entry}


def release_cuda_graphs() -> None:
    """A run with train.cuda_graphs leaves its recorded graphs, and the memory pool they hold,
    in this worker; the next run (another setting, or this one's next round, whose new model
    records again) starts without them. Dynamo's compiled code goes with them: the code compiled
    for graphs calls into the graph trees it was made with, and after those are shut down it
    fails ("Running CUDAGraph after shutdown", seen on an H200 with torch 2.11), so the trees are
    cleared the way ``torch._dynamo.reset`` clears them, with every compiled block. Later runs
    compile again, mostly from inductor's cache on disk."""
    import torch._dynamo
    from torch._inductor.cudagraph_trees import reset_cudagraph_trees

    torch._dynamo.reset()
    reset_cudagraph_trees()  # what reset does on torch 2.13; said here for older releases
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def serve(device: torch.device, args, proto) -> None:
    """Answer the tasks of stdin on ``proto`` until stdin closes (see the module docstring)."""
    if "torch._dynamo" in sys.modules or device.type == "cuda":
        import torch._dynamo as dynamo

        # Every setting's blocks stay compiled side by side: a later round reuses them.
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo.config, name):
                setattr(dynamo.config, name, 256)
    memory = (
        torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    )
    hello = {
        "device": device_name(device),
        "torch": torch.__version__,
        "memory": memory,
        "peak_flops": args.peak_flops or peak_bf16_flops(device),
    }
    print(json.dumps({"hello": hello}), file=proto)
    for line in sys.stdin:
        if not line.strip():
            continue
        task = json.loads(line)
        t0 = time.perf_counter()
        try:
            result = run_task(task, device, args)
        except ConfigError as e:
            result = {"status": "error", "reason": f"config: {e}"}
        except Exception as e:  # one failing setting must not end the others
            traceback.print_exc()
            result = {"status": "error", "reason": f"{type(e).__name__}: {e}"[:500]}
            if not device_healthy(device):
                result["reason"] = (
                    "the CUDA context is lost, the worker restarts: " + result["reason"]
                )
                result.update(id=task.get("id"), wall_s=time.perf_counter() - t0)
                print(json.dumps(result, default=str), file=proto)
                raise SystemExit(CONTEXT_LOST) from e  # the matrix starts a new worker
            if device.type == "cuda":
                torch.cuda.empty_cache()
        result.update(id=task.get("id"), wall_s=time.perf_counter() - t0)
        print(json.dumps(result, default=str), file=proto)


CONTEXT_LOST = 70
"""The worker's exit status after a run left its CUDA context unusable."""


def device_healthy(device: torch.device) -> bool:
    """Whether this process can still run work on ``device``: after a sticky CUDA error (an
    illegal memory access, say) every later call fails, so no later run could measure
    anything in this process."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        return torch.ones(1, device=device).add_(1).item() == 2.0
    except Exception:
        return False
