"""Does MoE earn its FLOPs? A dense baseline against MoE variants at equal active parameters
and equal tokens, each trained by the real entry point (``python -m launch.train``, one rank,
the run config of ``--config`` with overrides), several seeds, validation every ``--eval-every``
steps.

Prints, per variant: the final validation loss (mean and spread over seeds), the step at which
the seed-mean validation curve first reaches the dense model's final validation loss, as a
fraction of the dense run's steps (interpolated linearly between evaluations), and the median
step time relative to dense. Writes a PNG of validation loss against steps and the numbers as
JSON. The validation losses are read back from each run's TensorBoard events.

    python -m launch.prepare configs/default.yaml            # data/stdlib, once
    python -m benchmarks.quality_bench --variants moe global_balance experts16 --seeds 3
    python -m benchmarks.quality_bench --quick --variants moe top1     # a minute or two

The levers are measured against a plain MoE of the config's active FFN width A = (top_k +
shared experts) x expert_hidden: 8 experts of width A/2, top-2, no shared expert, the top-k
weights not renormalized, one learning rate (:func:`plain_moe`). The dense baseline is
``model.ffn: dense`` of width A. Every variant keeps A (``variant_overrides``); ``recipe`` is
the config's own MoE settings (the default config's: fine-grained experts with a shared expert,
renormalized weights, twice the experts' learning rate).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from moe.config.run import load_config
from moe.core.run_dir import RunDir

# Tiny model and run for --quick (exploration, not measurement).
QUICK = [
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.max_seq_len=64",
    "model.moe.expert_hidden=64",
    "data.seq_len=64",
    "train.micro_batch_size=4",
    "train.warmup_steps=2",
    "eval.max_tokens=4096",
]

VARIANTS = [
    "dense",
    "moe",
    "recipe",
    "renormalize",
    "global_balance",
    "loss_free",
    "loss_free_plus_aux",
    "zloss",
    "router_init_small",
    "router_init_large",
    "router_lr_small",
    "router_lr_large",
    "expert_lr_large",
    "expert_lr_x4",
    "fine_grained_shared",
    "fine_grained32_shared",
    "experts16",
    "experts32",
    "experts64",
    "top1",
    "capacity",
]


def variant_overrides(name: str, expert_hidden: int, top_k: int) -> list[str]:
    """Overrides of one variant, relative to the base config (an MoE with ``top_k`` experts of
    width ``expert_hidden`` per token). Every variant keeps the active FFN width
    ``top_k * expert_hidden``."""
    r = "model.moe.router."
    if "+" in name:  # a combination: the parts' overrides, later ones winning
        return [
            o for part in name.split("+") for o in variant_overrides(part, expert_hidden, top_k)
        ]
    if name == "fine_grained_shared":
        # Experts half as wide; twice as many routed per token minus one, plus one always-on
        # shared expert: (2 * top_k - 1 + 1) * expert_hidden / 2 = top_k * expert_hidden.
        if expert_hidden % 2:
            raise SystemExit(
                f"fine_grained_shared needs an even expert_hidden, got {expert_hidden}"
            )
        return [
            "model.moe.num_experts=16",
            f"model.moe.expert_hidden={expert_hidden // 2}",
            f"{r}top_k={2 * top_k - 1}",
            "model.moe.num_shared_experts=1",
        ]
    if name == "fine_grained32_shared":
        # Experts a quarter as wide, 4 * top_k - 2 routed per token, plus a shared expert half
        # as wide as the base experts (two of the quarter width): for top-2 of width h, 6 of h/4
        # plus h/2 shared (the DeepSeekMoE shape).
        if expert_hidden % 4:
            raise SystemExit(
                f"fine_grained32_shared needs expert_hidden divisible by 4, got {expert_hidden}"
            )
        return [
            "model.moe.num_experts=32",
            f"model.moe.expert_hidden={expert_hidden // 4}",
            f"{r}top_k={4 * top_k - 2}",
            "model.moe.num_shared_experts=2",
        ]
    if name == "top1":
        return [f"{r}top_k=1", f"model.moe.expert_hidden={expert_hidden * top_k}"]
    table = {
        "dense": ["model.ffn=dense"],
        "moe": [],  # the plain base: micro-batch aux loss
        "recipe": [],  # main() puts the config's own MoE settings back (see plain_moe)
        "renormalize": [f"{r}renormalize=true"],  # the selected weights sum to 1
        "global_balance": [f"{r}aux_loss_scope=global_batch"],
        "loss_free": [f"{r}aux_loss_coef=0.0", f"{r}bias_update_rate=0.001"],
        "loss_free_plus_aux": [f"{r}bias_update_rate=0.001"],
        "zloss": [f"{r}z_loss_coef=0.001"],
        "router_init_small": [f"{r}init_std=0.002"],
        "router_init_large": [f"{r}init_std=0.2"],
        "router_lr_small": ["train.router_lr_scale=0.1"],
        "router_lr_large": ["train.router_lr_scale=3.0"],
        "expert_lr_large": ["train.expert_lr_scale=2.0"],
        "expert_lr_x4": ["train.expert_lr_scale=4.0"],
        "experts16": ["model.moe.num_experts=16"],
        "experts32": ["model.moe.num_experts=32"],
        "experts64": ["model.moe.num_experts=64"],
        "capacity": ["model.moe.capacity_factor=1.25"],
    }
    return table[name]


def plain_moe(moe, train) -> tuple[list[str], list[str], int]:
    """Overrides that make the config's MoE the plain 8-expert top-2 baseline of the same active
    width, overrides that restore the config's own MoE settings (the ``recipe`` variant), and
    the plain experts' width."""
    active = (moe.router.top_k + moe.num_shared_experts) * moe.expert_hidden
    if active % 2:
        raise SystemExit(
            f"the active FFN width {active} must be even (8 experts of half of it, top-2)"
        )
    r = "model.moe.router."
    plain = [
        "model.moe.num_experts=8",
        f"model.moe.expert_hidden={active // 2}",
        "model.moe.num_shared_experts=0",
        f"{r}top_k=2",
        f"{r}renormalize=false",
        "train.expert_lr_scale=1.0",
    ]
    recipe = [
        f"model.moe.num_experts={moe.num_experts}",
        f"model.moe.expert_hidden={moe.expert_hidden}",
        f"model.moe.num_shared_experts={moe.num_shared_experts}",
        f"{r}top_k={moe.router.top_k}",
        f"{r}renormalize={str(moe.router.renormalize).lower()}",
        f"train.expert_lr_scale={train.expert_lr_scale}",
    ]
    return plain, recipe, active // 2


