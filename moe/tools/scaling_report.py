"""The analysis of a finished scaling sweep: the fits of ``moe/tools/scaling.py`` applied to
every family, predictions for a budget, and the report (markdown and one PNG)."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from moe.errors import ScalingError
from moe.fileio import write_atomic
from moe.tools import scaling

FEW_STEPS = 200
"""Runs with fewer optimizer steps are warned about: on our 2-core sweeps, runs of 77 to 132
steps ended 3-19% lower when trained again on the same tokens with 200 or more steps (smaller
batches; BENCHMARKS.md), and the two that had failed to train trained normally."""

BUMP_TOLERANCE = 0.02
"""A run whose loss is more than this fraction above both its neighbours in N at the same
budget is reported (two seeds of the same run differ by about 1%, rarely 2.5%)."""


def analyse(results: list[dict], bootstrap: int = 100, seed: int = 0,
            floor: str = "family") -> dict:
    """Per family: the IsoFLOP minimum of each budget, the power laws through them, the
    parametric law with bootstrap fits and the FLOPs per token per parameter (k); for MoE the
    compute multiplier against dense and, with several expert counts, the expert law. ``floor``:
    each family's law has its own E (``"family"``) or all share one (``"shared"``,
    :func:`scaling.fit_shared_floor`)."""
    by_family: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        by_family[r["family"]].append(r)
    out: dict = {"families": {}, "warnings": [], "results": results, "floor": floor}
    short = sorted((r for r in results if r.get("steps", FEW_STEPS) < FEW_STEPS),
                   key=lambda r: r["steps"])
    if short:
        out["warnings"].append(
            f"{len(short)} run(s) trained fewer than {FEW_STEPS} optimizer steps ("
            + ", ".join(f"{r['name']} {r['steps']}" for r in short[:6])
            + (", ..." if len(short) > 6 else "") + "): such runs can be held back by their "
            f"batch rather than their size; plan with --min-steps {FEW_STEPS} to give them "
            "smaller batches")
    fits = _fits(by_family, floor, bootstrap, seed)
    backtests = backtest(results, floor)
    for family, runs in sorted(by_family.items()):
        if family not in fits:
            out["warnings"].append(f"{family}: {len(runs)} finished runs; the parametric law "
                                   "needs 5")
        out["families"][family] = _analyse_family(family, runs, fits.get(family),
                                                  backtests.get(family), out["warnings"])
    dense, moe = out["families"].get("dense"), out["families"].get("moe")
    if dense and moe and dense.get("fit"):
        law = dense["fit"].law
        moe["multiplier"] = {m.budget: scaling.compute_multiplier(law, dense["k"], m.loss_opt, m.budget)
                             for m in moe["minima"]}
        if moe.get("fit"):
            boot = dense["fit"].boot
            moe["multiplier_interval"] = {
                m.budget: scaling.percentile_interval(
                    [scaling.compute_multiplier(b, dense["k"], m.loss_opt, m.budget) for b in boot])
                for m in moe["minima"]} if boot else {}
    return out


def _fits(by_family: dict[str, list[dict]], floor: str, bootstrap: int,
          seed: int) -> dict[str, scaling.ParametricFit]:
    """The parametric laws of the families with five or more runs."""
    data = {f: ([r["active_params"] for r in rs], [r["tokens"] for r in rs],
                [r["loss"] for r in rs]) for f, rs in by_family.items() if len(rs) >= 5}
    return scaling.fit_laws(data, floor, bootstrap, seed) if data else {}


def _analyse_family(family, runs, fit, bt, warnings) -> dict:
    by_budget: dict[float, list[dict]] = defaultdict(list)
    for r in runs:
        by_budget[r["budget"]].append(r)
    minima = []
    for budget, rs in sorted(by_budget.items()):
        if len(rs) < 3:
            warnings.append(f"{family}, budget {budget:.3g}: {len(rs)} finished runs, no minimum "
                            "(a parabola needs 3)")
            continue
        rs = sorted(rs, key=lambda r: r["active_params"])
        for prev, r, nxt in zip(rs, rs[1:], rs[2:]):
            above = r["loss"] / max(prev["loss"], nxt["loss"]) - 1
            if above > BUMP_TOLERANCE:
                warnings.append(
                    f"{family}, budget {budget:.3g}: {r['name']} ended at {r['loss']:.4f}, "
                    f"{above:.1%} above both neighbours ({prev['name']} {prev['loss']:.4f}, "
                    f"{nxt['name']} {nxt['loss']:.4f}); along a budget the loss has one minimum, "
                    "so the run likely failed to train (read its log): rerun it, or leave it out "
                    f"with --exclude {r['name']}")
        m = scaling.isoflop_minimum(budget, [r["active_params"] for r in rs], [r["loss"] for r in rs])
        if m.at_edge:
            warnings.append(f"{family}, budget {budget:.3g}: the loss is lowest at the edge of the "
                            f"ladder (N {rs[0]['active_params']:,} to {rs[-1]['active_params']:,}); "
                            "the optimum may lie outside it: add sizes on that side")
        minima.append(m)
    k = float(np.median([r["flops"] / (r["tokens"] * r["active_params"]) for r in runs]))
    fam: dict = {"runs": runs, "minima": minima, "k": k}
    if len(minima) >= 2:
        fam["n_law"] = scaling.power_law([m.budget for m in minima], [m.n_opt for m in minima])
        fam["d_law"] = scaling.power_law([m.budget for m in minima],
                                         [m.budget / (k * m.n_opt) for m in minima])
    if fit is not None:
        fam["fit"] = fit
    fam["backtest"] = bt
    if bt and bt["median_abs"] > BACKTEST_WARN:
        warnings.append(
            f"{family}: fitted without its largest budget ({bt['budget']:.3g}), the law misses "
            f"that budget's runs by {bt['median_abs']:.1%} (median; {min(bt['errors']):+.1%} to "
            f"{max(bt['errors']):+.1%}): expect errors of this size, not the bootstrap interval's, "
            "when predicting beyond the sweep")
    if family == "moe" and len({r["experts"] for r in runs}) >= 2:
        fam["expert_law"] = scaling.clark_law([r["active_params"] for r in runs],
                                              [r["experts"] for r in runs], [r["loss"] for r in runs])
    return fam


BACKTEST_WARN = 0.02
"""A backtest error (median over the largest budget's runs) above this is warned about."""


def backtest(runs: list[dict], floor: str = "family") -> dict[str, dict]:
    """How well each family's law extrapolates on this sweep: fitted (with ``floor``) on every
    budget but the family's largest (two or more budgets, five or more runs), its error on each
    run of that largest budget (measured / law - 1). A family with fewer than three budgets has
    none. The bootstrap interval only measures the scatter of the runs fitted; this measures a
    prediction one budget out."""
    by_family: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        by_family[r["family"]].append(r)
    last = {f: max(r["budget"] for r in rs) for f, rs in by_family.items()
            if len({r["budget"] for r in rs}) >= 3}
    earlier = {f: [r for r in by_family[f] if r["budget"] < b] for f, b in last.items()}
    laws = _fits(earlier, floor, 0, 0)
    out = {}
    for f, fit in laws.items():
        held = sorted((r for r in by_family[f] if r["budget"] == last[f]),
                      key=lambda r: r["active_params"])
        errors = [float(r["loss"] / fit.law.loss(r["active_params"], r["tokens"]) - 1) for r in held]
        out[f] = {"budget": last[f], "fitted_runs": len(earlier[f]),
                  "runs": [r["name"] for r in held], "errors": errors,
                  "median_abs": float(np.median(np.abs(errors)))}
    return out


def predict(analysis: dict, family: str, budget: float) -> dict:
    """The compute-optimal N, D and loss of ``budget`` for ``family`` from its parametric law,
    with 95% bootstrap intervals (the ladder shape to train: ``launch.scaling.predicted_run``,
    which knows the sweep's base model)."""
    fam = analysis["families"].get(family)
    if fam is None:
        raise ScalingError(f"the sweep has no finished {family} run")
    if "fit" not in fam:
        raise ScalingError(f"{family}: {len(fam['runs'])} finished runs; a prediction needs the "
                           "parametric law, which needs 5")
    fit, k = fam["fit"], fam["k"]
    n, d, loss = fit.law.optimum(budget, k)
    out = {"family": family, "budget": budget, "n_opt": n, "d_opt": d, "loss": loss,
           "backtest": fam.get("backtest"),
           "n_interval": fit.interval(lambda b: b.optimum(budget, k)[0]),
           "d_interval": fit.interval(lambda b: b.optimum(budget, k)[1]),
           "loss_interval": fit.interval(lambda b: b.optimum(budget, k)[2])}
    if "n_law" in fam:
        # The IsoFLOP route (Chinchilla's second approach) as a cross-check on N_opt: the power
        # law through the per-budget minima. It assumes nothing about the shape of L(N, D), and
        # where the law's minimum along the budget is flat its N_opt is the less certain of the
        # two.
        a, b = fam["n_law"]
        out["isoflop"] = {"n_opt": a * budget ** b, "budgets": len(fam["minima"])}
    runs = fam["runs"]
    if family == "moe":
        best = min(runs, key=lambda r: (abs(math.log(r["budget"] / budget)), r["loss"]))
        out["experts"] = best["experts"]
    budgets = sorted({r["budget"] for r in runs})
    if budget > 10 * budgets[-1]:
        analysis["warnings"].append(f"{budget:.3g} is {budget / budgets[-1]:.0f}x the sweep's "
                                    "largest budget: the interval is only as good as the law")
    return out


def prediction_text(p: dict) -> str:
    lo, hi = p["n_interval"]
    dlo, dhi = p["d_interval"]
    llo, lhi = p["loss_interval"]
    lines = [f"{p['family']} at {p['budget']:.3g} FLOPs:",
             f"  active parameters N  {p['n_opt']:.4g}  (95%: {lo:.4g} to {hi:.4g})",
             f"  tokens D             {p['d_opt']:.4g}  (95%: {dlo:.4g} to {dhi:.4g})",
             f"  tokens per parameter {p['d_opt'] / p['n_opt']:.1f}",
             f"  predicted loss       {p['loss']:.4f}  (95%: {llo:.4f} to {lhi:.4f})"]
    iso = p.get("isoflop")
    if iso:
        lines.append(f"  IsoFLOP route        N {iso['n_opt']:.4g}, {iso['n_opt'] / p['n_opt']:.2f}x the "
                     f"law's (the power law through the minima of {iso['budgets']} budgets)")
    bt = p.get("backtest")
    if bt:
        lines.append(f"  backtest             the law fitted below {bt['budget']:.3g} misses that "
                     f"budget's runs by {bt['median_abs']:.1%} (median; {min(bt['errors']):+.1%} "
                     f"to {max(bt['errors']):+.1%})")
    if "width" in p:
        lines.append(f"  best ladder width    {p['width']}")
    if p.get("experts"):
        lines.append(f"  experts              {p['experts']}")
    return "\n".join(lines)


def summary(analysis: dict) -> str:
    lines = []
    shared = analysis.get("floor") == "shared" and sum(
        "fit" in fam for fam in analysis["families"].values()) >= 2
    for family, fam in analysis["families"].items():
        lines.append(f"{family}: {len(fam['runs'])} runs, {len(fam['minima'])} budgets with a minimum")
        for m in fam["minima"]:
            mult = fam.get("multiplier", {}).get(m.budget)
            lines.append(f"  C {m.budget:.3g}: N_opt {m.n_opt:.4g}, loss {m.loss_opt:.4f}"
                         + (" (edge of the ladder)" if m.at_edge else "")
                         + (f", compute multiplier vs dense {mult:.2f}x" if mult is not None else ""))
        if "n_law" in fam:
            lines.append(f"  N_opt = {fam['n_law'][0]:.3g} C^{fam['n_law'][1]:.3f}, "
                         f"D_opt = {fam['d_law'][0]:.3g} C^{fam['d_law'][1]:.3f}")
        if "fit" in fam:
            law = fam["fit"].law
            a_lo, a_hi = fam["fit"].interval(lambda b: b.alpha)
            b_lo, b_hi = fam["fit"].interval(lambda b: b.beta)
            lines.append(f"  L = {law.E:.3f} + {law.A:.4g}/N^{law.alpha:.3f} + {law.B:.4g}/D^"
                         f"{law.beta:.3f}" + (f"  (alpha 95%: {a_lo:.3f}-{a_hi:.3f}, beta: "
                                              f"{b_lo:.3f}-{b_hi:.3f})" if fam["fit"].boot else "")
                         + ("  (E shared by the families)" if shared else ""))
        bt = fam.get("backtest")
        if bt:
            lines.append(f"  backtest: fitted below {bt['budget']:.3g} ({bt['fitted_runs']} runs), "
                         f"the law's error on that budget's {len(bt['errors'])} runs (measured / "
                         f"law - 1): median |e| {bt['median_abs']:.2%}, "
                         + ", ".join(f"{n} {e:+.2%}" for n, e in zip(bt["runs"], bt["errors"])))
        if "expert_law" in fam:
            e = fam["expert_law"]
            lines.append(f"  log L = {e['a']:.4f} log N + {e['b']:.4f} log E + {e['c']:.5f} "
                         f"log N log E + {e['d']:.3f}  (Clark et al. 2022)")
    return "\n".join(lines)


def write_report(analysis: dict, out_dir: Path) -> dict[str, Path]:
    """report.md (tables, fits, warnings) and scaling.png: IsoFLOP curves with their minima, the
    fitted frontier with its 95% band, the residuals of the parametric law, and the MoE/dense
    compute multiplier per budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(2, 2, figsize=(12, 9))
    colors = {"dense": "tab:blue", "moe": "tab:orange"}
    for family, fam in analysis["families"].items():
        c = colors.get(family, "k")
        ax[0, 0].scatter([r["active_params"] for r in fam["runs"]],
                         [r["loss"] for r in fam["runs"]], color=c, s=14)
        for m in fam["minima"]:
            n = np.array([r["active_params"] for r in fam["runs"] if r["budget"] == m.budget])
            x = np.linspace(np.log(n.min()), np.log(n.max()), 50)
            ax[0, 0].plot(np.exp(x), np.polyval(m.coeffs, x), color=c, alpha=0.6)
            ax[0, 0].scatter([m.n_opt], [m.loss_opt], color=c, marker="*", s=120,
                             edgecolor="k")
        budgets = np.array(sorted({r["budget"] for r in fam["runs"]}))
        if "fit" in fam and len(budgets):
            grid = np.geomspace(budgets.min(), budgets.max() * 10, 40)
            opt = np.array([fam["fit"].law.optimum(C, fam["k"])[0] for C in grid])
            band = np.array([scaling.percentile_interval(
                [b.optimum(C, fam["k"])[0] for b in fam["fit"].boot] or [o]) for C, o in zip(grid, opt)])
            ax[0, 1].plot(grid, opt, color=c, label=f"{family} law")
            ax[0, 1].fill_between(grid, band[:, 0], band[:, 1], color=c, alpha=0.2)
            law = fam["fit"].law
            res = [np.log(law.loss(r["active_params"], r["tokens"])) - np.log(r["loss"])
                   for r in fam["runs"]]
            ax[1, 0].scatter([r["active_params"] for r in fam["runs"]], res, color=c, s=14,
                             label=family)
        if fam["minima"]:
            ax[0, 1].scatter([m.budget for m in fam["minima"]], [m.n_opt for m in fam["minima"]],
                             color=c, marker="*", s=80)
        if "multiplier" in fam:
            items = sorted(fam["multiplier"].items())
            ax[1, 1].plot([b for b, _ in items], [v for _, v in items], "o-", color=c)
    ax[0, 0].set(xlabel="active parameters N", ylabel="final validation loss",
                 title="IsoFLOP curves (stars: minima)")
    ax[0, 1].set(xlabel="training FLOPs C", ylabel="N_opt",
                 title="compute-optimal size (band: 95% bootstrap)")
    ax[1, 0].set(xlabel="N", ylabel="log predicted - log measured", title="residuals of L(N, D)")
    ax[1, 1].set(xlabel="budget C", ylabel="dense FLOPs / MoE FLOPs",
                 title="MoE compute multiplier")
    # A panel without data (too few runs for a minimum or a law) keeps linear axes: matplotlib
    # cannot lay out an empty log axis.
    for a, scales in ((ax[0, 0], {"xscale": "log"}), (ax[0, 1], {"xscale": "log", "yscale": "log"}),
                      (ax[1, 0], {"xscale": "log"}), (ax[1, 1], {"xscale": "log"})):
        if a.has_data():
            a.set(**scales)
    ax[1, 0].axhline(0, color="k", lw=0.5)
    ax[1, 1].axhline(1, color="k", lw=0.5)
    for a in (ax[0, 1], ax[1, 0]):
        if a.get_legend_handles_labels()[0]:
            a.legend()
    fig.tight_layout()
    plot = out_dir / "scaling.png"
    fig.savefig(plot, dpi=90)
    plt.close(fig)
    md = ["# Scaling sweep", "", "## Fits", "", "```", summary(analysis), "```", ""]
    if analysis["warnings"]:
        md += ["## Warnings", ""] + [f"- {w}" for w in analysis["warnings"]] + [""]
    md += ["## Runs", "", "| run | family | budget | N | tokens | loss |", "| --- | --- | --- | --- | --- | --- |"]
    md += [f"| {r['name']} | {r['family']} | {r['budget']:.3g} | {r['active_params']:,} "
           f"| {r['tokens']:,} | {r['loss']:.4f} |" for r in analysis["results"]]
    md += ["", "![scaling](scaling.png)", ""]
    markdown = out_dir / "report.md"
    write_atomic(markdown, "\n".join(md))
    return {"markdown": markdown, "plot": plot}
