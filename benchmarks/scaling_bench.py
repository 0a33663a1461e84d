"""Does the scaling law predict? Dense and the default MoE recipe on the installed packages'
docstrings and comments (or the standard library's).

For each seed: a sweep (``moe-scaling plan``) of --sizes shapes per budget and family, run
through the real launcher; the laws are fitted on every budget but the largest; the predicted
compute-optimal run of the largest budget (the ladder shape the law ranks best at that budget,
its tokens spending the budget) is trained; then, per family, the law's loss at that run's N and
D against its measured final validation loss, whether the measured best size of the largest budget lies inside
the predicted 95% interval, and the MoE/dense compute multiplier of each budget (median and spread
over the seeds). Prints one table and the whole benchmark's time.

    python benchmarks/scaling_bench.py --out /tmp/sb     # defaults below: 2 seeds x 30 runs

Defaults: budgets 5e11, 1.6e12, 5e12; 5 sizes per budget and family; a 1,024-token vocabulary
(so that the output head does not dominate N at the small widths); one rank per run with the
config's global batch. Time on 2 CPU cores grows with the optimizer steps of the sweep (about
0.06 s per step at these widths on one rank) plus about 12 s of start-up and evaluation per
run."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from launch.scaling import predicted_run  # noqa: E402
from launch.scaling_sweep import results  # noqa: E402
from moe.core.run_dir import RunDir  # noqa: E402
from moe.tools import scaling, scaling_fit, scaling_report  # noqa: E402


def sh(*args) -> str:
    out = subprocess.run(
        [sys.executable, "-m", *map(str, args)], cwd=ROOT, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise SystemExit(
            f"{' '.join(map(str, args))} failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}"
        )
    return out.stdout


def final_loss(run_dir: Path) -> float:
    summary = json.loads(RunDir(run_dir).summary.read_text())
    report = json.loads((Path(summary["checkpoint"]) / "eval" / "eval.json").read_text())
    return float(report["checkpoints"][-1]["loss"])


EVAL_TOKENS = 150_000
"""Validation tokens each run is evaluated on (the same first tokens of the split for every run;
the packages corpus holds about 630,000)."""


def corpus_config(args) -> str:
    """The run config of the sweep: ``--config`` evaluated on its first EVAL_TOKENS validation
    tokens, with, for ``--corpus packages``, the docstrings and comments of every installed
    package (``type: python`` over site-packages) in place of the standard library's: a corpus
    about 12 times larger, so that no run of the sweep repeats data."""
    cfg = yaml.safe_load(Path(args.config).read_text())
    cfg.setdefault("eval", {})["max_tokens"] = args.eval_tokens
    if args.vocab:
        # A small vocabulary keeps the output head from dominating N at the ladder's small
        # widths (with 4,096 tokens it is 80% of N at width 32).
        cfg["data"]["tokenizer"]["vocab_size"] = args.vocab
    cfg["data"]["dir"] = str(Path(args.out) / "data")  # prepared for this sweep's vocabulary
    par, train = cfg["parallel"], cfg["train"]
    if args.ranks != par["world_size"]:
        # The same global batch on another number of ranks: at these widths one rank with both
        # cores steps faster than two exchanging every expert's tokens.
        global_batch = train["micro_batch_size"] * par["world_size"]
        if global_batch % args.ranks:
            raise SystemExit(
                f"--ranks {args.ranks}: does not divide the global batch of "
                f"{global_batch} sequences"
            )
        train["micro_batch_size"] = global_batch // args.ranks
        par["world_size"] = args.ranks
        par["expert_parallel_size"] = min(par.get("expert_parallel_size", 1), args.ranks)
    if args.corpus == "packages":
        cfg["data"]["sources"] = [
            {"name": "packages", "type": "python", "paths": [sysconfig.get_paths()["purelib"]]}
        ]
    out = Path(args.out) / "config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return str(out)


def seed_sweep(args, seed: int) -> tuple[Path, list[dict], float]:
    """Plan (once) and run seed ``seed``'s sweep: its folder, its finished runs and the largest
    budget, which must have a finished run below it to fit."""
    sweep = Path(args.out) / f"seed{seed}"
    if not (sweep / "sweep.json").exists():
        sh(
            "launch.scaling",
            "plan",
            corpus_config(args),
            f"train.seed={seed}",
            f"name=scaling-s{seed}",
            "--budgets",
            args.budgets,
            "--sizes",
            args.sizes,
            "--families",
            "dense,moe",
            "--min-steps",
            args.min_steps,
            "--out",
            sweep,
        )
    sh("launch.scaling", "run", sweep, "--jobs", args.jobs)
    rows = results(sweep)
    largest = max(r["budget"] for r in rows)
    if not any(r["budget"] < largest for r in rows):
        raise SystemExit(f"{sweep}: no finished run below the largest budget to fit")
    return sweep, rows, largest


def one_seed(args, seed: int) -> dict:
    sweep, rows, largest = seed_sweep(args, seed)
    full = scaling_report.analyse(rows, bootstrap=0, floor=args.floor)
    out = {"seed": seed, "multiplier": full["families"]["moe"].get("multiplier", {})}
    for family in ("dense", "moe"):
        cfg = sweep / f"predicted-{family}.yaml"
        sh(
            "launch.scaling",
            "predict",
            sweep,
            "--budget",
            largest,
            "--family",
            family,
            "--bootstrap",
            args.bootstrap,
            "--fit-below",
            largest,
            "--floor",
            args.floor,
            "--write-config",
            cfg,
        )
        # The same prediction in-process for its figures (same runs, same bootstrap seed): the
        # law's loss at the written run's own N and D is what its measured loss is compared with.
        pred, run, _ = predicted_run(
            sweep, family, largest, args.bootstrap, fit_below=largest, floor=args.floor
        )
        run_dir = Path(args.out) / "predicted" / f"s{seed}-{family}"
        sh(
            "launch.launch",
            cfg,
            f"output_dir={run_dir.parent}",
            f"name={run_dir.name}",
            f"train.seed={seed}",
        )
        measured = final_loss(run_dir)
        best = next(m for m in full["families"][family]["minima"] if m.budget == largest)
        # Where the ladder does not bracket the minimum, the best measured size is its lowest
        # run, not the parabola's vertex beyond it.
        best_n = best.n_opt if best.bracketed else best.lowest_n
        lo, hi = pred["n_interval"]
        out[family] = {
            "predicted": pred["run_loss"],
            "measured": measured,
            "error": measured / pred["run_loss"] - 1,
            "best_n": best_n,
            "interval": (lo, hi),
            "inside": lo <= best_n <= hi,
            "optimum_loss": pred["loss"],
            "n_opt": pred["n_opt"],
            "width": run.width,
            "run_n": run.active_params,
            # The backtest: the law fitted below the largest budget on every ladder
            # run of the largest, how far it is off away from the shape it picked.
            "ladder_errors": full["families"][family]["backtest"]["errors"],
        }
    return out


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    p.add_argument(
        "--corpus",
        choices=("packages", "stdlib"),
        default="packages",
        help="packages: docstrings and comments of the installed packages (default); "
        "stdlib: the default config's corpus (about 1.7M tokens)",
    )
    p.add_argument("--budgets", default="5e11,1.6e12,5e12")
    p.add_argument("--sizes", default="5")
    p.add_argument("--seeds", default="1,2")
    p.add_argument("--jobs", default="1")
    p.add_argument("--bootstrap", type=int, default=100)
    p.add_argument(
        "--vocab",
        type=int,
        default=1024,
        help="tokenizer vocabulary of the sweep (0: the config's)",
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="ranks of every run (the global batch of --config is kept)",
    )
    p.add_argument(
        "--eval-tokens",
        type=int,
        default=EVAL_TOKENS,
        help="validation tokens each run is evaluated on",
    )
    p.add_argument(
        "--min-steps",
        type=int,
        default=scaling.MIN_STEPS,
        help="moe-scaling plan --min-steps: a run's batch is halved until it has "
        "this many optimizer steps",
    )
    p.add_argument(
        "--floor",
        choices=scaling_fit.FLOORS,
        default="family",
        help="moe-scaling fit/predict --floor: each family's law its own loss floor, "
        "or one shared by both",
    )
    p.add_argument("--out", required=True)
    return p.parse_args()


def _print_tables(per_seed: list[dict], budgets: list[float]) -> None:
    """Per family and seed the prediction against the measured run; per budget the MoE/dense
    compute multiplier over the seeds."""
    print(
        "| family | seed | predicted N_opt (loss) | run trained: width, N | its predicted loss | "
        "measured loss | error | measured best N | predicted N interval | inside | "
        "error over the largest budget's ladder: median abs (min to max) |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    for r in per_seed:
        for family in ("dense", "moe"):
            f = r[family]
            e = f["ladder_errors"]
            print(
                f"| {family} | {r['seed']} | {f['n_opt']:.3g} ({f['optimum_loss']:.4f}) | "
                f"{f['width']}, {f['run_n']:.3g} | {f['predicted']:.4f} | {f['measured']:.4f} | "
                f"{f['error']:+.2%} | {f['best_n']:.3g} | {f['interval'][0]:.3g}-"
                f"{f['interval'][1]:.3g} | {'yes' if f['inside'] else 'no'} | "
                f"{statistics.median(map(abs, e)):.2%} ({min(e):+.2%} to {max(e):+.2%}) |"
            )
    print("\n| budget | MoE/dense compute multiplier, median (min-max over seeds) |\n| --- | --- |")
    for b in budgets:
        values = [r["multiplier"][b] for r in per_seed if b in r["multiplier"]]
        if values:
            print(
                f"| {b:.3g} | {statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f}) |"
            )


def main() -> None:
    args = _args()
    budgets = sorted(float(b) for b in args.budgets.split(","))
    if len(budgets) < 3 or budgets[-1] < 10 * budgets[0]:
        raise SystemExit("--budgets: at least 3 budgets spanning at least 10x")
    start = time.monotonic()
    per_seed = [one_seed(args, int(s)) for s in args.seeds.split(",")]
    _print_tables(per_seed, budgets)
    print(
        f"\ntarget: |error| <= 2%; the benchmark took {(time.monotonic() - start) / 60:.1f} min "
        f"({len(per_seed)} seeds, {len(budgets)} budgets x {args.sizes} sizes x 2 families, "
        f"widths from {scaling.WIDTHS[0]}, vocabulary {args.vocab or 'of the config'}, "
        f"{args.ranks} rank(s) per run, batch halved below {args.min_steps} steps, "
        f"{'one loss floor for both families' if args.floor == 'shared' else 'a loss floor per family'})"
    )


if __name__ == "__main__":
    main()
