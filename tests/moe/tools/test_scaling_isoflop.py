"""Chinchilla's second approach (moe/tools/scaling_isoflop.py) on synthetic losses whose
constants are known: the per-budget minima, and the bootstrap intervals of the power laws."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moe.tools import scaling_isoflop as si
from moe.tools import scaling_report, scaling_text
from moe.tools.scaling_fit import Law

TRUE = Law(E=1.82, A=482.0, B=2085.0, alpha=0.348, beta=0.366)
K = 6.0
BUDGETS = (1e18, 3e18, 1e19, 3e19)
LADDER = np.array([0.25, 0.5, 1.0, 2.0, 4.0])


def test_isoflop_minimum_and_the_edge_of_the_ladder():
    budget, k = 1e20, 6.0
    n_opt = TRUE.optimum(budget, k)[0]
    inside = n_opt * np.array([0.25, 0.5, 1.0, 2.0, 4.0])
    m = si.isoflop_minimum(budget, inside, TRUE.loss(inside, budget / (k * inside)))
    assert m.bracketed and not m.at_edge and abs(math.log(m.n_opt / n_opt)) < 0.1
    beyond = n_opt * np.array([4.0, 8.0, 16.0, 32.0])  # every size larger than the optimum
    m = si.isoflop_minimum(budget, beyond, TRUE.loss(beyond, budget / (k * beyond)))
    assert m.at_edge and m.side == "smaller" and m.lowest_n == beyond[0]
    runs = [
        {
            "name": f"r{i}",
            "family": "dense",
            "budget": budget,
            "active_params": float(x),
            "tokens": budget / (k * x),
            "flops": budget,
            "width": 64 * (i + 1),
            "experts": 0,
            "loss": float(TRUE.loss(x, budget / (k * x))),
        }
        for i, x in enumerate(beyond)
    ]
    (w,) = [
        w
        for w in scaling_report.analyse(runs, bootstrap=0)["warnings"]
        if "no minimum inside the ladder" in w
    ]
    assert "add sizes with smaller N" in w
    # the same runs mirrored (loss falling with N): the other side
    for r, x in zip(runs, beyond[::-1]):
        r["loss"] = float(TRUE.loss(x, budget / (k * x)))
    (w,) = [
        w
        for w in scaling_report.analyse(runs, bootstrap=0)["warnings"]
        if "no minimum inside the ladder" in w
    ]
    assert "add sizes with larger N" in w


def test_isoflop_minima_are_told_apart_by_kind_and_side():
    """Bracketed, lowest run at an end, vertex beyond the ladder (how far, which side), and a
    parabola opening downwards; only the first is a minimum of the runs."""
    n = [1e4, 2e4, 4e4, 8e4, 1.6e5]
    cases = {
        "bracketed": ([4.3, 4.1, 4.0, 4.1, 4.3], None),
        "edge": ([4.00, 4.01, 4.06, 4.16, 4.35], "smaller"),  # vertex inside, lowest at the end
        "extrapolated": ([4.0, 4.1, 4.25, 4.45, 4.7], "smaller"),
        "concave": ([4.0, 4.3, 4.5, 4.6, 4.65], "smaller"),
    }
    for kind, (loss, side) in cases.items():
        m = si.isoflop_minimum(1e12, n, loss)
        assert (m.kind, m.side) == (kind, side), (kind, m)
        assert m.bracketed == (kind == "bracketed") and m.n_range == (1e4, 1.6e5)
        assert (m.problem() == "") == (kind == "bracketed")
    m = si.isoflop_minimum(1e12, n, cases["extrapolated"][0])
    factor = 1e4 / m.n_opt
    assert factor > 1 and f"{factor:.3g}x below the smallest run" in m.problem()
    m = si.isoflop_minimum(1e12, n, [4.65, 4.6, 4.5, 4.3, 4.0])
    assert m.kind == "concave" and m.side == "larger" and m.n_opt == m.lowest_n == 1.6e5


def _sweep(noise: float, seed: int, sizes=LADDER) -> dict:
    """budget -> (N, loss) of five sizes around TRUE's optimum, with relative noise."""
    rng = np.random.default_rng(seed)
    out = {}
    for b in BUDGETS:
        n = TRUE.optimum(b, K)[0] * sizes
        out[b] = (
            list(n),
            list(TRUE.loss(n, b / (K * n)) * (1 + noise * rng.standard_normal(len(n)))),
        )
    return out


def _exponent(data: dict) -> tuple[float, float]:
    """(log a, b) of N_opt = a C^b through the bracketed minima."""
    ms = [m for m in (si.isoflop_minimum(b, *v) for b, v in data.items()) if m.bracketed]
    b, log_a = np.polyfit(np.log([m.budget for m in ms]), np.log([m.n_opt for m in ms]), 1)
    return float(log_a), float(b)


