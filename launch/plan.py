"""moe-plan: parameters, FLOPs per token and memory per GPU of a run config, before running it
(a fine-tuning run's as its finetune.method holds it); with --gpus and --gpu-memory, the layouts
that fit, best first.

Formulas and their conventions are documented in moe/model/size.py and moe/tools/planning.py."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, replace

from data_pipeline import storage
from data_pipeline.errors import DataError
from data_pipeline.shards import MANIFEST, read_manifest
from launch.cli import exits_cleanly
from moe.config.run import RunConfig, load_config
from moe.core.errors import ConfigError
from moe.model.size import COMPONENTS, count_parameters, flops_per_token
from moe.tools.planning import (
    GIB,
    MICRO_BATCHES,
    USABLE_FRACTION,
    FinetunePlan,
    Layout,
    checkpoint_bytes,
    finetune_plan,
    fitting_layouts,
    memory_per_gpu,
)


def resolve_vocab_for_planning(cfg: RunConfig) -> str:
    """Fill a null model.vocab_size from the prepared data's manifest, else from the tokenizer
    config; returns where it came from."""
    if cfg.model.vocab_size is not None:
        return "model.vocab_size"
    manifest = storage.join(cfg.data.dir, MANIFEST)
    try:
        cfg.model.vocab_size = int(read_manifest(cfg.data.dir, cfg.data.s3).tokenizer["vocab_size"])
        return str(manifest)
    except DataError:
        pass  # not prepared yet
    cfg.model.vocab_size = cfg.data.tokenizer.vocab_size
    return "data.tokenizer.vocab_size"


def build_report(
    cfg: RunConfig,
    world_size: int,
    ep_size: int,
    zero_stages: list[int],
    immediate_at_stage_1: bool | None = None,
) -> dict:
    """``immediate_at_stage_1``: train.immediate_grad_update of a run at ZeRO stage 1 (the only
    stage it applies to; :func:`immediate_at_zero1`); default: the config's value."""
    if immediate_at_stage_1 is None:
        immediate_at_stage_1 = bool(cfg.train.immediate_grad_update)
    if world_size % ep_size or cfg.model.moe.num_experts % ep_size:
        raise ConfigError(
            [
                f"expert parallel size {ep_size} must divide the world size "
                f"({world_size}) and model.moe.num_experts "
                f"({cfg.model.moe.num_experts})"
            ]
        )
    counts = count_parameters(cfg.model)
    t = cfg.train
    ft = finetune_plan(cfg.model, cfg.finetune)
    return {
        "params": {
            "total": counts.total,
            "active": counts.active,
            "total_sum": counts.total_params,
            "active_sum": counts.active_params,
        },
        **finetune_report(ft),
        "flops_per_token": flops_per_token(cfg.model, cfg.data.seq_len),
        "memory": [
            {
                **asdict(
                    memory_per_gpu(
                        cfg.model,
                        world_size,
                        ep_size,
                        z,
                        t.precision,
                        t.micro_batch_size,
                        cfg.data.seq_len,
                        t.recompute,
                        t.recompute_every_n_blocks,
                        immediate_at_stage_1,
                        t.compile,
                        ft,
                    )
                ),
                "checkpoint_bytes": checkpoint_bytes(cfg.model, t.precision, z, ep_size, ft),
            }
            for z in zero_stages
        ],
    }


def finetune_report(ft: FinetunePlan | None) -> dict:
    """What a fine-tuning run trains and freezes, as data (nothing for pretraining)."""
    if ft is None:
        return {}
    return {
        "finetune": {
            "method": ft.method,
            "trainable_params": ft.trainable_params,
            "frozen_params": ft.frozen_params,
            "nf4_params": ft.nf4_values.per_rank(1),
            "nf4_bytes": ft.nf4_bytes.per_rank(1),
        }
    }


