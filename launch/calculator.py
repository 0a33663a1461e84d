"""moe-plan: parameters, FLOPs per token and memory per GPU of a run config, before running it.

Formulas and their conventions are documented in moe/model/size.py and moe/tools/planning.py."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from data_pipeline.shards import MANIFEST, read_manifest
from launch.cli import exits_cleanly
from moe.errors import ConfigError
from moe.model.size import COMPONENTS, count_parameters, flops_per_token
from moe.tools.planning import memory_per_gpu
from moe.training.config import RunConfig, load_config


def resolve_vocab_for_planning(cfg: RunConfig) -> str:
    """Fill a null model.vocab_size from the prepared data's manifest, else from the tokenizer
    config; returns where it came from."""
    if cfg.model.vocab_size is not None:
        return "model.vocab_size"
    manifest = Path(cfg.data.dir) / MANIFEST
    if manifest.exists():
        cfg.model.vocab_size = int(read_manifest(cfg.data.dir).tokenizer["vocab_size"])
        return str(manifest)
    cfg.model.vocab_size = cfg.data.tokenizer.vocab_size
    return "data.tokenizer.vocab_size"


def build_report(cfg: RunConfig, world_size: int, ep_size: int, zero_stages: list[int]) -> dict:
    if world_size % ep_size or cfg.model.moe.num_experts % ep_size:
        raise ConfigError([f"expert parallel size {ep_size} must divide the world size "
                           f"({world_size}) and model.moe.num_experts "
                           f"({cfg.model.moe.num_experts})"])
    counts = count_parameters(cfg.model)
    t = cfg.train
    return {
        "params": {"total": counts.total, "active": counts.active,
                   "total_sum": counts.total_params, "active_sum": counts.active_params},
        "flops_per_token": flops_per_token(cfg.model, cfg.data.seq_len),
        "memory": [asdict(memory_per_gpu(cfg.model, world_size, ep_size, z, t.precision,
                                         t.micro_batch_size, cfg.data.seq_len))
                   for z in zero_stages],
    }


def _n(x: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


def render(report: dict, cfg: RunConfig) -> str:
    p, f = report["params"], report["flops_per_token"]
    lines = [f"{'component':<16}{'total':>12}{'active':>12}"]
    for c in COMPONENTS:
        if p["total"][c]:
            lines.append(f"{c:<16}{_n(p['total'][c]):>12}{_n(p['active'][c]):>12}")
    lines.append(f"{'all':<16}{_n(p['total_sum']):>12}{_n(p['active_sum']):>12}"
                 f"   ({p['total_sum']:,} / {p['active_sum']:,})")
    lines += ["", f"FLOPs per token (seq_len {cfg.data.seq_len}): forward {_n(f['forward'])} "
                  f"(attention {_n(f['attention_forward'])}), training {_n(f['training'])}"]
    t = cfg.train
    for m in report["memory"]:
        lines += ["", f"memory per GPU: world {m['world_size']}, expert parallel "
                      f"{m['expert_parallel_size']}, ZeRO {m['zero_stage']}, {m['precision']}",
                  f"  parameters held   {_n(m['params_per_gpu'])}",
                  f"  weights           {_gib(m['weights_bytes'])}",
                  f"  gradients         {_gib(m['grads_bytes'])}",
                  f"  optimizer states  {_gib(m['optimizer_bytes'])}",
                  f"  activations       {_gib(m['activation_bytes'])} per micro-batch of "
                  f"{t.micro_batch_size} x {cfg.data.seq_len} tokens (+ "
                  f"{_gib(m['attention_probs_bytes'])} if attention is not fused)"]
    return "\n".join(lines)


@exits_cleanly
def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="moe-plan", description=__doc__)
    p.add_argument("config", help="run config (YAML)")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. train.micro_batch_size=4")
    p.add_argument("--world-size", type=int, help="GPUs (default: parallel.world_size)")
    p.add_argument("--ep", type=int, help="expert-parallel size (default: "
                                          "parallel.expert_parallel_size)")
    p.add_argument("--zero", type=int, choices=[0, 1, 2], action="append",
                   help="ZeRO stage(s) to show (default: 0, 1 and 2)")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    vocab_from = resolve_vocab_for_planning(cfg)
    report = build_report(cfg, args.world_size or cfg.parallel.world_size,
                          args.ep or cfg.parallel.expert_parallel_size, args.zero or [0, 1, 2])
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{args.config}: vocabulary {cfg.model.vocab_size} (from {vocab_from})\n")
        print(render(report, cfg))


if __name__ == "__main__":
    main()