def variant_name(name: str) -> str:
    unknown = [part for part in name.split("+") if part not in VARIANTS or part == "dense"]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown variant {', '.join(unknown)}; choose from "
            f"{', '.join(v for v in VARIANTS if v != 'dense')}"
        )
    return name


def run_one(config: str, overrides: list[str], run_dir: Path, log_file: Path) -> None:
    """One training run through moe-train's entry point, as a single rank."""
    env = dict(os.environ)
    for key in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        env.pop(key, None)  # a single rank with its own rendezvous
    cmd = [
        sys.executable,
        "-m",
        "launch.train",
        "--config",
        config,
        "--resume",
        "none",
        *overrides,
        f"output_dir={run_dir.parent}",
        f"name={run_dir.name}",
    ]
    with open(log_file, "w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if done.returncode:
        raise SystemExit(f"training failed ({done.returncode}): {' '.join(cmd)}; see {log_file}")


def _same_overrides(run_dir: Path, overrides: list[str]) -> bool:
    recorded = run_dir / "bench_overrides.json"
    return recorded.exists() and json.loads(recorded.read_text()) == overrides


def read_run(run_dir: Path) -> dict:
    """Validation curve and step times from the run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(RunDir(run_dir).tensorboard), size_guidance={"scalars": 0})
    acc.Reload()
    valid = [(e.step, e.value) for e in acc.Scalars("valid/loss")]
    # Step 1 includes one-off start-up work; the median of the rest is the step time.
    times = [e.value for e in acc.Scalars("train/step_time_s") if e.step > 1]
    return {
        "steps": [s for s, _ in valid],
        "valid_loss": [v for _, v in valid],
        "step_time_s": statistics.median(times) if times else math.nan,
    }


def first_crossing(steps: list[int], losses: list[float], target: float) -> float | None:
    """The first step where the curve reaches ``target``, linear between evaluations."""
    prev = None
    for s, v in zip(steps, losses):
        if v <= target:
            if prev is None:
                return float(s)
            (s0, v0) = prev
            return s0 + (s - s0) * (v0 - target) / (v0 - v)
        prev = (s, v)
    return None


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Per variant: final loss mean/spread, the crossing of dense's final loss, time ratio."""
    dense = runs["dense"]
    dense_steps = dense[0]["steps"][-1]
    dense_final = statistics.mean(r["valid_loss"][-1] for r in dense)
    dense_time = statistics.mean(r["step_time_s"] for r in dense)
    out = {}
    for name, seeds in runs.items():
        finals = [r["valid_loss"][-1] for r in seeds]
        steps = seeds[0]["steps"]
        mean_curve = [statistics.mean(r["valid_loss"][i] for r in seeds) for i in range(len(steps))]
        cross = first_crossing(steps, mean_curve, dense_final)
        out[name] = {
            "final_mean": statistics.mean(finals),
            "final_std": statistics.pstdev(finals),
            "steps_to_dense_ratio": None if cross is None else cross / dense_steps,
            "step_time_ratio": statistics.mean(r["step_time_s"] for r in seeds) / dense_time,
            "steps": steps,
            "mean_curve": mean_curve,
            "seeds": len(seeds),
        }
    return out


def table(summary: dict) -> str:
    lines = [
        f"{'variant':<22} {'final valid loss':>22} {'steps to dense final':>21} "
        f"{'step time / dense':>18}"
    ]
    for name, s in summary.items():
        ratio = (
            "not reached"
            if s["steps_to_dense_ratio"] is None
            else f"{s['steps_to_dense_ratio']:.3f}"
        )
        final = f"{s['final_mean']:.4f} +- {s['final_std']:.4f}"
        lines.append(f"{name:<22} {final:>22} {ratio:>21} {s['step_time_ratio']:>18.3f}")
    return "\n".join(lines)


def plot(summary: dict, runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, s in summary.items():
        (line,) = ax.plot(s["steps"], s["mean_curve"], marker="o", ms=3, label=name)
        for r in runs[name]:  # each seed, faint
            ax.plot(r["steps"], r["valid_loss"], color=line.get_color(), alpha=0.25, lw=0.8)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation loss")
    ax.set_title("validation loss, mean over seeds (faint: each seed)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument(
        "--variants",
        nargs="+",
        default=["moe", "global_balance"],
        type=variant_name,
        help="MoE variants to compare with the dense baseline (always run): "
        f"{', '.join(v for v in VARIANTS if v != 'dense')}, or several joined "
        "by '+' (their overrides combined, e.g. renormalize+expert_lr_large)",
    )
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: config's)")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument(
        "--quick",
        action="store_true",
        help="a tiny model, 40 steps, validation every 10: exploration, not a result",
    )
    p.add_argument("--out", default="quality_bench", help="folder for runs, PNG and JSON")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at a time, each with cores / jobs threads; step times are then "
        "measured on a shared machine (compare them only at --jobs 1)",
    )
    p.add_argument(
        "--reuse",
        action="store_true",
        help="read runs already finished under --out (same overrides) instead of "
        "training them again",
    )
    p.add_argument("overrides", nargs="*", help="key=value applied to every run")
    return p.parse_args(argv)


