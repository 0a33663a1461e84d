"""moe-scaling: plan, run and fit a scaling-law sweep, and predict the compute-optimal run.

    moe-scaling plan CONFIG --budgets 3e13,1e14,3e14 [--sizes 5] [--families dense,moe]
                     [--experts 8,16] [--out SWEEP] [--centre-from SWEEP] [--allow-repeat]
                     [--force] [key=value ...]
    moe-scaling run SWEEP [--jobs K] [--scheduler local|slurm] [--no-wait] [--dry-run]
    moe-scaling fit SWEEP
    moe-scaling predict SWEEP --budget C [--family moe] [--write-config OUT.yaml] [--fit-below C]
                        [--allow-repeat]

``run`` is in ``launch/scaling_run.py``; what a sweep's directory holds is read back by
``launch/scaling_sweep.py``. The definitions (N, D, C, the ladder, the learning-rate rule) and
the fits are documented in ``moe/tools/scaling.py``, ``moe/tools/scaling_fit.py`` and
docs/scaling.md."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import yaml

from launch import scaling_run, scaling_sweep
from launch.cli import exits_cleanly
from moe.config.run import RunConfig, load_config
from moe.core.config_schema import from_dict, to_dict
from moe.core.errors import ScalingError
from moe.core.fileio import write_atomic
from moe.tools import scaling, scaling_fit, scaling_report, scaling_text


def _base(cfg: RunConfig) -> scaling.Base:
    from data_pipeline.prepare import prepare
    from data_pipeline.shards import read_manifest

    prepare(cfg.data)  # a no-op when prepared from the same data config
    manifest = read_manifest(cfg.data.dir, cfg.data.s3)
    model = cfg.model
    if model.vocab_size is None:
        model.vocab_size = int(manifest.tokenizer["vocab_size"])
    t = cfg.train
    return scaling.Base(
        model=model,
        seq_len=cfg.data.seq_len,
        world_size=cfg.parallel.world_size,
        micro_batch_size=t.micro_batch_size,
        grad_accum_steps=t.grad_accum_steps,
        lr=t.lr,
        min_lr=t.min_lr,
        warmup_steps=t.warmup_steps,
        corpus_tokens=manifest.splits["train"].tokens,
    )


def run_config(base: dict, run: scaling.PlannedRun, model: dict, sweep_dir: Path) -> dict:
    """The full run config of one planned run, from the base config's dict."""
    d = json.loads(json.dumps(base))
    d.update(name=run.name, output_dir=str(sweep_dir / "runs"))
    d["model"] = model
    d["train"].update(
        max_steps=run.steps,
        micro_batch_size=run.micro_batch_size,
        grad_accum_steps=run.grad_accum_steps,
        lr=run.lr,
        min_lr=run.min_lr,
        warmup_steps=run.warmup_steps,
    )
    if run.family == "dense":
        d["parallel"]["expert_parallel_size"] = 1
    return d


def plan(args) -> None:
    # The flags first: the base config may have a corpus to prepare, which takes a while.
    budgets = _numbers(args.budgets, "--budgets", float)
    experts = _numbers(args.experts, "--experts", int) if args.experts else None
    widths = _numbers(args.widths, "--widths", int) if args.widths else None
    if args.min_steps < scaling.STEPS_FLOOR:
        raise ScalingError(
            f"--min-steps {args.min_steps}: a run needs at least {scaling.STEPS_FLOOR} steps"
        )
    _refuse_unused_flags(args)
    centre, source = _centre_from(Path(args.centre_from)) if args.centre_from else (None, None)
    cfg = load_config(args.config, args.overrides)
    base = replace(_base(cfg), min_steps=args.min_steps)
    runs, models = scaling.plan_sweep(
        base,
        budgets,
        args.sizes or DEFAULT_SIZES,
        args.families.split(","),
        experts,
        widths,
        args.allow_repeat,
        centre,
    )
    out = Path(args.out or f"sweeps/{cfg.name}")
    plan_file = out / scaling_sweep.SWEEP_FILE
    if plan_file.exists() and not args.force:
        raise ScalingError(
            f"{plan_file} exists: a sweep is planned there already (--force "
            "replaces its plan; finished runs of the same name are kept)"
        )
    planned_before = _planned_names(out)
    base_dict = to_dict(cfg)
    configs = {
        r.name: run_config(base_dict, r, to_dict(models[r.name]), out.resolve()) for r in runs
    }
    for name, d in configs.items():  # every config valid before anything is written
        from_dict(RunConfig, d, source=name)
    notes = scaling.ladder_warnings(base, runs, centre, source or "the rule of thumb")
    short = scaling.short_runs_warning([scaling.planned_run_to_dict(r) for r in runs], True)
    notes += [short] if short else []
    for name, d in configs.items():
        write_atomic(out / "configs" / f"{name}.yaml", yaml.safe_dump(d, sort_keys=False))
    write_atomic(
        out / "plan.md",
        scaling.run_table(runs)
        + "".join(f"\n- warning: {w}" for w in notes)
        + ("\n" if notes else ""),
    )
    write_atomic(
        plan_file,
        json.dumps(
            {
                "config": str(Path(args.config).resolve()),
                "overrides": args.overrides,
                "budgets": budgets,
                "families": args.families.split(","),
                "experts": experts,
                "min_steps": args.min_steps,
                "centre": source or "rule of thumb",
                "runs": [scaling.planned_run_to_dict(r) for r in runs],
            },
            indent=1,
        ),
    )
    stale = _remove_stale_configs(out, configs, planned_before)
    print(scaling.run_table(runs))
    for w in notes:
        print(f"warning: {w}")
    if stale:
        print(
            f"removed the configs of {len(stale)} run(s) the new plan does not have "
            f"({', '.join(stale[:6])}{', ...' if len(stale) > 6 else ''}); their run "
            f"directories, if any, stay in {out / 'runs'}"
        )
    total = sum(r.flops for r in runs)
    print(
        f"{len(runs)} runs, {total:.3e} FLOPs in all; sweep in {out}\n"
        f"next: moe-scaling run {shlex.quote(str(out))}"
    )


