"""Training throughput on one device through the real engine: tokens per second, MFU, peak
memory against the planner, and where a step's time goes.

    python benchmarks/gpu_train_bench.py                       # on a GPU: the models below
    python benchmarks/gpu_train_bench.py --profile-out DIR     # and a step profile per model
    python benchmarks/gpu_train_bench.py --device cpu --tiny --steps 3   # CPU smoke run

Models (on a GPU, bf16, ZeRO 1, expert parallelism 1, one rank, with the settings a training
run on the device takes for what the config leaves to it: on CUDA its defaults, docs/gpu.md):
  dense-125m   configs/moe-125m.yaml with dense FFNs of the experts' active width
  moe-125m     configs/moe-125m.yaml
  dense-1b     configs/moe-1b.yaml with dense FFNs (equal active parameters), and
  moe-1b       configs/moe-1b.yaml: both when moe-plan fits them in 90% of the device
  largest      the largest preset in configs/ whose planned memory (moe.tools.planning) fits
               this device with expert parallelism 1 (skipped when it is one of the above)
With ``--tiny``: the test suite's tiny shape (dense and MoE), fp32 on the CPU. ``--set KEY=VALUE``
(repeatable) changes every model's config as a ``key=value`` override of ``moe-launch`` does
(``--set train.compile=true``; ``parallel.zero_stage`` and ``train.grad_accum_steps`` too,
which are 1 and 1 otherwise), plus four knobs of the bench:
``bench.expert_kernel=loop`` runs the experts' per-expert loop instead of the grouped GEMM,
``bench.doc_len=N`` the mean document length of the packed batches when
``model.document_masking`` is on (default 512), ``bench.step_read=false`` leaves out the
trainer's read of each step's loss and gradient norm, and ``bench.finetune=METHOD`` trains the
preset as that fine-tuning method does (adapters on its fresh weights, the rest frozen;
benchmarks/bench_steps.py, Knobs). ``--models`` keeps only the named rows.

Each model gets ``--warmup`` untimed steps, ``--steps`` timed ones (random tokens, one
optimizer step of ``train.grad_accum_steps`` micro-batches each), then ``--profile-steps`` under torch.profiler, summarised by
benchmarks/profile_summary.py: the table's region shares are shares of device time (CPU time of
the leaf operators on the CPU), and ``--profile-out DIR`` writes DIR/profile.md and
DIR/profile.json (merged with what DIR holds: one entry per model and setting), with the host
syncs of ``--sync-steps`` more steps counted under ``torch.cuda.set_sync_debug_mode``. MFU is
model FLOPs per token (moe/model/size.py ``flops_per_token``, training) times tokens per second
over the device's peak dense bf16 FLOP/s (from its name, or ``--peak-flops``); with
``bench.finetune`` too (a frozen weight's gradient is not formed, so there the figure counts
FLOPs the step skips: compare such rows by tokens per second; each row records its method and
trainable parameters).

``--serve`` makes this a worker of benchmarks/gpu_speed_matrix.py: one JSON task per line on
stdin, one JSON result per line on the original stdout (everything else goes to stderr).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_steps import (
    Knobs,
    expert_kernel,
    gemm_dims,
    profile_entry,
    split_knobs,
    step,
    sync,
    with_finetune,
)
from profile_summary import REGIONS, write_profiles

from moe.config.run import RunConfig, apply_overrides, load_config
from moe.core.config_schema import from_dict
from moe.core.errors import ConfigError
from moe.model.size import flops_per_token
from moe.tools.planning import memory_per_gpu
from moe.training.device import device_and_backend, peak_bf16_flops

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PAIRS = {"125m": "moe-125m", "1b": "moe-1b"}
"""Size -> the MoE preset; ``dense-SIZE`` is that preset with ``model.ffn=dense``."""
SHORT = {
    "attention": "attn",
    "expert GEMMs": "experts",
    "dense FFN & shared": "ffn",
    "permute & combine": "permute",
    "router": "router",
    "norms & elementwise": "norm+elt",
    "head & loss": "head",
    "optimizer": "optim",
    "communication": "comm",
    "other": "other",
}


def tiny_dict(dense: bool) -> dict:
    model = {
        "vocab_size": 512,
        "d_model": 64,
        "n_layers": 2,
        "n_heads": 4,
        "max_seq_len": 64,
        "moe": {"num_experts": 4, "expert_hidden": 64, "router": {"top_k": 2}},
    }
    if dense:
        model["ffn"] = "dense"
    return {
        "name": "tiny-dense" if dense else "tiny-moe",
        "model": model,
        "data": {"dir": "unused", "seq_len": 32},
        "train": {"micro_batch_size": 2, "precision": "fp32"},
        "parallel": {"world_size": 1, "expert_parallel_size": 1, "zero_stage": 1},
    }


def one_gpu(cfg: RunConfig, micro_batch: int | None, overrides: list[str] = ()) -> RunConfig:
    # One rank, bf16: after --set, so that no override can change them; ZeRO 1 and no
    # accumulation unless --set names a stage or train.grad_accum_steps (a step is then that
    # many micro-batches and one optimizer step, as the presets train).
    cfg.parallel.world_size, cfg.parallel.expert_parallel_size = 1, 1
    named = {o.split("=", 1)[0].strip() for o in overrides}
    if "parallel.zero_stage" not in named:
        cfg.parallel.zero_stage = 1
    if "train.grad_accum_steps" not in named:
        cfg.train.grad_accum_steps = 1
    cfg.train.precision = "bf16"
    if micro_batch:
        cfg.train.micro_batch_size = micro_batch
    if cfg.model.vocab_size is None:  # presets that take it from the tokenizer they train
        cfg.model.vocab_size = cfg.data.tokenizer.vocab_size
    return cfg


def planned_bytes(cfg: RunConfig, device_type: str = "cuda") -> float:
    """moe-plan's total for ``cfg`` as a run on ``device_type`` takes it (the settings the
    config leaves to the device resolved for it)."""
    cfg = cfg.for_device(device_type)
    t = cfg.train
    plan = memory_per_gpu(
        cfg.model,
        1,
        1,
        cfg.parallel.zero_stage,
        t.precision,
        t.micro_batch_size,
        cfg.data.seq_len,
        t.recompute,
        t.recompute_every_n_blocks,
        t.immediate_grad_update,
        t.compile,
    )
    return plan.total_bytes  # what moe-plan reports: states, saved activations, working set


def preset(name: str, micro_batch: int | None, overrides: list[str] = ()) -> RunConfig:
    """A row's config: ``moe-SIZE`` is configs/moe-SIZE.yaml, ``dense-SIZE`` the same with dense
    FFNs, anything else configs/NAME.yaml; on one GPU (see one_gpu)."""
    size = name.split("-", 1)[-1]
    path = CONFIGS / f"{PAIRS.get(size, name)}.yaml"
    extra = ["model.ffn=dense"] if name.startswith("dense-") and size in PAIRS else []
    return one_gpu(load_config(path, [*extra, *overrides]), micro_batch, overrides)


def largest_fitting(
    budget_bytes: float, micro_batch: int | None, overrides: list[str] = ()
) -> tuple[str, RunConfig] | None:
    """The MoE pretraining preset in configs/ with the largest planned memory on one GPU with expert
    parallelism 1 that stays within ``budget_bytes`` (None if none does)."""
    fitting = []
    for path in sorted(CONFIGS.glob("*.yaml")):
        if path.stem.startswith("finetune-"):  # adapt a given base: not pretraining presets
            continue
        cfg = one_gpu(load_config(path, list(overrides)), micro_batch, overrides)
        if cfg.model.ffn == "moe" and planned_bytes(cfg) <= budget_bytes:
            fitting.append((planned_bytes(cfg), path.stem, cfg))
    if not fitting:
        return None
    _, name, cfg = max(fitting, key=lambda f: f[0])
    return name, cfg


def gpu_models(
    budget_bytes: float, micro_batch: int | None, overrides: list[str] = ()
) -> list[tuple[str, RunConfig]]:
    out = []
    for size in PAIRS:
        pair = [
            (f"{kind}-{size}", preset(f"{kind}-{size}", micro_batch, overrides))
            for kind in ("dense", "moe")
        ]
        if size == "125m" or all(planned_bytes(cfg) <= budget_bytes for _, cfg in pair):
            out += pair
    largest = largest_fitting(budget_bytes, micro_batch, overrides)
    if largest is not None and largest[0] not in {name for name, _ in out}:
        out.append(largest)
    return out


def tiny_models(overrides: list[str]) -> list[tuple[str, RunConfig]]:
    return [
        (d["name"], from_dict(RunConfig, apply_overrides(d, overrides), source="--tiny"))
        for d in (tiny_dict(True), tiny_dict(False))
    ]


def build(cfg: RunConfig):
    from moe.training.trainer import DistEnv, build_engine

    engine, _ = build_engine(cfg, DistEnv(0, 1, 0, 1))
    return engine


def trainable_params(engine) -> int | None:
    """Elements of the parameters that train (a fine-tuning method freezes the others)."""
    module = getattr(engine, "module", None)
    if module is None:
        return None
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def compile_counts() -> tuple[int, int]:
    """Graphs dynamo compiled and graph breaks it met in this process so far."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    if dynamo is None:
        return 0, 0
    c = dynamo.counters
    return c["stats"]["unique_graphs"], sum(c["graph_break"].values())


