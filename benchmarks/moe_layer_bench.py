"""Forward+backward time of one MoE layer against a dense floor and DeepSpeed's own MoE layer.

Every contender is timed in the same process, interleaved round by round, and the median of the
rounds is reported, so the ratios hold even when the machine's absolute speed drifts.

    python benchmarks/moe_layer_bench.py            # both shapes, 7 rounds
    python benchmarks/moe_layer_bench.py --rounds 11 --shape b

Contenders (fp32 unless --dtype bf16, CPU unless CUDA is present, T tokens of width D, SwiGLU
experts):
  floor        dense SwiGLU FFN with hidden k * H: the same active FLOPs, no routing
  ours         moe.moe_layer.MoELayer, dropless
  ds_drop      deepspeed.moe.layer.MoE, capacity factor 1.0 (drops tokens)
  ds_dropless  deepspeed.moe.layer.MoE, drop_tokens=False
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from moe.model.experts import DenseFFN
from moe.model.moe_layer import MoEConfig, MoELayer
from moe.model.router import RouterConfig
from moe.training.cpu_allocator import keep_freed_memory

SHAPES = {
    "a": dict(num_experts=8, top_k=2, hidden=1024),
    "b": dict(num_experts=64, top_k=8, hidden=128),
}


class SwiGLUExpert(nn.Module):
    """The same expert function as ours, in the one-module-per-expert form DeepSpeed expects."""

    def __init__(self, d: int, h: int):
        super().__init__()
        self.w_in = nn.Linear(d, 2 * h, bias=False)
        self.w_out = nn.Linear(h, d, bias=False)
        self.h = h

    def forward(self, x):
        gate, up = self.w_in(x).split(self.h, dim=-1)
        return self.w_out(F.silu(gate) * up)


def init_single_process_group() -> None:
    import deepspeed

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def deepspeed_moe(d: int, e: int, k: int, h: int, drop: bool):
    from deepspeed.moe.layer import MoE

    layer = MoE(
        hidden_size=d,
        expert=SwiGLUExpert(d, h),
        num_experts=e,
        ep_size=1,
        k=k,
        capacity_factor=1.0,
        eval_capacity_factor=1.0,
        min_capacity=0,
        drop_tokens=drop,
        use_rts=False,
    )
    layer.set_deepspeed_parallelism()
    return lambda x: layer(x)[0], layer


def contenders(d: int, e: int, k: int, h: int):
    floor = DenseFFN(d, k * h, "swiglu")
    ours = MoELayer(d, MoEConfig(num_experts=e, expert_hidden=h, router=RouterConfig(top_k=k)))
    out = {"floor": (floor, floor), "ours": (lambda x: ours(x)[0], ours)}
    out["ds_drop"] = deepspeed_moe(d, e, k, h, drop=True)
    out["ds_dropless"] = deepspeed_moe(d, e, k, h, drop=False)
    return out


CLOCK = time.perf_counter


def time_once(fn, params, x) -> float:
    for p in params:
        p.grad = None
    x.grad = None
    t0 = CLOCK()
    y = fn(x)
    y.backward(torch.ones_like(y))
    return CLOCK() - t0


def bench(
    shape: str, tokens: int, d: int, rounds: int, dtype: torch.dtype = torch.float32
) -> dict[str, float]:
    s = SHAPES[shape]
    torch.manual_seed(0)
    cands = contenders(d, s["num_experts"], s["top_k"], s["hidden"])
    for _, module in cands.values():
        module.to(dtype)  # our router keeps its fp32 buffers and computes in fp32 (router.py)
    x = torch.randn(1, tokens, d, dtype=dtype, requires_grad=True)
    times: dict[str, list[float]] = {name: [] for name in cands}
    for fn, module in cands.values():  # warm-up
        time_once(fn, list(module.parameters()), x)
    for _ in range(rounds):
        for name, (fn, module) in cands.items():
            times[name].append(time_once(fn, list(module.parameters()), x))
    return {name: statistics.median(v) for name, v in times.items()}


def breakdown(shape: str, tokens: int, d: int, rounds: int) -> dict[str, tuple[float, float]]:
    """Forward and backward time of each stage of our layer, run on its own with the inputs the
    previous stage produces: routing, permutation (plan + gather), expert GEMMs, combine."""
    s = SHAPES[shape]
    torch.manual_seed(0)
    layer = MoELayer(
        d,
        MoEConfig(
            num_experts=s["num_experts"],
            expert_hidden=s["hidden"],
            router=RouterConfig(top_k=s["top_k"]),
        ),
    )
    x_TD = torch.randn(tokens, d, requires_grad=True)
    with torch.no_grad():
        routing = layer.router(x_TD)
        plan = layer.dispatcher.plan(routing.indices_TK, None)
        x_ND, w_N, counts = layer.dispatcher.dispatch(x_TD, routing.weights_TK, plan)
        y_ND = layer.experts(x_ND, counts, w_N)

    def route():
        r = layer.router(x_TD)
        return r.weights_TK.sum() + r.aux_loss

    def permute():
        p = layer.dispatcher.plan(routing.indices_TK.detach(), None)
        return layer.dispatcher.dispatch(x_TD, routing.weights_TK, p)[0]

    x_leaf, w_leaf, y_leaf = (t.clone().requires_grad_(True) for t in (x_ND, w_N, y_ND))
    stages = {
        "routing": route,
        "permutation": permute,
        "expert GEMMs": lambda: layer.experts(x_leaf, counts, w_leaf),
        "combine": lambda: layer.dispatcher.combine(y_leaf, plan),
    }
    times = {name: ([], []) for name in stages}
    for _ in range(rounds + 1):
        for name, fn in stages.items():
            t0 = CLOCK()
            out = fn()
            t1 = CLOCK()
            out.backward(torch.ones_like(out))
            times[name][0].append(t1 - t0)
            times[name][1].append(CLOCK() - t1)
    return {n: (statistics.median(f[1:]), statistics.median(b[1:])) for n, (f, b) in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", choices=["a", "b", "both"], default="both")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="every contender's weights and input (bf16: a bf16 model's compute)",
    )
    p.add_argument(
        "--system-malloc",
        action="store_true",
        help="leave glibc malloc as it is (moe-train keeps freed memory by default)",
    )
    p.add_argument(
        "--cpu-time",
        action="store_true",
        help="one thread, timed by process CPU time: steadier on a machine that other "
        "jobs load (wall time is what training sees)",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="also time each stage of our layer (forward / backward)",
    )
    args = p.parse_args()
    if args.cpu_time:
        global CLOCK
        CLOCK = time.process_time
        torch.set_num_threads(1)
    if not args.system_malloc:
        keep_freed_memory()
    init_single_process_group()
    clock = "process CPU time" if args.cpu_time else "wall time"
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {clock}, T={args.tokens}, "
        f"D={args.d_model}, {args.dtype}, median of {args.rounds} interleaved rounds, "
        f"{'system malloc' if args.system_malloc else 'malloc keeps freed memory'}"
    )
    for shape in ["a", "b"] if args.shape == "both" else [args.shape]:
        s = SHAPES[shape]
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        m = bench(shape, args.tokens, args.d_model, args.rounds, dtype)
        print(
            f"\n({shape}) {s['num_experts']} experts, top-{s['top_k']}, expert hidden {s['hidden']}"
        )
        for name, t in m.items():
            print(f"  {name:<12} {t * 1e3:8.1f} ms")
        print(f"  ours / floor              {m['ours'] / m['floor']:.2f}x")
        print(f"  ds_drop / ours            {m['ds_drop'] / m['ours']:.2f}x")
        print(f"  ds_dropless / ours        {m['ds_dropless'] / m['ours']:.2f}x")
        if args.breakdown:
            print("  ours by stage (forward / backward):")
            for name, (f, b) in breakdown(shape, args.tokens, args.d_model, args.rounds).items():
                print(f"    {name:<14} {f * 1e3:7.1f} / {b * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
