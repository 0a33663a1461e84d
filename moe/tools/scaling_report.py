"""The analysis of a finished scaling sweep: the fits of ``moe/tools/scaling_fit.py`` applied to
every family, predictions for a budget; the report of them is ``moe/tools/scaling_text.py``. A number the runs do not support is either left out (an IsoFLOP
minimum outside its ladder does not enter the power laws) or printed with what is wrong with it
(a constant on the optimiser's bound, a multiplier that is only a lower bound)."""

from __future__ import annotations

import math
from collections import Counter, defaultdict

import numpy as np

from moe.core.errors import ScalingError
from moe.tools import scaling, scaling_envelope, scaling_fit, scaling_isoflop

BUMP_TOLERANCE = 0.02
"""A run whose loss is more than this fraction above both its neighbours in N at the same
budget is reported (two seeds of the same run differ by about 1%, rarely 2.5%)."""

LAW_BUDGETS = 3
"""Budgets (of three or more sizes each) the parametric law needs: one budget's ladder cannot
tell the size term from the tokens term (N and D move together along it), two cannot place the
floor E."""

BOUND_ADVICE = {
    ("alpha", "upper"): "the size term A/N^alpha vanishes across the ladder (the runs do not "
    "show the loss falling with N): add smaller sizes at each budget",
    ("A", "lower"): "the size term A/N^alpha vanishes across the ladder (the runs do not show "
    "the loss falling with N): add smaller sizes at each budget",
    ("alpha", "lower"): "the loss does not fall with N (alpha 0 folds the size term into the "
    "floor): add larger sizes at each budget, and budgets whose ladders "
    "bracket their minima",
    ("A", "upper"): "the size term does not settle: add sizes on both sides of each budget's "
    "minimum",
    ("beta", "upper"): "the tokens term B/D^beta vanishes (the runs do not show the loss "
    "falling with tokens): add larger sizes (fewer tokens per parameter) at "
    "each budget",
    ("B", "lower"): "the tokens term B/D^beta vanishes (the runs do not show the loss falling "
    "with tokens): add larger sizes (fewer tokens per parameter) at each budget",
    ("beta", "lower"): "the loss does not fall with tokens: add larger budgets",
    ("B", "upper"): "the tokens term does not settle: add larger budgets",
    ("E", "lower"): "the runs show no floor (the loss keeps falling without flattening): add "
    "larger budgets",
    ("E", "upper"): "the floor lies above the losses: look for runs that failed to train, and "
    "add budgets",
}
"""What to add when the fit leaves a constant on a side of its bound."""


def analyse(
    results: list[dict],
    bootstrap: int = 100,
    seed: int = 0,
    floor: str = "family",
    progress=None,
    bytes_per_token: float | None = None,
) -> dict:
    """Per family: the IsoFLOP minimum of each budget, the power laws through the bracketed
    ones (with bootstrap intervals), the envelope of the training curves of the runs that carry
    one (``curve``), the parametric law with bootstrap fits and the FLOPs per token per
    parameter (k); for MoE the compute multiplier against dense and, with several expert counts,
    the expert law. ``floor``: each family's law has its own E (``"family"``) or all share one
    (``"shared"``, :func:`scaling_fit.fit_shared_floor`). ``progress``: see
    :func:`scaling_fit.fit_laws`. ``bytes_per_token``: of the validation text the losses were
    measured on; losses are then also given in bits per byte (:func:`moe.tools.scaling_text.bits_per_byte`)."""
    by_family: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        by_family[r["family"]].append(r)
    out: dict = {
        "families": {},
        "warnings": [],
        "results": results,
        "floor": floor,
        "bytes_per_token": bytes_per_token,
    }
    short = scaling.short_runs_warning(results)
    if short:
        out["warnings"].append(short)
    fits = _fits(by_family, floor, bootstrap, seed, progress)
    backtests = backtest(results, floor)
    for family, runs in sorted(by_family.items()):
        if family not in fits:
            out["warnings"].append(
                f"{family}: {len(runs)} finished runs; the parametric law needs 5"
            )
        out["families"][family] = _analyse_family(
            family, runs, fits.get(family), backtests.get(family), out["warnings"], bootstrap, seed
        )
    dense, moe = out["families"].get("dense"), out["families"].get("moe")
    if dense and moe and dense.get("fit"):
        _multipliers(dense, moe)
    return out