def bench(
    name: str, cfg: RunConfig, device: torch.device, args, knobs: Knobs, label: str = ""
) -> tuple[dict, dict | None]:
    """One model: its row of the table and, with profiled steps, its profile summary. ``cfg``
    runs with the settings it leaves to the device as a training run on ``device`` takes them
    (the row's ``device_settings``)."""
    cfg = with_finetune(cfg, knobs)
    row, entry = _measure(name, cfg.for_device(device.type), device, args, knobs, label)
    return {**row, "device_settings": cfg.device_choices(device.type)}, entry


def _measure(
    name: str, cfg: RunConfig, device: torch.device, args, knobs: Knobs, label: str
) -> tuple[dict, dict | None]:
    engine = None
    try:
        with expert_kernel(knobs.expert_kernel):
            t0 = time.perf_counter()
            engine = build(cfg)
            trainable = trainable_params(engine)
            t1 = time.perf_counter()
            for _ in range(args.warmup):
                step(engine, cfg, device, knobs)
            sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            graphs, breaks = compile_counts()
            t2 = time.perf_counter()
            for _ in range(args.steps):
                step(engine, cfg, device, knobs)
            sync(device)
            seconds = time.perf_counter() - t2
            graphs_timed = compile_counts()[0] - graphs
            peak_mem, peak_reserved = memory_peaks(device)
            t = cfg.train
            tok_s = (
                args.steps * t.grad_accum_steps * t.micro_batch_size * cfg.data.seq_len / seconds
            )
            peak = args.peak_flops or peak_bf16_flops(device)
            fpt = flops_per_token(cfg.model, cfg.data.seq_len)["training"]
            mfu = tok_s * fpt / peak if peak else None
            entry, profile_error = None, None
            if args.profile_steps:
                try:
                    entry = profile_entry(
                        engine,
                        cfg,
                        device,
                        knobs,
                        args.profile_steps,
                        args.sync_steps,
                        seconds / args.steps,
                        gemm_dims(cfg),
                        {
                            "model": name,
                            "setting": label or "default",
                            "device": device_name(device),
                            "tokens_per_s": tok_s,
                            "mfu": mfu,
                        },
                    )
                except Exception as e:  # the timed figures stand without their profile
                    traceback.print_exc()
                    profile_error = f"{type(e).__name__}: {e}"[:300]
    finally:
        _destroy(engine)
        engine = None
        _collect(device)  # before the next engine is built in this process
    row = {
        "model": name,
        "tokens_per_s": tok_s,
        "mfu": mfu,
        "peak_mem": peak_mem,
        "peak_reserved": peak_reserved,
        "planned_mem": planned_bytes(cfg, device.type),
        "step_ms": 1000 * seconds / args.steps,
        "batch": batch_shape(cfg),
        "shares": {r: s for r, _, s, _ in entry["regions"]} if entry else {},
        "build_s": t1 - t0,
        "warmup_s": t2 - t1,
        "timed_s": seconds,
        "graphs": graphs,
        "graph_breaks": breaks,
        "graphs_in_timed_steps": graphs_timed,
        "profile_error": profile_error,
        "finetune": cfg.finetune.method,
        "trainable_params": trainable,
    }
    return row, entry


