"""CPU figures of speed levers against the default in the same run (interleaved rounds,
median and min-max spread); GPU figures come from benchmarks/gpu_train_bench.py ``--set``.

``loss``: the output head and loss (``model.cross_entropy``), forward and backward of
``h (T, D) -> logits (T, V) -> summed cross-entropy`` in fp32: full against chunked (block of
``--chunk`` tokens). Time per call, and peak memory: each variant runs once in a fresh process,
whose peak resident set (VmHWM, reset before the call) grows by what the call needs beyond its
inputs.

``step``: a training step (forward, backward, AdamW) of configs/default.yaml's model at its
4096-token vocabulary, one micro-batch of 8 x 256 tokens, full against chunked loss.

``permute``: how token copies move (``model.moe.permute``), index_add against gather: a
training step of configs/default.yaml's model as in ``step``, and the forward and backward of
one MoE layer of fine-grained experts at configs/moe-1b.yaml's routing (64 experts, top 8,
width 384, model width 1024 scaled to ``--d-model``) on ``--tokens`` tokens, fp32 and bf16.

``optimizer``: one AdamW step (``train.optimizer_impl``) over the parameter groups one rank of
configs/default.yaml steps under DeepSpeed (ZeRO 2, 2 ranks, expert parallelism 2: half of the
non-expert weights as one flat partition, each local expert tensor its own group): for_loop
(torch's CPU default), foreach, fused.

``grads``: ``train.immediate_grad_update`` off and on: a training step of configs/default.yaml's
model (one rank, bf16, ZeRO 1: DeepSpeed's BF16 optimizer; 2 micro-batches of 8 x 256 tokens)
through the trainer's engine, and the bf16 gradient bytes still held after each backward.

``flat``: ``train.flat_grad_ops`` off and on: a training step through the trainer's engine (one
rank, bf16, fused AdamW, 2 micro-batches of 4 x 64 tokens) of configs/moe-125m.yaml's structure
and its dense counterpart at ZeRO 1 (DeepSpeed's BF16 optimizer), and of the MoE at ZeRO 2
(DeepSpeed's ZeRO 1/2 optimizer), narrowed to width 32 so that the step's time is mostly host
work: the aten operators dispatched per step, and the optimizer step's time without AdamW's own.

``qkv``: ``model.qkv_projection`` separate against fused: the query, key and value projections
of one attention layer, forward and backward, at ``--qkv-d-model`` (768, configs/moe-125m.yaml's
width) on ``--tokens`` tokens, fp32 and bf16; and a training step of configs/default.yaml's
model as in ``step``.

``setup``: the engine's set-up (``build_engine``) of configs/moe-125m.yaml at one rank, bf16,
ZeRO 1 (DeepSpeed's BF16 optimizer), with DeepSpeed's own forced memory report around each
parameter group (a ``gc.collect()`` each) against the adapter's debug-log report.

    PYTHONPATH=$PWD python benchmarks/levers_bench.py                 # all of them, 5 rounds
    PYTHONPATH=$PWD python benchmarks/levers_bench.py --only loss --tokens 4096 --vocab 32000
    PYTHONPATH=$PWD python benchmarks/levers_bench.py --only permute
    PYTHONPATH=$PWD python benchmarks/levers_bench.py --only qkv
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time

import torch

from moe.config.run import load_config
from moe.model.loss import LMHeadLoss, full_cross_entropy
from moe.model.transformer import MoETransformer


def head_inputs(tokens: int, d_model: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, d_model, generator=g, requires_grad=True)
    w = (torch.randn(vocab, d_model, generator=g) * 0.02).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), generator=g)
    return h, w, t


def head_call(variant: str, chunk: int, h, w, t) -> None:
    loss = (
        full_cross_entropy(h @ w.t(), t)
        if variant == "full"
        else LMHeadLoss("chunked", chunk)(h, w, t)
    )
    loss.backward()
    h.grad = w.grad = None


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def call_peak_kib(variant: str, tokens: int, d_model: int, vocab: int, chunk: int) -> int:
    """How far one call raises the resident set above what it was before (Linux: the peak is
    reset through /proc/self/clear_refs, then read as VmHWM)."""
    torch.set_num_threads(1)
    args = head_inputs(tokens, d_model, vocab)
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    head_call(variant, chunk, *args)
    return _status_kib("VmHWM") - before


def peak_kib(variant: str, tokens: int, d_model: int, vocab: int, chunk: int) -> int:
    """:func:`call_peak_kib` in a fresh process (nothing freed earlier is reused)."""
    code = (
        "from benchmarks.levers_bench import call_peak_kib\n"
        f"print(call_peak_kib({variant!r}, {tokens}, {d_model}, {vocab}, {chunk}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def timed(fn, repeat: int) -> float:
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def interleaved(calls: dict, rounds: int, repeat: int) -> dict[str, list[float]]:
    for fn in calls.values():  # warm-up
        fn()
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            times[name].append(timed(fn, repeat))
    return times


def report(
    title: str,
    times: dict[str, list[float]],
    base: str,
    unit: float = 1e3,
    extra: dict | None = None,
) -> dict:
    print(f"\n{title}")
    rows = {}
    for name, ts in times.items():
        ratios = [a / b for a, b in zip(ts, times[base])]
        rows[name] = {
            "median_ms": statistics.median(ts) * unit,
            "min_ms": min(ts) * unit,
            "max_ms": max(ts) * unit,
            "ratio": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            **(extra or {}).get(name, {}),
        }
        r = rows[name]
        more = "".join(f", {k} {v}" for k, v in (extra or {}).get(name, {}).items())
        print(
            f"  {name:10s} {r['median_ms']:9.1f} ms ({r['min_ms']:.1f}-{r['max_ms']:.1f}); "
            f"/ {base}: {r['ratio']:.3f}x ({r['ratio_min']:.3f}-{r['ratio_max']:.3f}){more}"
        )
    return rows


def bench_loss(args) -> dict:
    h, w, t = head_inputs(args.tokens, args.d_model, args.vocab)
    calls = {v: (lambda v=v: head_call(v, args.chunk, h, w, t)) for v in ("full", "chunked")}
    times = interleaved(calls, args.rounds, 1)
    mem = {
        v: {
            "peak_MiB": round(peak_kib(v, args.tokens, args.d_model, args.vocab, args.chunk) / 1024)
        }
        for v in calls
    }
    return report(
        f"head + loss, T {args.tokens}, D {args.d_model}, V {args.vocab}, chunk "
        f"{args.chunk}, fp32, forward + backward",
        times,
        "full",
        extra=mem,
    )


def default_step(edit):
    """One training step (forward, backward, AdamW) of configs/default.yaml's model at a
    4096-token vocabulary on a fixed batch of 8 x 256 tokens, after ``edit(model_config)``."""
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(0, 4096, (8, 257), generator=g)
    cfg = copy.deepcopy(load_config("configs/default.yaml").model)
    cfg.vocab_size = 4096
    edit(cfg)
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        model(batch[:, :-1], batch[:, 1:]).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def bench_step(args) -> dict:
    def loss(variant):
        def edit(cfg):
            cfg.cross_entropy, cfg.cross_entropy_chunk_tokens = variant, args.chunk

        return edit

    calls = {variant: default_step(loss(variant)) for variant in ("full", "chunked")}
    return report(
        "training step, configs/default.yaml's model, 8 x 256 tokens, fp32",
        interleaved(calls, args.rounds, 2),
        "full",
    )


def bench_permute(args) -> dict:
    from moe.model.moe_layer import MoEConfig, MoELayer
    from moe.model.router import RouterConfig

    impls = ("index_add", "gather")
    calls = {
        impl: default_step(lambda cfg, impl=impl: setattr(cfg.moe, "permute", impl))
        for impl in impls
    }
    g = torch.Generator().manual_seed(1)
    out = {
        "step": report(
            "training step, configs/default.yaml's model, 8 x 256 tokens, fp32",
            interleaved(calls, args.rounds, 2),
            "index_add",
        )
    }
    x = torch.randn(1, args.tokens, args.d_model, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        calls = {}
        for impl in impls:
            torch.manual_seed(0)
            moe = MoEConfig(
                num_experts=64, expert_hidden=384, router=RouterConfig(top_k=8), permute=impl
            )
            layer = MoELayer(args.d_model, moe).to(dtype)
            xd = x.to(dtype).requires_grad_(True)

            def call(layer=layer, xd=xd):
                y, aux = layer(xd)
                (y.float().square().mean() + aux).backward()
                layer.zero_grad(set_to_none=True)
                xd.grad = None

            calls[impl] = call
        name = str(dtype).removeprefix("torch.")
        out[f"layer_{name}"] = report(
            f"MoE layer forward + backward, 64 experts top 8 width 384, T {args.tokens}, "
            f"D {args.d_model}, {name}",
            interleaved(calls, args.rounds, 2),
            "index_add",
        )
    return out


def bench_qkv(args) -> dict:
    from moe.model.attention import CausalSelfAttention

    modes = ("separate", "fused")
    calls = {
        mode: default_step(lambda cfg, mode=mode: setattr(cfg, "qkv_projection", mode))
        for mode in modes
    }
    out = {
        "step": report(
            "training step, configs/default.yaml's model, 8 x 256 tokens, fp32",
            interleaved(calls, args.rounds, 2),
            "separate",
        )
    }
    D = args.qkv_d_model
    x = torch.randn(1, args.tokens, D, generator=torch.Generator().manual_seed(2))
    for dtype in (torch.float32, torch.bfloat16):
        calls = {}
        for mode in modes:
            torch.manual_seed(0)
            attn = CausalSelfAttention(D, D // 64, D // 64, fused_qkv=mode == "fused").to(dtype)
            xd = x.to(dtype).requires_grad_(True)

            def call(attn=attn, xd=xd):
                q, k, v = attn._projections(xd)
                (q.float().sum() + k.float().square().sum() + v.float().mean()).backward()
                attn.zero_grad(set_to_none=True)
                xd.grad = None

            calls[mode] = call
        name = str(dtype).removeprefix("torch.")
        out[f"projections_{name}"] = report(
            f"query, key and value projections forward + backward, T {args.tokens}, D {D}, {name}",
            interleaved(calls, args.rounds, 2),
            "separate",
        )
    return out


def default_rank_groups() -> list[int]:
    """Numbers of elements of one rank's optimizer groups for configs/default.yaml at
    world size 2, expert parallelism 2, ZeRO 2 (see the module docstring)."""
    cfg = copy.deepcopy(load_config("configs/default.yaml").model)
    cfg.vocab_size = 4096
    with torch.device("meta"):
        model = MoETransformer(cfg)
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    others = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    return [others // 2] + [p.numel() // 2 for p in experts]


def bench_optimizer(args) -> dict:
    kinds = {"for_loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
    calls = {}
    for name, options in kinds.items():
        params = [torch.nn.Parameter(torch.randn(n)) for n in default_rank_groups()]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW([{"params": [p]} for p in params], lr=1e-3, **options)
        calls[name] = opt.step
    return report(
        f"AdamW step, one rank's groups of configs/default.yaml "
        f"({sum(default_rank_groups()):,} fp32 elements)",
        interleaved(calls, args.rounds, 5),
        "for_loop",
    )


def _grads_worker(rank, world, rounds, out_file):
    from moe.training.trainer import DistEnv, build_engine

    env = DistEnv(rank, world, rank, world)
    g = torch.Generator().manual_seed(1)
    micro = [torch.randint(0, 4096, (8, 257), generator=g) for _ in range(2)]
    calls, held = {}, {}
    for name in ("off", "on"):
        cfg = load_config(
            "configs/default.yaml",
            [
                "model.vocab_size=4096",
                "train.precision=bf16",
                "train.grad_accum_steps=2",
                "parallel.world_size=1",
                "parallel.expert_parallel_size=1",
                "parallel.zero_stage=1",
                f"train.immediate_grad_update={name == 'on'}",
            ],
        )
        engine = build_engine(cfg, env)[0]

        def step(engine=engine, name=name):
            for batch in micro:
                engine.backward(engine(batch[:, :-1], batch[:, 1:]).loss)
                held[name] = sum(
                    p.grad.nbytes for p in engine.module.parameters() if p.grad is not None
                )
                engine.step()

        calls[name] = step
    times = interleaved(calls, rounds, 1)
    torch.save({"times": times, "held": held}, out_file)


def bench_grads(args) -> dict:
    import tempfile

    from tests.helpers.distributed import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        run_distributed(_grads_worker, 1, args.rounds, f"{tmp}/out.pt")
        r = torch.load(f"{tmp}/out.pt", weights_only=True)
    extra = {name: {"bf16 grad MiB held": round(b / 2**20, 1)} for name, b in r["held"].items()}
    return report(
        "training step, configs/default.yaml's model, bf16 ZeRO 1, 2 x 8 x 256 tokens, "
        "train.immediate_grad_update",
        r["times"],
        "off",
        extra=extra,
    )


FLAT_SHAPE = [  # configs/moe-125m.yaml's structure (12 layers; 16 experts, top 3, shared)
    "model.vocab_size=512",  # narrowed until a step's time is mostly host work, as on a GPU
    "model.d_model=32",
    "model.n_heads=4",
    "model.moe.expert_hidden=16",
    "data.seq_len=64",
    "train.precision=bf16",
    "train.micro_batch_size=4",
    "train.grad_accum_steps=2",
    "train.optimizer_impl=fused",
    "parallel.world_size=1",
    "parallel.expert_parallel_size=1",
    "parallel.zero_stage=1",
]


FLAT_MODELS = {  # name: overrides of FLAT_SHAPE
    "moe": [],
    "dense": ["model.ffn=dense"],
    "moe-zero2": ["parallel.zero_stage=2"],  # DeepSpeed's ZeRO 1/2 optimizer, not its BF16 one
}


class _OpCount(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _flat_worker(rank, world, rounds, out_file):
    from moe.training.trainer import DistEnv, build_engine

    env = DistEnv(rank, world, rank, world)
    g = torch.Generator().manual_seed(1)
    micro = [torch.randint(0, 512, (4, 65), generator=g) for _ in range(2)]
    calls, optimizer_s, ops, params = {}, {}, {}, {}
    for model, extra in FLAT_MODELS.items():
        for flat in (False, True):
            name = f"{model}-{'flat' if flat else 'deepspeed'}"
            overrides = [*FLAT_SHAPE, f"train.flat_grad_ops={flat}", *extra]
            cfg = load_config("configs/moe-125m.yaml", overrides)
            engine = build_engine(cfg, env)[0]
            opt = engine.optimizer
            groups = opt.bf16_groups if hasattr(opt, "bf16_groups") else opt.bit16_groups
            params[name] = sum(len(g) for g in groups)
            optimizer_s[name] = []
            adamw = engine.optimizer.optimizer
            adamw_s = [0.0]

            def timed_adamw(*a, _real=adamw.step, _s=adamw_s, **k):
                t0 = time.perf_counter()
                out = _real(*a, **k)
                _s[0] += time.perf_counter() - t0
                return out

            adamw.step = timed_adamw

            def step(engine=engine, name=name, adamw_s=adamw_s):
                for i, batch in enumerate(micro):
                    engine.backward(engine(batch[:, :-1], batch[:, 1:]).loss)
                    adamw_s[0] = 0.0
                    t0 = time.perf_counter()
                    engine.step()
                    if i == len(micro) - 1:  # the accumulation boundary: the optimizer step
                        optimizer_s[name].append(time.perf_counter() - t0 - adamw_s[0])

            step()
            counter = _OpCount()
            with counter:
                step()
            ops[name] = counter.ops
            calls[name] = step
    for name in optimizer_s:
        optimizer_s[name].clear()  # the warm-up and counted steps
    times = interleaved(calls, rounds, 1)
    torch.save({"times": times, "optimizer_s": optimizer_s, "ops": ops, "params": params}, out_file)


def bench_flat(args) -> dict:
    import tempfile

    from tests.helpers.distributed import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        run_distributed(_flat_worker, 1, args.rounds, f"{tmp}/out.pt")
        r = torch.load(f"{tmp}/out.pt", weights_only=True)
    out = {}
    for model in FLAT_MODELS:
        names = [f"{model}-deepspeed", f"{model}-flat"]
        extra = {}
        for n in names:
            opt = r["optimizer_s"][n][1:]  # the interleaved warm-up round left out
            extra[n] = {
                "aten ops per step": r["ops"][n],
                "optimizer step without AdamW ms": round(statistics.median(opt) * 1e3, 2),
                "parameters": r["params"][n],
            }
        out[model] = report(
            f"training step, configs/moe-125m.yaml's structure ({model}) at width 32, bf16, "
            "2 x 4 x 64 tokens, train.flat_grad_ops",
            {n: r["times"][n] for n in names},
            names[0],
            extra=extra,
        )
    return out


def _setup_worker(rank, world, rounds, out_file):
    import contextlib
    import gc
    import io

    from deepspeed.runtime import bf16_optimizer

    from moe.parallel import deepspeed_adapter
    from moe.training.trainer import DistEnv, build_engine

    env = DistEnv(rank, world, rank, world)
    one_rank = ["parallel.world_size=1", "parallel.expert_parallel_size=1"]
    cfg = load_config("configs/moe-125m.yaml", ["parallel.zero_stage=1", *one_rank])
    deepspeed_adapter.install()
    (deepspeed_report,) = (
        f for k, f in deepspeed_adapter._ORIGINALS.items() if k.endswith(".see_memory_usage")
    )
    reports = {"deepspeed": deepspeed_report, "adapter": bf16_optimizer.see_memory_usage}
    times = {name: [] for name in reports}
    kind = None
    for _ in range(rounds + 1):  # the first round warms up (DeepSpeed's op build, imports)
        for name, report in reports.items():
            bf16_optimizer.see_memory_usage = report
            t0 = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                engine = build_engine(cfg, env)[0]
            times[name].append(time.perf_counter() - t0)
            kind = type(engine.optimizer).__name__
            engine.destroy()
            del engine
            gc.collect()
    bf16_optimizer.see_memory_usage = reports["adapter"]
    torch.save({"times": {n: t[1:] for n, t in times.items()}, "kind": kind}, out_file)


def bench_setup(args) -> dict:
    import tempfile

    from tests.helpers.distributed import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        run_distributed(_setup_worker, 1, args.rounds, f"{tmp}/out.pt")
        r = torch.load(f"{tmp}/out.pt", weights_only=True)
    return report(
        f"engine set-up, configs/moe-125m.yaml, one rank, bf16, ZeRO 1 ({r['kind']}): "
        "DeepSpeed's memory reports against the adapter's",
        r["times"],
        "adapter",
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--only",
        choices=["loss", "step", "permute", "qkv", "optimizer", "grads", "flat", "setup"],
        action="append",
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--qkv-d-model", type=int, default=768)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.rounds} interleaved rounds")
    benches = {
        "loss": bench_loss,
        "step": bench_step,
        "permute": bench_permute,
        "qkv": bench_qkv,
        "optimizer": bench_optimizer,
        "grads": bench_grads,
        "flat": bench_flat,
        "setup": bench_setup,
    }
    out = {name: benches[name](args) for name in (args.only or benches)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