def _multipliers(dense: dict, moe: dict) -> None:
    """The MoE's compute multiplier at each budget. Where the MoE's minimum is not bracketed,
    its lowest run's loss stands for the minimum: the optimum is at least that low, so the
    multiplier is a lower bound (``multiplier_bound``)."""
    law, k = dense["fit"].law, dense["k"]
    target = {m.budget: m.loss_opt if m.bracketed else m.lowest_loss for m in moe["minima"]}
    moe["multiplier"] = {
        b: scaling_fit.compute_multiplier(law, k, loss, b) for b, loss in target.items()
    }
    moe["multiplier_bound"] = {m.budget for m in moe["minima"] if not m.bracketed}
    boot = dense["fit"].boot
    moe["multiplier_interval"] = (
        {
            b: scaling_fit.percentile_interval(
                [scaling_fit.compute_multiplier(d, k, loss, b) for d in boot]
            )
            for b, loss in target.items()
        }
        if boot
        else {}
    )


def _fits(
    by_family: dict[str, list[dict]], floor: str, bootstrap: int, seed: int, progress=None
) -> dict[str, scaling_fit.ParametricFit]:
    """The parametric laws of the families with five or more runs."""
    data = {
        f: ([r["active_params"] for r in rs], [r["tokens"] for r in rs], [r["loss"] for r in rs])
        for f, rs in by_family.items()
        if len(rs) >= 5
    }
    return scaling_fit.fit_laws(data, floor, bootstrap, seed, progress) if data else {}


def _minima(family: str, runs: list[dict], warnings: list[str]) -> list:
    """The IsoFLOP minimum of each budget with three or more runs, and the warnings about
    budgets with fewer, runs above both neighbours and minima outside their ladder."""
    by_budget: dict[float, list[dict]] = defaultdict(list)
    for r in runs:
        by_budget[r["budget"]].append(r)
    minima = []
    for budget, rs in sorted(by_budget.items()):
        if len(rs) < 3:
            warnings.append(
                f"{family}, budget {budget:.3g}: {len(rs)} finished runs, no minimum "
                "(a parabola needs 3)"
            )
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
                    f"with --exclude {r['name']}"
                )
        m = scaling_isoflop.isoflop_minimum(
            budget, [r["active_params"] for r in rs], [r["loss"] for r in rs]
        )
        if not m.bracketed:
            warnings.append(
                f"{family}, budget {budget:.3g}: no minimum inside the ladder (N "
                f"{rs[0]['active_params']:,} to {rs[-1]['active_params']:,}): {m.problem()}; "
                f"{m.advice()}. The budget is left out of the power laws and the IsoFLOP route"
            )
        minima.append(m)
    return minima


def _analyse_family(family, runs, fit, bt, warnings, bootstrap: int = 0, seed: int = 0) -> dict:
    minima = _minima(family, runs, warnings)
    k = float(np.median([r["flops"] / (r["tokens"] * r["active_params"]) for r in runs]))
    fam: dict = {
        "runs": runs,
        "minima": minima,
        "k": k,
        "envelope": scaling_envelope.envelope(runs),
    }
    _isoflop_route(family, fam, warnings, bootstrap, seed)
    if fam["envelope"] is not None:
        warnings.extend(_train_validation_gap(family, runs, fam["envelope"]))
        warnings.extend(_envelope_against_route(family, fam))
    if fit is not None:
        fam["fit"] = fit
        warnings.extend(_law_warnings(family, fit, runs))
    fam["backtest"] = bt
    if bt and bt["median_abs"] > BACKTEST_WARN:
        warnings.append(
            f"{family}: fitted without its largest budget ({bt['budget']:.3g}), the law misses "
            f"that budget's runs by {bt['median_abs']:.1%} (median; {min(bt['errors']):+.1%} to "
            f"{max(bt['errors']):+.1%}): expect errors of this size, not the bootstrap interval's, "
            "when predicting beyond the sweep"
        )
    if family == "moe" and len({r["experts"] for r in runs}) >= 2:
        fam["expert_law"] = scaling_fit.clark_law(
            [r["active_params"] for r in runs],
            [r["experts"] for r in runs],
            [r["loss"] for r in runs],
        )
    return fam


def _isoflop_route(family: str, fam: dict, warnings: list[str], bootstrap: int, seed: int) -> None:
    """The power laws N_opt = a C^b and D_opt = a' C^b' through the bracketed minima
    (``n_law``, ``d_law``) and their bootstrap (``route_boot``,
    :func:`scaling_isoflop.bootstrap_route`), or a warning saying why there are none."""
    minima, k = fam["minima"], fam["k"]
    inside = [m for m in minima if m.bracketed]
    if len(inside) < 2:
        if len(minima) >= 2:
            warnings.append(
                f"{family}: {len(inside)} of {len(minima)} budgets have a minimum "
                "inside their ladder; the power laws N_opt = a C^b and D_opt = a' C^b' "
                "need 2, so neither is given"
            )
        return
    fam["n_law"] = scaling_fit.power_law([m.budget for m in inside], [m.n_opt for m in inside])
    fam["d_law"] = scaling_fit.power_law(
        [m.budget for m in inside], [m.budget / (k * m.n_opt) for m in inside]
    )
    if not bootstrap:
        return
    by_budget: dict[float, tuple[list, list]] = {m.budget: ([], []) for m in minima}
    for r in fam["runs"]:
        if r["budget"] in by_budget:
            by_budget[r["budget"]][0].append(r["active_params"])
            by_budget[r["budget"]][1].append(r["loss"])
    boot = scaling_isoflop.bootstrap_route(by_budget, k, bootstrap, seed)
    if boot is None:
        warnings.append(
            f"{family}: every budget has exactly 3 sizes, so each parabola passes "
            "through its runs and shows no scatter: the power laws get no interval "
            "(plan 4 or more sizes per budget)"
        )
        return
    if boot.failed <= boot.resamples / 2:
        fam["route_boot"] = boot
    else:
        warnings.append(
            f"{family}: {boot.failed} of {boot.resamples} bootstrap resamples of the "
            "losses leave fewer than 2 budgets with a minimum inside the ladder: the "
            "power laws rest on minima the scatter of the runs can move off their "
            "ladders, so their intervals are withheld; add sizes on both sides of each "
            "budget's minimum"
        )