def _destroy(engine) -> None:
    destroy = getattr(engine, "destroy", None)
    if callable(destroy):
        destroy()


def _collect(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def batch_shape(cfg: RunConfig) -> str:
    """B x S of a micro-batch, with the micro-batches of a step in front when more than one."""
    t = cfg.train
    accum = f"{t.grad_accum_steps}x" if t.grad_accum_steps > 1 else ""
    return f"{accum}{t.micro_batch_size}x{cfg.data.seq_len}"


def memory_peaks(device: torch.device) -> tuple[int | None, int | None]:
    """The allocated and the reserved peak since the last reset (None off CUDA). CUDA graphs
    replay into their private pool without going through the allocator: what the pool holds
    shows in the reserved memory, not in the allocated peak."""
    if device.type != "cuda":
        return None, None
    return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def table(rows: list[dict]) -> str:
    mib = lambda b: "n/a" if b is None else f"{b / 2**20:,.0f}"
    head = (
        f"{'model':<12} {'B x S':>9} {'tok/s':>10} {'MFU':>6} {'peak MiB':>9} {'plan MiB':>9}"
        + "".join(f" {SHORT[r]:>8}" for r in REGIONS)
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
        shares = "".join(
            f" {r['shares'][g]:>8.1%}" if g in r["shares"] else f" {'-':>8}" for g in REGIONS
        )
        lines.append(
            f"{r['model']:<12} {r['batch']:>9} {r['tokens_per_s']:>10,.0f} {mfu:>6} "
            f"{mib(r['peak_mem']):>9} {mib(r['planned_mem']):>9}{shares}"
        )
    return "\n".join(lines)


def one_rank_group(backend: str) -> None:
    """This process as the only rank of a process group (what DeepSpeed's engine needs)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import deepspeed

    deepspeed.init_distributed(dist_backend=backend, verbose=False)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--tiny", action="store_true", help="the tiny test shape (CPU smoke run)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument(
        "--sync-steps",
        type=int,
        default=1,
        help="steps whose host syncs are counted, after the profiled ones (CUDA)",
    )
    p.add_argument(
        "--profile-out",
        metavar="DIR",
        help="write DIR/profile.md and DIR/profile.json (see the docstring)",
    )
    p.add_argument(
        "--label",
        default="",
        help="the setting's name in the profile (default: the --set overrides)",
    )
    p.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="sequences per step (default: the preset's micro_batch_size)",
    )
    p.add_argument(
        "--peak-flops",
        type=float,
        default=None,
        help="peak dense bf16 FLOP/s of the device (default: from its name)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change every model's config (repeatable), e.g. train.compile=true",
    )
    p.add_argument(
        "--models", default=None, metavar="NAMES", help="comma-separated rows to run (default: all)"
    )
    p.add_argument("--json", metavar="PATH", help="also write the rows to PATH as JSON")
    p.add_argument("--serve", action="store_true", help="a worker of gpu_speed_matrix.py")
    args = p.parse_args(argv)
    if args.profile_out and not args.profile_steps:
        p.error("--profile-out needs --profile-steps >= 1")
    return p, args


def main(argv=None) -> list[dict]:
    p, args = parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device visible (use --device cpu --tiny)")
    device, backend = device_and_backend(0, cuda)
    if cuda:
        torch.cuda.set_device(device)
    if args.serve:
        from bench_worker import serve

        proto = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)  # from here on, what anything prints goes to stderr, not the protocol
        one_rank_group(backend)
        serve(device, args, proto)
        return []
    try:
        overrides, knobs = split_knobs(args.overrides)
        if args.tiny:
            models = tiny_models(overrides)
        else:
            memory = torch.cuda.get_device_properties(device).total_memory if cuda else 2**40
            models = gpu_models(0.9 * memory, args.micro_batch, overrides)
    except ConfigError as e:
        p.error(f"--set: {e}")
    if args.models:
        wanted = args.models.split(",")
        unknown = sorted(set(wanted) - {name for name, _ in models})
        if unknown:
            p.error(
                f"--models: no row {', '.join(unknown)} here (rows: "
                f"{', '.join(name for name, _ in models)})"
            )
        models = [(name, cfg) for name, cfg in models if name in wanted]
    one_rank_group(backend)
    import torch.distributed as dist

    rows, where = [], device_name(device)
    label = args.label or " ".join(args.overrides) or "default"
    try:
        for name, cfg in models:
            row, entry = bench(name, cfg, device, args, knobs, label)
            rows.append(row)
            if entry is not None and args.profile_out:
                write_profiles(args.profile_out, [entry])
            if args.json:  # after every model: a run cut short keeps the rows it finished
                Path(args.json).write_text(
                    json.dumps(
                        {
                            "device": where,
                            "steps": args.steps,
                            "overrides": args.overrides,
                            "rows": [{"device": where, **r} for r in rows],
                        },
                        indent=2,
                    )
                )
    finally:
        dist.destroy_process_group()
    print(
        f"device: {where}; {args.steps} timed steps after {args.warmup} warm-up; time shares "
        f"from {args.profile_steps} profiled steps"
        + (f"; --set {' '.join(args.overrides)}" if args.overrides else "")
    )
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