def _jobs(args, base, common: list[str]) -> list[tuple[str, int, list[str]]]:
    """(variant, seed, overrides) of every run: the dense baseline and each variant per seed."""
    plain, recipe, hidden = plain_moe(base.model.moe, base.train)
    jobs = []
    for name in ["dense", *args.variants]:
        parts = name.split("+")
        overrides = [
            *plain,
            *(recipe if "recipe" in parts else []),
            *variant_overrides(name, hidden, 2),
        ]
        for seed in range(args.seeds):
            jobs.append((name, seed, [*common, *overrides, f"train.seed={seed}"]))
    if args.jobs > 1:  # each concurrent run gets its share of the cores
        threads = max(1, (base.train.threads_per_rank or os.cpu_count() or 1) // args.jobs)
        jobs = [(n, s, [*o, f"train.threads_per_rank={threads}"]) for n, s, o in jobs]
    return jobs


def _train_all(args, jobs: list[tuple[str, int, list[str]]], out: Path) -> dict[str, list[dict]]:
    """Every job trained (or, with --reuse, read back when it finished with the same overrides),
    --jobs at a time; each variant's runs in seed order."""

    def one(job) -> dict:
        name, seed, overrides = job
        run_dir = out / "runs" / f"{name}-seed{seed}"
        done = RunDir(run_dir).summary
        if not (args.reuse and done.exists() and _same_overrides(run_dir, overrides)):
            print(f"training {name} seed {seed} ...", flush=True)
            shutil.rmtree(run_dir, ignore_errors=True)  # no events of an earlier run mixed in
            run_one(args.config, overrides, run_dir, out / f"{name}-seed{seed}.log")
            (run_dir / "bench_overrides.json").write_text(json.dumps(overrides))
        return read_run(run_dir)

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(one, jobs))
    runs: dict[str, list[dict]] = {}
    for (name, _, _), result in zip(jobs, results):
        runs.setdefault(name, []).append(result)
    return runs


def main(argv=None) -> dict:
    args = _args(argv)

    steps, every = args.steps, args.eval_every
    common = list(QUICK) if args.quick else []
    if args.quick:
        steps, every = steps or 40, 10
    common += args.overrides
    base = load_config(args.config, common)
    steps = steps or base.train.max_steps
    common += [
        "parallel.world_size=1",
        "parallel.expert_parallel_size=1",
        # Curves on the split eval.max_tokens says (the whole one but in --quick), not
        # the default demo's bounded validation during training.
        f"train.max_steps={steps}",
        f"eval.every_n_steps={every}",
        "eval.in_training_max_tokens=null",
        f"logging.log_every={max(1, min(10, every))}",
        "checkpoint.every_n_steps=0",
        "train.threads_per_rank=" + str(base.train.threads_per_rank or os.cpu_count() or 1),
    ]
    jobs = _jobs(args, base, common)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = _train_all(args, jobs, out)
    summary = summarize(runs)
    if args.jobs > 1:
        print(
            f"(--jobs {args.jobs}: runs shared the machine; step-time ratios are indicative only)"
        )
    print(
        f"\n{steps} steps, {args.seeds} seed(s), validation every {every} steps"
        f"{' (--quick: a smoke run, not a measurement)' if args.quick else ''}"
    )
    print(table(summary))
    plot(summary, runs, out / "validation_loss.png")
    (out / "results.json").write_text(json.dumps({"summary": summary, "runs": runs}, indent=2))
    print(f"wrote {out / 'validation_loss.png'} and {out / 'results.json'}")
    return summary


if __name__ == "__main__":
    main()
