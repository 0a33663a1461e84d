"""Training throughput on one device through the real engine: tokens per second, MFU, peak
memory against the planner, and where a step's time goes.

    python benchmarks/gpu_train_bench.py                       # on a GPU: the presets below
    python benchmarks/gpu_train_bench.py --peak-flops 989e12   # name the peak yourself
    python benchmarks/gpu_train_bench.py --device cpu --tiny --steps 3   # CPU smoke run

Models (on a GPU, bf16, ZeRO 1, expert parallelism 1, one rank):
  dense-125m   configs/moe-125m.yaml with dense FFNs of the experts' active width
  moe-125m     configs/moe-125m.yaml
  largest      the largest preset in configs/ whose planned memory (moe.tools.planning) fits
               this device with expert parallelism 1 (skipped when it is moe-125m)
With ``--tiny``: the test suite's tiny shape (dense and MoE), fp32 on the CPU. ``--set KEY=VALUE``
(repeatable) changes every model's config as a ``key=value`` override of ``moe-launch`` does, for example
``--set train.compile=true`` (the block regions' shares then read 0: the ranges this script puts
around regions are dropped inside compiled blocks); ``--models`` keeps only the named rows.

Each model gets ``--warmup`` untimed steps, ``--steps`` timed ones (random tokens, one
micro-batch per step), then ``--profile-steps`` under torch.profiler. MFU is model FLOPs per
token (moe/model/size.py ``flops_per_token``, training) times tokens per second over the
device's peak dense bf16 FLOP/s (detected from the device name, or ``--peak-flops``). The time
shares add the self time (device time on a GPU, CPU time on the CPU) of the profiled operators
in each region: attention (a range this script puts around each block's attention), expert
GEMMs (the MoE layer's ``moe.experts`` range), dispatch and combine (``moe.dispatch`` and
``moe.combine``), the optimizer (a range around ``engine.step()``); backward operators count
for the region of the forward operator they differentiate (autograd sequence numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from moe.config.run import RunConfig, apply_overrides, load_config
from moe.config_schema import from_dict
from moe.errors import ConfigError
from moe.model.experts import DenseFFN
from moe.model.size import flops_per_token
from moe.tools.planning import memory_per_gpu
from moe.training.device import device_and_backend, peak_bf16_flops

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
REGIONS = ("attention", "moe.experts", "moe.dispatch", "moe.combine", "dense_ffn", "optimizer")
COLUMNS = {"attention": ("attention",), "expert GEMMs": ("moe.experts",),
           "dispatch": ("moe.dispatch", "moe.combine"), "dense FFN": ("dense_ffn",),
           "optimizer": ("optimizer",)}


def tiny_dict(dense: bool) -> dict:
    model = {"vocab_size": 512, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 64,
             "moe": {"num_experts": 4, "expert_hidden": 64, "router": {"top_k": 2}}}
    if dense:
        model["ffn"] = "dense"
    return {"name": "tiny-dense" if dense else "tiny-moe", "model": model,
            "data": {"dir": "unused", "seq_len": 32},
            "train": {"micro_batch_size": 2, "precision": "fp32"},
            "parallel": {"world_size": 1, "expert_parallel_size": 1, "zero_stage": 1}}


def one_gpu(cfg: RunConfig, micro_batch: int | None) -> RunConfig:
    # One rank, bf16, no accumulation: after --set, so that no override can change them.
    cfg.parallel.world_size, cfg.parallel.expert_parallel_size = 1, 1
    cfg.parallel.zero_stage = 1
    cfg.train.precision, cfg.train.grad_accum_steps = "bf16", 1
    if micro_batch:
        cfg.train.micro_batch_size = micro_batch
    if cfg.model.vocab_size is None:  # presets that take it from the tokenizer they train
        cfg.model.vocab_size = cfg.data.tokenizer.vocab_size
    return cfg


def planned_bytes(cfg: RunConfig) -> float:
    plan = memory_per_gpu(cfg.model, 1, 1, cfg.parallel.zero_stage, cfg.train.precision,
                          cfg.train.micro_batch_size, cfg.data.seq_len)
    return plan.total_bytes  # what moe-plan reports: states, saved activations, working set


def largest_fitting(budget_bytes: float, micro_batch: int | None,
                    overrides: list[str] = ()) -> tuple[str, RunConfig] | None:
    """The MoE pretraining preset in configs/ with the largest planned memory on one GPU with expert
    parallelism 1 that stays within ``budget_bytes`` (None if none does)."""
    fitting = []
    for path in sorted(CONFIGS.glob("*.yaml")):
        if path.stem.startswith("finetune-"):  # adapt a given base: not pretraining presets
            continue
        cfg = one_gpu(load_config(path, list(overrides)), micro_batch)
        if cfg.model.ffn == "moe" and planned_bytes(cfg) <= budget_bytes:
            fitting.append((planned_bytes(cfg), path.stem, cfg))
    if not fitting:
        return None
    _, name, cfg = max(fitting, key=lambda f: f[0])
    return name, cfg


def gpu_models(device: torch.device, micro_batch: int | None,
               overrides: list[str] = ()) -> list[tuple[str, RunConfig]]:
    preset = CONFIGS / "moe-125m.yaml"
    base = one_gpu(load_config(preset, list(overrides)), micro_batch)
    dense = one_gpu(load_config(preset, ["model.ffn=dense", *overrides]), micro_batch)
    out = [("dense-125m", dense), ("moe-125m", base)]
    largest = largest_fitting(0.9 * torch.cuda.get_device_properties(device).total_memory,
                              micro_batch, overrides)
    if largest is not None and largest[0] != "moe-125m":
        out.append(largest)
    return out


def _ranged(name: str, fn):
    def call(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)
    return call


def build(cfg: RunConfig):
    from moe.training.trainer import DistEnv, build_engine

    engine, model = build_engine(cfg, DistEnv(0, 1, 0, 1))
    for block in model.blocks:
        block.attn.forward = _ranged("attention", block.attn.forward)
        if isinstance(block.ffn, DenseFFN):
            block.ffn.forward = _ranged("dense_ffn", block.ffn.forward)
    return engine


def step(engine, cfg: RunConfig, device: torch.device) -> None:
    B, S, V = cfg.train.micro_batch_size, cfg.data.seq_len, cfg.model.vocab_size
    tokens = torch.randint(0, V, (B, S + 1))
    if device.type == "cuda":
        tokens = tokens.pin_memory()
    tokens = tokens.to(device, non_blocking=True)
    loss = engine(tokens[:, :-1], tokens[:, 1:]).loss  # the logits are freed, as in the trainer
    engine.backward(loss)
    with record_function("optimizer"):
        engine.step()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def region_shares(prof, on_gpu: bool) -> dict[str, float]:
    """Share of the profiled self time in each region (see the module docstring)."""
    def self_time(e) -> float:
        if on_gpu:
            return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        return e.self_cpu_time_total

    def region_of(e):
        while e is not None:
            if e.name in REGIONS:
                return e.name
            e = e.cpu_parent
        return None

    events = list(prof.events())
    forward = {}  # autograd sequence number of a forward operator -> its region
    for e in events:
        seq = getattr(e, "sequence_nr", -1)
        if seq >= 0 and not e.name.startswith("autograd::") and (r := region_of(e)):
            forward.setdefault(seq, r)
    totals = dict.fromkeys(REGIONS, 0.0)
    total = 0.0
    for e in events:
        t = self_time(e)
        total += t
        region = region_of(e)
        node = e
        while region is None and node is not None:  # a backward operator: its forward's region
            if node.name.startswith("autograd::engine::evaluate_function"):
                region = forward.get(getattr(node, "sequence_nr", -1))
            node = node.cpu_parent
        if region is not None:
            totals[region] += t
    return {col: sum(totals[r] for r in regions) / max(total, 1e-9)
            for col, regions in COLUMNS.items()}


def bench(name: str, cfg: RunConfig, device: torch.device, args) -> dict:
    engine = build(cfg)
    for _ in range(args.warmup):
        step(engine, cfg, device)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step(engine, cfg, device)
    sync(device)
    seconds = time.perf_counter() - t0
    peak_mem = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.profile_steps):
            step(engine, cfg, device)
        sync(device)
    tokens = args.steps * cfg.train.micro_batch_size * cfg.data.seq_len
    tok_s = tokens / seconds
    peak = args.peak_flops or peak_bf16_flops(device)
    fpt = flops_per_token(cfg.model, cfg.data.seq_len)["training"]
    return {"model": name, "tokens_per_s": tok_s, "mfu": tok_s * fpt / peak if peak else None,
            "peak_mem": peak_mem, "planned_mem": planned_bytes(cfg),
            "shares": region_shares(prof, device.type == "cuda"),
            "batch": f"{cfg.train.micro_batch_size}x{cfg.data.seq_len}"}


def table(rows: list[dict]) -> str:
    mib = lambda b: "n/a" if b is None else f"{b / 2**20:,.0f}"
    head = (f"{'model':<14} {'B x S':>9} {'tok/s':>10} {'MFU':>6} {'peak MiB':>9} {'plan MiB':>9}"
            + "".join(f" {c:>13}" for c in COLUMNS))
    lines = [head, "-" * len(head)]
    for r in rows:
        mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
        lines.append(f"{r['model']:<14} {r['batch']:>9} {r['tokens_per_s']:>10,.0f} {mfu:>6} "
                     f"{mib(r['peak_mem']):>9} {mib(r['planned_mem']):>9}"
                     + "".join(f" {r['shares'][c]:>13.1%}" for c in COLUMNS))
    return "\n".join(lines)


def one_rank_group(backend: str) -> None:
    """This process as the only rank of a process group (what DeepSpeed's engine needs)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed

    deepspeed.init_distributed(dist_backend=backend, verbose=False)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"],
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="the tiny test shape (CPU smoke run)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=None,
                   help="sequences per step (default: the preset's micro_batch_size)")
    p.add_argument("--peak-flops", type=float, default=None,
                   help="peak dense bf16 FLOP/s of the device (default: from its name)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="change every model's config (repeatable), e.g. train.compile=true")
    p.add_argument("--models", default=None, metavar="NAMES",
                   help="comma-separated rows to run (default: all)")
    p.add_argument("--json", metavar="PATH", help="also write the rows to PATH as JSON")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device visible (use --device cpu --tiny)")
    device, backend = device_and_backend(0, cuda)
    if cuda:
        torch.cuda.set_device(device)
    try:
        if args.tiny:
            models = [(d["name"], from_dict(RunConfig, apply_overrides(d, args.overrides),
                                            source="--tiny"))
                      for d in (tiny_dict(True), tiny_dict(False))]
        else:
            models = gpu_models(device, args.micro_batch, args.overrides)
    except ConfigError as e:
        p.error(f"--set: {e}")
    if args.models:
        wanted = args.models.split(",")
        unknown = sorted(set(wanted) - {name for name, _ in models})
        if unknown:
            p.error(f"--models: no row {', '.join(unknown)} here (rows: "
                    f"{', '.join(name for name, _ in models)})")
        models = [(name, cfg) for name, cfg in models if name in wanted]
    one_rank_group(backend)
    import torch.distributed as dist

    rows = []
    try:
        for name, cfg in models:
            rows.append(bench(name, cfg, device, args))
            if cuda:
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    where = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(f"device: {where}; {args.steps} timed steps after {args.warmup} warm-up; time shares "
          f"from {args.profile_steps} profiled steps"
          + (f"; --set {' '.join(args.overrides)}" if args.overrides else ""))
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": where, "steps": args.steps,
                                               "overrides": args.overrides, "rows": rows},
                                              indent=2))
    return rows


if __name__ == "__main__":
    main()