def _envelope_against_route(family: str, fam: dict) -> list[str]:
    """A warning when the envelope's N_opt, at the largest compute its law was fitted through,
    lies outside the IsoFLOP route's 95% interval there."""
    env, boot = fam["envelope"], fam.get("route_boot")
    if env.n_law is None or boot is None:
        return []
    top = float(env.c[env.inside].max())
    n_env = env.n_law[0] * top ** env.n_law[1]
    lo, hi = boot.n_interval(top)
    if lo <= n_env <= hi:
        return []
    fam["envelope_outside"] = (lo, hi)  # the summary marks the envelope's figures
    sizes = len(set(env.n[env.inside]))
    return [
        f"{family}: the envelope of the training curves puts N_opt at C {top:.3g} at "
        f"{n_env:.4g}, outside the IsoFLOP route's 95% interval there ({lo:.4g} to "
        f"{hi:.4g}): the envelope picks among the ladder's sizes ({sizes} win somewhere) by "
        "training losses, the route interpolates between them on the validation losses; "
        "take the route's, and add sizes per budget to bring the two together"
    ]


TRAIN_VALID_WARN = 0.10
"""The envelope (training loss) and the rest (validation loss) are said to measure different
data when the runs' last training losses lie this far from their validation losses (median)."""


def _train_validation_gap(family: str, runs: list[dict], env) -> list[str]:
    """A warning when each run's smoothed training loss at its last step and its final
    validation loss differ by more than :data:`TRAIN_VALID_WARN` (median over the runs): one
    pass over data like the validation split leaves them within a few percent, so the
    validation tokens are unlike the training batches, and the envelope, fitted on training
    losses, measures other data than the IsoFLOP minima and the law."""
    gaps = [
        float(env.curves[r["name"]][1][-1] / r["loss"] - 1) for r in runs if r["name"] in env.curves
    ]
    median = float(np.median(gaps))
    if abs(median) <= TRAIN_VALID_WARN:
        return []
    return [
        f"{family}: the runs' last training losses lie {median:+.0%} from their final "
        f"validation losses (median of {len(gaps)} runs; {min(gaps):+.0%} to "
        f"{max(gaps):+.0%}): the validation tokens they are scored on are unlike their "
        "training data, so the envelope of the training curves and the IsoFLOP minima and "
        "law of the validation losses measure different text; where they disagree, trust "
        "neither"
    ]


def _law_warnings(family: str, fit: scaling_fit.ParametricFit, runs: list[dict]) -> list[str]:
    """Too few runs for the law's five constants, constants on the optimiser's bounds, and
    bootstrap fits on them, each with what to add."""
    out = []
    sizes = Counter(r["budget"] for r in runs)
    full = sum(c >= 3 for c in sizes.values())
    if full < LAW_BUDGETS:
        out.append(
            f"{family}: the law's 5 constants rest on {len(runs)} runs of {len(sizes)} "
            f"budget(s), {full} of them with 3 or more sizes; it needs {LAW_BUDGETS} or "
            "more budgets of 3 or more sizes each to tell the size term from the tokens "
            f"term and the floor: add {LAW_BUDGETS - full} budget(s), and read its "
            "constants and predictions as unsettled until then"
        )
    for name, side, bound in fit.on_bounds():
        out.append(
            f"{family}: the law's {name} = {bound:.4g} sits on the optimiser's {side} "
            "bound, so the runs do not determine it and every prediction of this law "
            f"rests on that bound; {BOUND_ADVICE[(name, side)]}"
        )
    hit = fit.boot_on_bounds()
    if hit:
        out.append(
            f"{family}: {hit} of {len(fit.boot)} bootstrap fits put a constant on its "
            "bound; the 95% intervals are marked where they reach one"
        )
    return out


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
    last = {
        f: max(r["budget"] for r in rs)
        for f, rs in by_family.items()
        if len({r["budget"] for r in rs}) >= 3
    }
    earlier = {f: [r for r in by_family[f] if r["budget"] < b] for f, b in last.items()}
    laws = _fits(earlier, floor, 0, 0)
    out = {}
    for f, fit in laws.items():
        held = sorted(
            (r for r in by_family[f] if r["budget"] == last[f]), key=lambda r: r["active_params"]
        )
        errors = [
            float(r["loss"] / fit.law.loss(r["active_params"], r["tokens"]) - 1) for r in held
        ]
        out[f] = {
            "budget": last[f],
            "fitted_runs": len(earlier[f]),
            "runs": [r["name"] for r in held],
            "errors": errors,
            "median_abs": float(np.median(np.abs(errors))),
        }
    return out