def render_finetune(r: dict) -> list[str]:
    """The lines that say which fine-tuning method was planned, and what it trains."""
    if "finetune" not in r:
        return []
    f = r["finetune"]
    total = f["trainable_params"] + f["frozen_params"]
    trained = "gradients and optimizer states"
    if f["method"] == "esft":  # the stacks' unselected rows get zero gradients, states as well
        trained += " for every routed expert; the experts the data selects train"
    nf4 = (
        f"; {_n(f['nf4_params'])} of them in NF4, {_gib(f['nf4_bytes'])}" if f["nf4_params"] else ""
    )
    return [
        f"finetune.method {f['method']}: {_n(f['trainable_params'])} parameters train "
        f"({100 * f['trainable_params'] / total:.3g}%; {trained}), "
        f"{_n(f['frozen_params'])} frozen (no gradient or optimizer state{nf4})"
    ]


def _n(x: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def _gib(x: float) -> str:
    return f"{x / GIB:.2f} GiB"


def _total(m: dict) -> float:
    return (
        m["weights_bytes"]
        + m["grads_bytes"]
        + m["optimizer_bytes"]
        + m["activation_bytes"]
        + m["transient_bytes"]
    )


LAYOUT_RULE = (
    "Layouts are ordered best throughput first: (1) compute factor, the training FLOPs with "
    "recompute over those without (full adds one forward of the blocks, about 1.33; selective "
    "adds the attention core's forward, a few percent), lower first; (2) larger micro-batch; "
    "(3) fewer bytes each GPU sends per step (expert all-to-alls, gradient reduction; ZeRO-2 "
    "reduces every micro-batch); (4) lower ZeRO stage. A layout fits when its planned peak "
    f"(model states, kept activations, working set) is at most {USABLE_FRACTION:.0%} of "
    "--gpu-memory. Exit status 1 when nothing fits."
)


def global_batch(cfg: RunConfig) -> int:
    """Sequences per optimizer step in the config, kept when the micro-batch varies."""
    t = cfg.train
    return t.micro_batch_size * t.grad_accum_steps * cfg.parallel.world_size


def immediate_at_zero1(loaded: RunConfig, device: str) -> bool:
    """train.immediate_grad_update of ``loaded`` run at ZeRO stage 1 on ``device``, as a layout
    at that stage takes it: a config at stage 2 resolves it false (it applies at stage 1 only),
    while the same run at stage 1 takes it where it is left to the device."""
    at_1 = replace(loaded, parallel=replace(loaded.parallel, zero_stage=1))
    try:
        return bool(at_1.for_device(device).train.immediate_grad_update)
    except ConfigError:  # a setting of the config that stage 1 refuses: its own value
        return bool(loaded.for_device(device).train.immediate_grad_update)


def layouts_report(
    cfg: RunConfig, gpus: int, gpu_memory: float, top: int, immediate_at_stage_1: bool = False
) -> tuple[dict, bool]:
    """The fitting layouts (best first, at most ``top``) as data, and whether any fits;
    ``immediate_at_stage_1``: :func:`immediate_at_zero1`."""
    t = cfg.train
    gb = global_batch(cfg)
    ft = finetune_plan(cfg.model, cfg.finetune)
    fits, considered = fitting_layouts(
        cfg.model,
        gpus,
        gpu_memory,
        cfg.data.seq_len,
        gb,
        t.precision,
        t.recompute_every_n_blocks,
        t.compile,
        ft,
        immediate_at_stage_1,
    )
    row = _layout_row
    return {
        **finetune_report(ft),
        "gpus": gpus,
        "gpu_memory_gib": gpu_memory,
        "global_batch": gb,
        "precision": t.precision,
        "considered": len(considered),
        "fitting": len(fits),
        "layouts": [row(lay) for lay in fits[:top]],
        "smallest": [row(lay) for lay in considered[:1]],
    }, bool(fits)


def _layout_row(lay: Layout) -> dict:
    return {
        "ep": lay.expert_parallel_size,
        "zero": lay.zero_stage,
        "recompute": lay.recompute,
        "micro_batch": lay.micro_batch_size,
        "grad_accum": lay.grad_accum_steps,
        "peak_gib": _total(asdict(lay.memory)) / GIB,
        "activations_gib": lay.memory.activation_bytes / GIB,
        "compute_factor": lay.compute_factor,
        "comm_gib_per_step": lay.comm_bytes / GIB,
    }


def render_layouts(r: dict) -> str:
    head = (
        f"{r['gpus']} GPUs of {r['gpu_memory_gib']:g} GiB, {r['precision']}, global batch "
        f"{r['global_batch']} sequences: {r['fitting']} of {r['considered']} layouts fit "
        f"(usable {USABLE_FRACTION:.0%})"
    )
    head = "\n".join([*render_finetune(r), head])
    if not r["layouts"]:
        s = r["smallest"][0] if r["smallest"] else None
        why = (
            f"the smallest needs {s['peak_gib']:.1f} GiB per GPU (ep {s['ep']}, ZeRO "
            f"{s['zero']}, recompute {s['recompute']}, micro-batch {s['micro_batch']})"
            if s
            else f"no micro-batch in {MICRO_BATCHES} divides the global batch evenly"
        )
        return f"{head}\nnothing fits: {why}"
    lines = [
        head,
        "",
        f"{'rank':>4} {'ep':>3} {'zero':>4} {'recompute':>9} {'mb':>3} "
        f"{'accum':>5} {'peak GiB':>9} {'act GiB':>8} {'compute':>8} "
        f"{'comm GiB/step':>13}",
    ]
    for i, x in enumerate(r["layouts"], 1):
        lines.append(
            f"{i:>4} {x['ep']:>3} {x['zero']:>4} {x['recompute']:>9} "
            f"{x['micro_batch']:>3} {x['grad_accum']:>5} {x['peak_gib']:>9.1f} "
            f"{x['activations_gib']:>8.1f} {x['compute_factor']:>7.2f}x "
            f"{x['comm_gib_per_step']:>13.1f}"
        )
    if r["fitting"] > len(r["layouts"]):
        lines.append(f"... {r['fitting'] - len(r['layouts'])} more (--top)")
    return "\n".join(lines)


def render(report: dict, cfg: RunConfig) -> str:
    p, f = report["params"], report["flops_per_token"]
    lines = [f"{'component':<16}{'total':>12}{'active':>12}"]
    for c in COMPONENTS:
        if p["total"][c]:
            lines.append(f"{c:<16}{_n(p['total'][c]):>12}{_n(p['active'][c]):>12}")
    lines.append(
        f"{'all':<16}{_n(p['total_sum']):>12}{_n(p['active_sum']):>12}"
        f"   ({p['total_sum']:,} / {p['active_sum']:,})"
    )
    lines += [
        "",
        f"FLOPs per token (seq_len {cfg.data.seq_len}): forward {_n(f['forward'])} "
        f"(attention {_n(f['attention_forward'])}), training {_n(f['training'])}",
    ]
    if "finetune" in report:
        lines += ["", *render_finetune(report)]
    t = cfg.train
    every = (
        f" every {t.recompute_every_n_blocks} blocks"
        if t.recompute != "none" and t.recompute_every_n_blocks > 1
        else ""
    )
    for m in report["memory"]:
        lines += [
            "",
            f"memory per GPU: world {m['world_size']}, expert parallel "
            f"{m['expert_parallel_size']}, ZeRO {m['zero_stage']}, {m['precision']}",
            f"  parameters held   {_n(m['params_per_gpu'])}",
            f"  weights           {_gib(m['weights_bytes'])}",
            f"  gradients         {_gib(m['grads_bytes'])}",
            f"  optimizer states  {_gib(m['optimizer_bytes'])}",
            f"  activations       {_gib(m['activation_bytes'])} kept per micro-batch of "
            f"{t.micro_batch_size} x {cfg.data.seq_len} tokens (recompute {m['recompute']}"
            f"{every}; attention masks {_gib(m['attention_mask_bytes'])})",
            f"  working set       {_gib(m['transient_bytes'])} (logits, recomputed block, "
            "all-to-all buffers)",
            f"  peak              {_gib(_total(m))}",
            f"  checkpoint        {_gib(m['checkpoint_bytes'])} on disk, every rank's "
            "files together (weights and optimizer states)",
        ]
    return "\n".join(lines)


def _check_flags(p: argparse.ArgumentParser, args) -> None:
    """Refuse flags out of range, or that the mode (one plan, or --gpus layouts) would not read."""
    if (args.gpus is None) != (args.gpu_memory is None):
        p.error("--gpus and --gpu-memory go together")
    for flag, value in (
        ("--world-size", args.world_size),
        ("--ep", args.ep),
        ("--gpus", args.gpus),
        ("--top", args.top),
    ):
        if value is not None and value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    if args.gpu_memory is not None and not 0 < args.gpu_memory < math.inf:  # NaN fails too
        p.error(f"--gpu-memory must be a finite number of GiB > 0, got {args.gpu_memory}")
    # The layout search tries every expert-parallel size and ZeRO stage on --gpus GPUs, and
    # the plan of one layout lists no layouts: a flag the mode would not read is refused.
    if args.gpus is not None:
        given = [f for f in ("world_size", "ep", "zero") if getattr(args, f) is not None]
        if given:
            flags = ", ".join("--" + f.replace("_", "-") for f in given)
            p.error(
                f"{flags}: not with --gpus, whose layouts are every expert-parallel size and "
                "ZeRO stage on that many GPUs"
            )
    elif args.top is not None:
        p.error("--top: goes with --gpus and --gpu-memory (it bounds the layouts listed)")


@exits_cleanly
def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="moe-plan", description=__doc__, epilog=LAYOUT_RULE)
    p.add_argument("config", help="run config (YAML)")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. train.micro_batch_size=4")
    p.add_argument("--world-size", type=int, help="GPUs (default: parallel.world_size)")
    p.add_argument(
        "--ep", type=int, help="expert-parallel size (default: parallel.expert_parallel_size)"
    )
    p.add_argument(
        "--zero",
        type=int,
        choices=[0, 1, 2],
        action="append",
        help="ZeRO stage(s) to show (default: 0, 1 and 2)",
    )
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    p.add_argument(
        "--gpus",
        type=int,
        help="list the layouts that fit this many GPUs "
        "(with --gpu-memory), best first; exit status 1 when none fits",
    )
    p.add_argument("--gpu-memory", type=float, metavar="GIB", help="memory of one GPU in GiB")
    p.add_argument("--top", type=int, help="layouts to list, with --gpus (default 10)")
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="plan the values a run on this device takes for the settings the config leaves "
        "to the device (null or auto; RunConfig.for_device); default cuda",
    )
    args = p.parse_args(argv)
    _check_flags(p, args)
    loaded = load_config(args.config, args.overrides)
    chosen = loaded.device_choices(args.device)
    cfg = loaded.for_device(args.device)
    vocab_from = resolve_vocab_for_planning(cfg)
    header = f"{args.config}: vocabulary {cfg.model.vocab_size} (from {vocab_from})\n"
    if chosen:
        header += (
            f"settings left to the device, as on {args.device}: "
            + ", ".join(f"{key} {json.dumps(value)}" for key, value in chosen.items())
            + "\n"
        )
    if args.gpus is not None:
        immediate = immediate_at_zero1(loaded, args.device)
        report, fits = layouts_report(cfg, args.gpus, args.gpu_memory, args.top or 10, immediate)
        print(
            json.dumps({**report, "device": args.device, "device_settings": chosen}, indent=2)
            if args.json
            else header + "\n" + render_layouts(report)
        )
        if not fits:
            sys.exit(1)
        return
    report = build_report(
        cfg,
        args.world_size or cfg.parallel.world_size,
        args.ep or cfg.parallel.expert_parallel_size,
        args.zero or [0, 1, 2],
        immediate_at_zero1(loaded, args.device),
    )
    if args.json:
        print(json.dumps({**report, "device": args.device, "device_settings": chosen}, indent=2))
    else:
        print(header)
        print(render(report, cfg))


if __name__ == "__main__":
    main()