def _refuse_unused_flags(args) -> None:
    """Flags the other flags given make meaningless are refused, all at once, not ignored."""
    problems = []
    if args.experts and "moe" not in args.families.split(","):
        problems.append(f"--experts {args.experts}: only the moe family has experts (--families)")
    if args.widths and args.sizes is not None:
        problems.append(f"--sizes {args.sizes}: --widths names the ladder's sizes")
    if args.widths and args.centre_from:
        problems.append(
            f"--centre-from {args.centre_from}: --widths names the ladder, nothing is centred"
        )
    if problems:
        raise ScalingError("; ".join(problems))


def _planned_names(out: Path) -> set[str]:
    """The runs of the plan in ``out`` (empty where none was planned or it is unreadable)."""
    try:
        return {r.name for r in scaling_sweep.load_sweep(out)[1]}
    except ScalingError:
        return set()


def _remove_stale_configs(out: Path, configs: dict, planned_before: set[str]) -> list[str]:
    """Delete the run configs of ``out/configs`` that the plan replaced with --force had and
    the new one does not, so that the directory holds exactly the plan's runs; their names.
    Files no plan wrote (``--out`` a directory of the user's own configs) stay."""
    stale = sorted(
        p
        for p in (out / "configs").glob("*.yaml")
        if p.stem in planned_before and p.stem not in configs
    )
    for p in stale:
        p.unlink()
    return [p.stem for p in stale]


def _centre_from(sweep_dir: Path) -> tuple:
    """The ``--centre-from`` ladder centre: per family, N_opt as the finished runs of
    ``sweep_dir`` place it (``scaling_report.optimum_trend``); a family they do not place keeps
    the rule of thumb. Returns (centre, a description of its source)."""
    trend = scaling_report.optimum_trend(scaling_sweep.results(sweep_dir))
    if not trend:
        raise ScalingError(
            f"--centre-from {sweep_dir}: no budget of its finished runs has a "
            "minimum inside its ladder, so they place no optimum (plan without "
            "--centre-from to use the rule of thumb)"
        )

    def centre(family: str, budget: float) -> float | None:
        if family not in trend:
            return None
        a, b, _ = trend[family]
        return a * budget**b

    described = "; ".join(f"{f}: {text}" for f, (_, _, text) in sorted(trend.items()))
    return centre, f"from {sweep_dir} ({described})"


def _numbers(text: str, flag: str, kind) -> list:
    try:
        floats = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ScalingError(f"{flag} {text!r}: expected numbers separated by commas") from None
    if not floats or not all(math.isfinite(v) and v > 0 for v in floats):
        raise ScalingError(f"{flag} {text!r}: expected positive, finite numbers")
    if kind is int and any(v != int(v) for v in floats):
        raise ScalingError(f"{flag} {text!r}: expected whole numbers")
    return [kind(v) for v in floats]