def test_the_route_bootstrap_covers_the_exponent_and_the_tokens_per_parameter():
    """Over 40 synthetic sweeps at 1% noise, the 95% intervals of the exponent of N_opt and of
    D/N at the largest budget cover the noise-free values about 95% of the time, and are about
    as wide as 1.96 standard deviations of the point estimates either side: resampling the
    runs themselves gave intervals 2.4x too wide (coverage 99%); no scatter at all would give
    intervals of width 0."""
    log_a0, b0 = _exponent(_sweep(0.0, 0))
    assert abs(b0 - TRUE.beta / (TRUE.alpha + TRUE.beta)) < 0.01
    top = BUDGETS[-1]
    hits, widths, estimates, ratio_hits = 0, [], [], 0
    for seed in range(40):
        data = _sweep(0.01, seed + 1)
        boot = si.bootstrap_route(data, K, 100, seed)
        lo, hi = boot.exponent_interval()
        hits += lo <= b0 <= hi
        widths.append(hi - lo)
        estimates.append(_exponent(data)[1])
        rlo, rhi = boot.ratio_interval(top)
        ratio_hits += rlo <= float(boot.ratio(top, log_a0, b0)) <= rhi
    spread = 3.92 * np.std(estimates)
    assert 0.85 <= hits / 40 and 0.85 <= ratio_hits / 40, (hits, ratio_hits)
    assert 0.6 * spread < np.median(widths) < 1.6 * spread, (np.median(widths), spread)


def test_the_tokens_per_parameter_of_the_route_is_c_over_k_n_squared():
    boot = si.bootstrap_route(_sweep(0.003, 1), K, 20)
    assert boot.resamples == 20 and len(boot.b) + boot.failed == 20
    n = math.exp(1.5) * 1e20**0.5
    assert float(boot.ratio(1e20, 1.5, 0.5)) == pytest.approx(1e20 / (K * n * n), rel=1e-12)


def test_three_sizes_per_budget_show_no_scatter_to_resample():
    data = _sweep(0.01, 1, sizes=LADDER[1:4])
    assert si.bootstrap_route(data, K, 20) is None
    runs = [
        {
            "name": f"r{b:g}-{i}",
            "family": "dense",
            "budget": b,
            "active_params": x,
            "tokens": b / (K * x),
            "flops": b,
            "width": 64,
            "experts": 0,
            "loss": v,
            "steps": 300,
        }
        for b, (n, loss) in data.items()
        for i, (x, v) in enumerate(zip(n, loss))
    ]
    analysis = scaling_report.analyse(runs, bootstrap=5)
    assert "route_boot" not in analysis["families"]["dense"]
    assert any("plan 4 or more sizes per budget" in w for w in analysis["warnings"])


def test_fit_and_predict_print_the_route_intervals():
    runs = [
        {
            "name": f"r{b:g}-{i}",
            "family": "dense",
            "budget": b,
            "active_params": x,
            "tokens": b / (K * x),
            "flops": b,
            "width": 64,
            "experts": 0,
            "loss": v,
            "steps": 300,
        }
        for b, (n, loss) in _sweep(0.003, 2).items()
        for i, (x, v) in enumerate(zip(n, loss))
    ]
    analysis = scaling_report.analyse(runs, bootstrap=30)
    fam = analysis["families"]["dense"]
    lo, hi = fam["route_boot"].exponent_interval()
    assert lo < fam["n_law"][1] < hi
    text = scaling_text.summary(analysis)
    assert f"(95%: {lo:.3f} to {hi:.3f}), D_opt" in text
    assert f"(95%: {1 - hi:.3f} to {1 - lo:.3f})" in text
    nlo, nhi = fam["route_boot"].n_interval(3e19)
    assert (
        f"at C 3e+19: N_opt {fam['n_law'][0] * 3e19 ** fam['n_law'][1]:.4g} (95%: {nlo:.4g} "
        f"to {nhi:.4g}), D/N " in text
    )
    assert nlo < TRUE.optimum(3e19, K)[0] < nhi
    p = scaling_report.predict(analysis, "dense", 1e20)
    rlo, rhi = p["isoflop"]["ratio_interval"]
    assert rlo < p["isoflop"]["ratio"] < rhi
    law_lo, law_hi = p["ratio_interval"]
    assert law_lo < p["d_opt"] / p["n_opt"] < law_hi
    out = scaling_text.prediction_text(p)
    assert f"exponent of N_opt 95%: {p['isoflop']['exponent_interval'][0]:.3f}" in out
    assert f"(95%: {law_lo:.1f} to {law_hi:.1f})" in out