def optimum_trend(results: list[dict]) -> dict[str, tuple]:
    """Per family, how N_opt grows with the budget on these runs, for centring a new budget's
    ladder: (a, b, description) of N_opt = a C^b, from the power law through the bracketed
    IsoFLOP minima, or with one such minimum, from it with b = 0.5 (Chinchilla's exponent). A
    family without a bracketed minimum is absent."""
    by_family: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        by_family[r["family"]].append(r)
    out = {}
    for family, runs in by_family.items():
        inside = [m for m in _minima(family, runs, []) if m.bracketed]
        if len(inside) >= 2:
            a, b = scaling_fit.power_law([m.budget for m in inside], [m.n_opt for m in inside])
            out[family] = (a, b, f"the power law through the minima of {len(inside)} budgets")
        elif inside:
            m = inside[0]
            out[family] = (
                m.n_opt / math.sqrt(m.budget),
                0.5,
                f"the minimum of budget {m.budget:.3g}, grown as C^0.5",
            )
    return out


def predict(analysis: dict, family: str, budget: float) -> dict:
    """The compute-optimal N, D and loss of ``budget`` for ``family`` from its parametric law,
    with 95% bootstrap intervals (the ladder shape to train: ``launch.scaling.predicted_run``,
    which knows the sweep's base model)."""
    fam = analysis["families"].get(family)
    if fam is None:
        raise ScalingError(f"the sweep has no finished {family} run")
    if "fit" not in fam:
        raise ScalingError(
            f"{family}: {len(fam['runs'])} finished runs; a prediction needs the "
            "parametric law, which needs 5"
        )
    fit, k = fam["fit"], fam["k"]
    n, d, loss = fit.law.optimum(budget, k)
    out = {
        "family": family,
        "budget": budget,
        "n_opt": n,
        "d_opt": d,
        "loss": loss,
        "backtest": fam.get("backtest"),
        "on_bounds": fit.on_bounds(),
        "n_interval": fit.interval(lambda b: b.optimum(budget, k)[0]),
        "d_interval": fit.interval(lambda b: b.optimum(budget, k)[1]),
        "loss_interval": fit.interval(lambda b: b.optimum(budget, k)[2]),
        "ratio_interval": fit.interval(lambda b: _tokens_per_param(b, budget, k)),
        "bytes_per_token": analysis.get("bytes_per_token"),
    }
    if "n_law" in fam:
        # The IsoFLOP route (Chinchilla's second approach) as a cross-check on N_opt: the power
        # law through the bracketed per-budget minima. It assumes nothing about the shape of
        # L(N, D), and where the law's minimum along the budget is flat its N_opt is the less
        # certain of the two.
        a, b = fam["n_law"]
        n_iso = a * budget**b
        out["isoflop"] = {
            "n_opt": n_iso,
            "ratio": budget / (k * n_iso**2),
            "budgets": sum(m.bracketed for m in fam["minima"]),
            "left_out": [m.budget for m in fam["minima"] if not m.bracketed],
        }
        boot = fam.get("route_boot")
        if boot is not None:
            out["isoflop"].update(
                exponent_interval=boot.exponent_interval(),
                ratio_interval=boot.ratio_interval(budget),
            )
    runs = fam["runs"]
    if family == "moe":
        best = min(runs, key=lambda r: (abs(math.log(r["budget"] / budget)), r["loss"]))
        out["experts"] = best["experts"]
    budgets = sorted({r["budget"] for r in runs})
    if budget > 10 * budgets[-1]:
        analysis["warnings"].append(
            f"{budget:.3g} is {budget / budgets[-1]:.0f}x the sweep's "
            "largest budget: the interval is only as good as the law"
        )
    return out


def _tokens_per_param(law: scaling_fit.Law, budget: float, k: float) -> float:
    """D_opt / N_opt of ``law`` at ``budget`` (infinite where its N_opt is 0)."""
    n, d, _ = law.optimum(budget, k)
    return d / n if n else math.inf