def bootstrap_progress(label: str, total: int):
    """A bar on stderr over the bootstrap refits, which take seconds to minutes: on a terminal
    redrawn in place, in a log a line at most every 10 s."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=label,
        unit="fit",
        file=sys.stderr,
        mininterval=0.5 if sys.stderr.isatty() else 10,
    )


def fit(args) -> None:
    scaling_fit.require_scipy()
    sweep_dir = Path(args.sweep)
    rows = scaling_sweep.results(sweep_dir, args.exclude)
    bpt, notes = scaling_sweep.validation_text(sweep_dir, rows)
    analysis = scaling_report.analyse(
        rows,
        bootstrap=args.bootstrap,
        floor=args.floor,
        progress=bootstrap_progress,
        bytes_per_token=bpt,
    )
    analysis["warnings"] += notes
    if args.exclude:
        analysis["warnings"].append(f"left out of the fits (--exclude): {args.exclude}")
    paths = scaling_text.write_report(analysis, sweep_dir / "report")
    for w in analysis["warnings"]:
        print(f"warning: {w}")
    print(scaling_text.summary(analysis))
    print(f"report: {paths['markdown']}\nplot:   {paths['plot']}")


def predicted_run(
    sweep_dir: Path,
    family: str,
    budget: float,
    bootstrap: int = 100,
    fit_below: float | None = None,
    allow_repeat: bool = False,
    name: str = "predicted",
    exclude: str | None = None,
    floor: str = "family",
    progress=None,
) -> tuple[dict, scaling.PlannedRun, dict]:
    """The law's compute-optimal point of ``budget`` (``scaling_report.predict``), the run of the
    ladder shape the law ranks best at that budget (``scaling.best_ladder_run``: its width,
    tokens spending the budget), and that run's config. The prediction gains ``run_loss`` and
    ``run_loss_interval``: the law at the run's own N and D, the figure its measured loss is to
    be compared with. A run that would repeat the corpus is refused unless ``allow_repeat``.
    ``progress``: shows the bootstrap (``scaling_fit.fit_laws``)."""
    sweep, _ = scaling_sweep.load_sweep(sweep_dir)
    rows = scaling_sweep.results(sweep_dir, exclude)
    if fit_below is not None:  # a held-out check: the law from the smaller budgets only
        rows = [r for r in rows if r["budget"] < fit_below]
        if not rows:
            raise ScalingError(f"--fit-below {fit_below:.4g}: no finished run of a smaller budget")
    bpt, notes = scaling_sweep.validation_text(sweep_dir, rows)
    analysis = scaling_report.analyse(
        rows, bootstrap=bootstrap, floor=floor, progress=progress, bytes_per_token=bpt
    )
    analysis["warnings"] += notes
    pred = scaling_report.predict(analysis, family, budget)
    pred["warnings"] = analysis["warnings"]
    cfg = load_config(sweep["config"], sweep["overrides"])
    # A sweep planned before --min-steps existed had the fixed minimum.
    base = replace(_base(cfg), min_steps=sweep.get("min_steps", scaling.STEPS_FLOOR))
    experts = pred.get("experts") or None
    fit = analysis["families"][family]["fit"]
    run, model = scaling.best_ladder_run(base, fit.law, budget, family, experts, name)
    pred["width"] = run.width
    if run.epochs > 1 and not allow_repeat:
        raise ScalingError(
            f"the predicted run (width {run.width}, {run.active_params:,} active "
            f"parameters) trains {run.tokens:,} tokens, {run.epochs:.2f} epochs of "
            f"the prepared corpus ({base.corpus_tokens:,} training tokens); use a "
            "larger corpus or --allow-repeat"
        )
    pred["run_loss"] = float(fit.law.loss(run.active_params, run.tokens))
    pred["run_loss_interval"] = fit.interval(lambda b: b.loss(run.active_params, run.tokens))
    d = run_config(to_dict(cfg), run, to_dict(model), Path(cfg.output_dir).resolve())
    d["output_dir"] = cfg.output_dir
    return pred, run, d


def predict(args) -> None:
    scaling_fit.require_scipy()
    name = Path(args.write_config).stem if args.write_config else "predicted"
    pred, run, d = predicted_run(
        Path(args.sweep),
        args.family,
        args.budget,
        args.bootstrap,
        args.fit_below,
        args.allow_repeat,
        name,
        args.exclude,
        args.floor,
        bootstrap_progress,
    )
    for w in pred["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    print(scaling_text.prediction_text(pred))
    lo, hi = pred["run_loss_interval"]
    print(
        f"the run of the best ladder shape: width {run.width}, {run.active_params:,} active "
        f"parameters, {run.tokens:,} tokens ({run.epochs:.2f} epochs), {run.steps} steps; "
        f"predicted loss {pred['run_loss']:.4f} (95%: {lo:.4f} to {hi:.4f})"
    )
    if args.write_config:
        from_dict(RunConfig, d, source=args.write_config)
        write_atomic(Path(args.write_config), yaml.safe_dump(d, sort_keys=False))
        print(f"config: {args.write_config} (moe-plan {args.write_config} lays it out on GPUs)")


def _positive(text: str) -> float:
    """An argparse type: a positive, finite number (FLOPs)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive, finite number")
    return value


