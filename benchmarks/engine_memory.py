"""Memory of DeepSpeed's training engine on one GPU against the planner (moe/tools/planning.py),
layout by layout: ZeRO stage 1 and 2, gradients reduced in fp32 and in bf16, two micro-batch
sizes (so that what grows with the parameters and what grows with the tokens can be told apart).

    python benchmarks/engine_memory.py [--json PATH]       # on a GPU

For each layout: memory allocated once the engine is built, after a whole step (activations
freed: the model states and whatever buffers the engine keeps), and the peak of a step, next to
the planner's weights, gradients, optimizer states, saved activations and transient working set.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_train_bench import CONFIGS, build, one_gpu, one_rank_group, step

from moe.config.run import load_config
from moe.model.size import count_parameters
from moe.tools.planning import memory_per_gpu

LAYOUTS = [(1, "fp32"), (1, "bf16"), (2, "fp32"), (2, "bf16")]
MICRO_BATCHES = (8, 2)
GIB = 2**30


def _mem(fn, device) -> int:
    """A torch.cuda memory figure; 0 on the CPU (--device cpu only checks that the script runs)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return fn(device)


def measure(zero: int, reduce: str, mb: int, device, tiny: bool) -> dict:
    overrides = (
        [
            "model.n_layers=1",
            "model.d_model=64",
            "model.n_heads=2",
            "data.seq_len=64",
            "model.vocab_size=512",
        ]
        if tiny
        else []
    )
    cfg = one_gpu(load_config(CONFIGS / "moe-125m.yaml", overrides), mb)
    if tiny:
        cfg.train.precision = "fp32"
    cfg.parallel.zero_stage, cfg.train.grad_reduce_dtype = zero, reduce
    cfg.train.grad_accum_steps = 2
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    base = _mem(torch.cuda.memory_allocated, device)
    engine = build(cfg)
    built = _mem(torch.cuda.memory_allocated, device) - base
    for _ in range(2 * 2):  # two optimizer steps: Adam's moments and every buffer exist
        step(engine, cfg, device)
    static = _mem(torch.cuda.memory_allocated, device) - base
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(2):
        step(engine, cfg, device)
    peak = _mem(torch.cuda.max_memory_allocated, device) - base
    plan = memory_per_gpu(cfg.model, 1, 1, zero, "bf16", mb, cfg.data.seq_len)
    row = {
        "zero": zero,
        "reduce": reduce,
        "micro_batch": mb,
        "params": count_parameters(cfg.model).total_params,
        "built": built,
        "static": static,
        "peak": peak,
        "plan": {
            k: getattr(plan, k)
            for k in (
                "weights_bytes",
                "grads_bytes",
                "optimizer_bytes",
                "activation_bytes",
                "transient_bytes",
            )
        },
        "plan_states": plan.model_states_bytes,
        "plan_total": plan.total_bytes,
    }
    del engine
    if cuda:
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = p.parse_args(argv)
    tiny = args.device == "cpu"  # a tiny fp32 shape: the script runs, its figures are all 0
    device = torch.device("cuda", 0) if not tiny else torch.device("cpu")
    if not tiny:
        torch.cuda.set_device(device)
    one_rank_group("gloo" if tiny else "nccl")
    rows = [measure(z, r, mb, device, tiny) for mb in MICRO_BATCHES for z, r in LAYOUTS]
    print(
        f"{'zero':>4} {'reduce':>6} {'mb':>3} {'built':>7} {'static':>7} {'plan st':>7} "
        f"{'peak':>7} {'plan':>7} {'peak/plan':>9}   (GiB)"
    )
    for r in rows:
        print(
            f"{r['zero']:>4} {r['reduce']:>6} {r['micro_batch']:>3} {r['built'] / GIB:>7.2f} "
            f"{r['static'] / GIB:>7.2f} {r['plan_states'] / GIB:>7.2f} {r['peak'] / GIB:>7.2f} "
            f"{r['plan_total'] / GIB:>7.2f} {r['peak'] / max(r['plan_total'], 1):>9.3f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