def _count(text: str) -> int:
    """An argparse type: a whole number, zero or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected zero or more")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moe-scaling",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    _plan_parser(sub)
    _run_parser(sub)
    for name, text in (
        ("fit", "fit the laws and write the report"),
        ("predict", "the compute-optimal run of a budget"),
    ):
        _analysis_parser(sub.add_parser(name, help=text), name)
    return p


DEFAULT_SIZES = 5
"""``plan``'s model sizes per budget and family when neither --sizes nor --widths names them."""


def _plan_parser(sub) -> None:
    """``plan``: the base config, the budgets and the ladders of shapes to write."""
    pl = sub.add_parser("plan", help="write a sweep: a ladder of shapes per budget and family")
    pl.add_argument("config")
    pl.add_argument("overrides", nargs="*", help="key=value changes to the base config")
    pl.add_argument("--budgets", required=True, help="training FLOPs per run, e.g. 3e13,1e14")
    pl.add_argument(
        "--sizes",
        type=int,
        help=f"model sizes per budget and family (default {DEFAULT_SIZES}; not with --widths)",
    )
    pl.add_argument("--families", default="dense,moe")
    pl.add_argument("--experts", help="expert counts of the MoE family (default: the config's)")
    pl.add_argument("--widths", help="the ladder's widths, instead of the rule's")
    pl.add_argument(
        "--centre-from",
        metavar="SWEEP",
        help="centre each budget's ladder on the N_opt that SWEEP's finished runs "
        "give (the power law through their minima), not the rule of thumb",
    )
    pl.add_argument("--out", help="the sweep directory (default: sweeps/NAME)")
    pl.add_argument(
        "--min-steps",
        type=_count,
        default=scaling.MIN_STEPS,
        help="halve a run's batch (accumulation first) until it has this many "
        "optimizer steps, dividing its learning rate by sqrt(2) each time "
        f"(default {scaling.MIN_STEPS}, below which fit warns; at least "
        f"{scaling.STEPS_FLOOR})",
    )
    pl.add_argument(
        "--allow-repeat",
        action="store_true",
        help="allow runs that train on the corpus more than once",
    )
    pl.add_argument("--force", action="store_true", help="replace an existing plan")


def _run_parser(sub) -> None:
    """``run``: where and how many of a sweep's runs train at a time."""
    r = sub.add_parser("run", help="train every unfinished run through moe-launch")
    r.add_argument("sweep")
    r.add_argument("--jobs", type=int, default=1, help="runs at a time")
    r.add_argument(
        "--scheduler",
        choices=["local", "slurm"],
        help="local: moe-launch here, --jobs at a time; slurm: one SLURM job per run "
        "(default: slurm when the run configs say launch.scheduler: slurm)",
    )
    r.add_argument(
        "--no-wait",
        action="store_true",
        help="slurm: submit and return (the jobs keep their --jobs bound)",
    )
    r.add_argument(
        "--dry-run",
        action="store_true",
        help="slurm: print the job scripts and sbatch commands, submit nothing",
    )


def _analysis_parser(s: argparse.ArgumentParser, name: str) -> None:
    """``fit`` and ``predict``: the finished runs the laws read; ``predict``'s budget and shape."""
    s.add_argument("sweep")
    s.add_argument("--bootstrap", type=_count, default=100, help="bootstrap resamples")
    s.add_argument(
        "--exclude",
        help="runs to leave out of the fits, by name (comma-separated; "
        "for example a run that failed to train)",
    )
    s.add_argument(
        "--floor",
        choices=scaling_fit.FLOORS,
        default="family",
        help="the laws' loss floor E: each family its own (default), or one "
        "shared by dense and MoE, fitted jointly (the irreducible loss of "
        "the data)",
    )
    if name == "predict":
        s.add_argument(
            "--budget", type=_positive, required=True, help="training FLOPs of the run to predict"
        )
        s.add_argument("--family", choices=scaling.FAMILIES, default="moe")
        s.add_argument("--write-config", help="write a run config of the predicted shape")
        s.add_argument(
            "--fit-below",
            type=_positive,
            help="fit only the runs of budgets below this (to check the law "
            "on a budget it has not seen)",
        )
        s.add_argument(
            "--allow-repeat",
            action="store_true",
            help="allow a predicted run that trains on the corpus more than once",
        )


@exits_cleanly
def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if getattr(args, "jobs", 1) < 1:
        raise ScalingError(f"--jobs {args.jobs}: must be at least 1")
    {"plan": plan, "run": scaling_run.run, "fit": fit, "predict": predict}[args.command](args)


if __name__ == "__main__":
    main()
