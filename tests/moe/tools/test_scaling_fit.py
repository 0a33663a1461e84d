"""The fits of a scaling sweep (moe/tools/scaling_fit.py) on synthetic losses whose constants
are known."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moe.core.errors import ScalingError
from moe.tools import scaling_fit as sf
from moe.tools import scaling_report, scaling_text
from moe.tools.scaling_fit import Law
from tests.helpers.scaling_runs import dense_runs

TRUE = Law(E=1.82, A=482.0, B=2085.0, alpha=0.348, beta=0.366)


def synthetic(noise: float, seed: int = 1):
    """A 40-point grid (8 sizes x 5 token counts) of TRUE's losses with relative noise."""
    rng = np.random.default_rng(seed)
    n, d = (a.ravel() for a in np.meshgrid(np.geomspace(1e7, 1e10, 8), np.geomspace(1e9, 1e12, 5)))
    return n, d, TRUE.loss(n, d) * (1 + noise * rng.standard_normal(n.size))


def test_the_parametric_fit_recovers_known_constants_with_bootstrap_intervals():
    n, d, loss = synthetic(0.01)
    fit = sf.fit_parametric(n, d, loss, bootstrap=40)
    assert abs(fit.law.alpha - TRUE.alpha) < 0.02
    assert abs(fit.law.beta - TRUE.beta) < 0.02
    lo, hi = fit.interval(lambda b: b.alpha)
    assert lo <= TRUE.alpha <= hi
    lo, hi = fit.interval(lambda b: b.beta)
    assert lo <= TRUE.beta <= hi
    assert len(fit.boot) == 40 and len({round(b.alpha, 6) for b in fit.boot}) > 5


MOE = Law(E=1.82, A=300.0, B=1500.0, alpha=0.33, beta=0.35)
"""A second family on the same data: the floor E is TRUE's."""


def _huber(law: Law, n, d, loss) -> float:
    p = np.array([math.log(law.A), math.log(law.B), math.log(law.E), law.alpha, law.beta])
    return sf._objective(p, np.log(n), np.log(d), np.log(loss))[0]


def test_the_fit_reaches_at_least_the_objective_of_the_true_constants():
    """The fit minimises the Huber objective: on every noisy grid its objective is no higher
    than that of the constants that generated the losses. With L-BFGS-B's default stopping rules
    it ended above them on 5 of these 16 grids (up to 3.8x, beta off by up to 0.38)."""
    n, d = (a.ravel() for a in np.meshgrid(np.geomspace(1e7, 1e10, 8), np.geomspace(1e9, 1e12, 5)))
    for law in (TRUE, MOE):
        for seed in range(8):
            loss = law.loss(n, d) * (1 + 0.01 * np.random.default_rng(seed).standard_normal(n.size))
            fit = sf.fit_parametric(n, d, loss, bootstrap=0).law
            assert _huber(fit, n, d, loss) <= _huber(law, n, d, loss) * (1 + 1e-9), (law, seed)


def test_a_shared_floor_fits_both_families_with_one_e():
    """fit_shared_floor: one E for both laws, each family's exponents recovered, and the
    bootstrap intervals cover the truth."""
    n, d, loss = synthetic(0.01)
    moe_loss = MOE.loss(n, d) * (1 + 0.01 * np.random.default_rng(2).standard_normal(n.size))
    fits = sf.fit_shared_floor({"dense": (n, d, loss), "moe": (n, d, moe_loss)}, bootstrap=20)
    assert fits["dense"].law.E == fits["moe"].law.E
    assert abs(fits["dense"].law.E - 1.82) < 0.03
    for family, law in (("dense", TRUE), ("moe", MOE)):
        fit = fits[family]
        assert abs(fit.law.alpha - law.alpha) < 0.02 and abs(fit.law.beta - law.beta) < 0.02
        assert len(fit.boot) == 20 and all(b.E == o.E for b, o in zip(fit.boot, fits["dense"].boot))
        for name in ("alpha", "beta", "E"):
            lo, hi = fit.interval(lambda b, name=name: getattr(b, name))
            assert lo <= getattr(law, name) <= hi, (family, name, lo, hi)
    with pytest.raises(ScalingError, match="two or more families"):
        sf.fit_shared_floor({"dense": (n, d, loss)})
    with pytest.raises(ScalingError, match="floor 'both'"):
        sf.fit_laws({"dense": (n, d, loss)}, floor="both")
    # one family: fitted on its own whatever the floor
    alone = sf.fit_laws({"dense": (n, d, loss)}, floor="shared", bootstrap=0)
    assert alone["dense"].law == sf.fit_parametric(n, d, loss, bootstrap=0).law


def test_a_shared_floor_pins_e_where_one_family_alone_cannot():
    """A family seen over a narrow range of sizes misplaces its floor on its own; fitted with a
    family that spans a wide range, the shared E holds it, and its law extrapolates closer to
    the truth 10x beyond its largest size."""
    rng = np.random.default_rng(3)
    n, d = (a.ravel() for a in np.meshgrid(np.geomspace(1e7, 1e10, 8), np.geomspace(1e9, 1e12, 5)))
    wide = TRUE.loss(n, d) * (1 + 0.01 * rng.standard_normal(n.size))
    n2, d2 = (a.ravel() for a in np.meshgrid(np.geomspace(1e7, 1e8, 4), np.geomspace(1e9, 1e10, 4)))
    narrow = MOE.loss(n2, d2) * (1 + 0.01 * rng.standard_normal(n2.size))
    own = sf.fit_parametric(n2, d2, narrow, bootstrap=0).law
    shared = sf.fit_shared_floor({"dense": (n, d, wide), "moe": (n2, d2, narrow)}, bootstrap=0)[
        "moe"
    ].law
    far_n, far_d = 1e9, 1e11
    truth = MOE.loss(far_n, far_d)
    own_error = abs(own.loss(far_n, far_d) / truth - 1)
    shared_error = abs(shared.loss(far_n, far_d) / truth - 1)
    assert abs(shared.E - 1.82) < abs(own.E - 1.82)
    assert shared_error < own_error / 2, (own_error, shared_error)


def test_the_compute_optimum_is_the_minimum_along_the_budget():
    k, budget = 6.0, 1e21
    n_opt, d_opt, loss = TRUE.optimum(budget, k)
    assert math.isclose(k * n_opt * d_opt, budget, rel_tol=1e-9)
    for f in (0.7, 0.9, 1.1, 1.4):  # any other split of the same compute is worse
        n = n_opt * f
        assert TRUE.loss(n, budget / (k * n)) > loss


def test_power_laws_through_the_minima():
    budgets = np.geomspace(1e18, 1e22, 5)
    a, b = sf.power_law(budgets, 0.1 * budgets**0.5)
    assert math.isclose(b, 0.5, rel_tol=1e-9) and math.isclose(a, 0.1, rel_tol=1e-6)


def test_compute_multiplier():
    k, budget = 6.0, 1e20
    # A MoE that reaches exactly dense's optimal loss at the same budget saves nothing ...
    assert math.isclose(
        sf.compute_multiplier(TRUE, k, TRUE.optimum(budget, k)[2], budget), 1.0, rel_tol=1e-6
    )
    # ... one that reaches dense's optimal loss of 3x the budget saves 3x.
    better = TRUE.optimum(3 * budget, k)[2]
    assert math.isclose(sf.compute_multiplier(TRUE, k, better, budget), 3.0, rel_tol=1e-5)
    assert sf.compute_multiplier(TRUE, k, TRUE.E * 0.99, budget) == math.inf


def test_expert_law_recovers_its_constants():
    rng = np.random.default_rng(0)
    n = np.repeat(np.geomspace(1e6, 1e8, 6), 3)
    e = np.tile([4, 16, 64], 6)
    true = {"a": -0.08, "b": -0.03, "c": 0.001, "d": 2.4}
    loss = np.exp(
        true["a"] * np.log(n)
        + true["b"] * np.log(e)
        + true["c"] * np.log(n) * np.log(e)
        + true["d"]
    ) * (1 + 1e-4 * rng.standard_normal(n.size))
    got = sf.clark_law(n, e, loss)
    for key, value in true.items():
        assert abs(got[key] - value) < 2e-3 + 0.05 * abs(value)
    with pytest.raises(ScalingError, match="two or more expert counts"):
        sf.clark_law(n, np.full(n.size, 8), loss)


def test_percentile_intervals_keep_an_infinite_sample_infinite():
    """A multiplier that no bootstrap dense law reaches is inf; interpolating between it and a
    finite neighbour gave NaN (and a numpy warning)."""
    finite = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert sf.percentile_interval(finite) == tuple(np.percentile(finite, (2.5, 97.5)))
    with np.errstate(invalid="raise"):
        lo, hi = sf.percentile_interval([1.0, 2.0, 3.0, 4.0, float("inf")])
    assert lo == 1.0 and hi == float("inf")


def _reference_objective(p, log_n, log_d, log_l):
    """The Huber objective written out point by point in float64 (math, no arrays)."""
    a, b, e, alpha, beta = map(float, p)
    total = 0.0
    for x, y, z in zip(log_n, log_d, log_l):
        r = math.log(math.exp(a - alpha * x) + math.exp(b - beta * y) + math.exp(e)) - z
        total += (
            0.5 * r * r
            if abs(r) <= sf.HUBER_DELTA
            else sf.HUBER_DELTA * (abs(r) - 0.5 * sf.HUBER_DELTA)
        )
    return total


def test_the_vectorised_objective_its_gradient_and_hessian_match_a_slow_reference():
    """_batch for many parameter vectors at once: each value equals the point-by-point float64
    objective, the gradient its central differences, the Hessian the gradient's; weights equal
    to a resample's counts give the resample's objective."""
    n, d, loss = synthetic(0.01)
    log_n, log_d, log_l = np.log(n), np.log(d), np.log(loss)
    rng = np.random.default_rng(0)
    p = np.column_stack(
        [
            rng.uniform(4, 9, 6),
            rng.uniform(5, 10, 6),
            rng.uniform(0.3, 0.9, 6),
            rng.uniform(0.2, 0.6, 6),
            rng.uniform(0.2, 0.6, 6),
        ]
    )
    value, grad, hess = sf._batch(p, log_n, log_d, log_l, hessian=True)
    eps = 1e-6
    for k in range(len(p)):
        assert value[k] == pytest.approx(_reference_objective(p[k], log_n, log_d, log_l), rel=1e-12)
        for i in range(5):
            step = eps * np.eye(5)[i]
            fd = (
                _reference_objective(p[k] + step, log_n, log_d, log_l)
                - _reference_objective(p[k] - step, log_n, log_d, log_l)
            ) / (2 * eps)
            assert grad[k, i] == pytest.approx(fd, rel=1e-5, abs=1e-10)
            g_hi = sf._batch((p[k] + step)[None], log_n, log_d, log_l)[1][0]
            g_lo = sf._batch((p[k] - step)[None], log_n, log_d, log_l)[1][0]
            assert hess[k, i] == pytest.approx((g_hi - g_lo) / (2 * eps), rel=1e-4, abs=1e-9)
    idx = rng.integers(0, len(n), len(n))
    counts = np.bincount(idx, minlength=len(n)).astype(float)
    value, grad = sf._objective(p[0], log_n, log_d, log_l, counts)
    assert value == pytest.approx(
        _reference_objective(p[0], log_n[idx], log_d[idx], log_l[idx]), rel=1e-12
    )
    assert np.allclose(
        grad, sf._objective(p[0], log_n[idx], log_d[idx], log_l[idx])[1], rtol=1e-10, atol=1e-15
    )


FIT_TOLERANCE = 1e-5
"""The fit's constants (log A, log B, log E, alpha, beta) equal those of L-BFGS-B run to
convergence from the STARTS best grid points alone within this relative difference."""


def _grid_lbfgsb(n, d, loss) -> np.ndarray:
    """The fit as L-BFGS-B to convergence from the 16 best grid points only, the search
    before the Newton refinement was added."""
    from scipy.optimize import minimize
    from threadpoolctl import threadpool_limits

    log_n, log_d, log_l = np.log(n), np.log(d), np.log(loss)
    grid = sf._grid()
    starts = grid[np.argsort(sf._grid_terms(grid, log_n, log_d, log_l).sum(1))[: sf.STARTS]]
    with threadpool_limits(limits=1):
        best = min(
            (
                minimize(
                    sf._objective,
                    p0,
                    args=(log_n, log_d, log_l),
                    jac=True,
                    method="L-BFGS-B",
                    bounds=sf.BOUNDS,
                    options=sf.LBFGS_OPTIONS,
                )
                for p0 in starts
            ),
            key=lambda r: r.fun,
        )
    return best.x


def test_the_fit_equals_lbfgsb_from_the_grid_within_a_stated_tolerance():
    """The refined starts are added to the grid's, never in their place: on well-posed data the
    constants are those of L-BFGS-B from the grid alone (within FIT_TOLERANCE), and the
    objective is never higher, also on 6 runs where constants end on their bounds."""
    for n, d, loss in (synthetic(0.01, 2), _ladder_data((1e18, 3e18, 1e19), seed=3)):
        ref = _grid_lbfgsb(n, d, loss)
        got = sf.fit_parametric(n, d, loss, bootstrap=0).law.params()
        assert np.all(np.abs(got - ref) <= FIT_TOLERANCE * np.maximum(np.abs(ref), 1)), (got, ref)
    for seed in range(2):
        n, d, loss = _degenerate(seed)
        log_n, log_d, log_l = np.log(n), np.log(d), np.log(loss)
        ref = sf._objective(_grid_lbfgsb(n, d, loss), log_n, log_d, log_l)[0]
        got = sf.fit_parametric(n, d, loss, bootstrap=0).law.params()
        assert sf._objective(got, log_n, log_d, log_l)[0] <= ref * (1 + 1e-9)


def _ladder_data(budgets, seed=5, noise=0.003):
    rng = np.random.default_rng(seed)
    n = np.concatenate([TRUE.optimum(b, 6.0)[0] * np.array([0.25, 0.5, 1, 2, 4]) for b in budgets])
    d = np.repeat(budgets, 5) / (6.0 * n)
    return n, d, TRUE.loss(n, d) * (1 + noise * rng.standard_normal(n.size))


def _degenerate(seed=0):
    """6 runs, 2 budgets x 3 sizes, the loss rising with N at both: the fit of the issue that
    ended with constants on their bounds."""
    n = np.array([1.6e4, 2.3e4, 3.3e4] * 2)
    budget = np.repeat([3e10, 1e11], 3)
    loss = np.array([4.9, 5.05, 5.3, 4.5, 4.6, 4.8])
    return n, budget / (8 * n), loss * (1 + 0.01 * np.random.default_rng(seed).standard_normal(6))


def test_the_bootstrap_reports_progress(monkeypatch):
    """progress(k) as resamples finish, k summing to the count; fit_laws opens and closes one
    bar per fit."""
    seen = []
    n, d, loss = _ladder_data((1e18, 3e18, 1e19))
    fit = sf.fit_parametric(n, d, loss, bootstrap=23, progress=seen.append)
    assert sum(seen) == 23 == len(fit.boot) and len(seen) == 3
    bars = []

    class Bar:
        def __init__(self, label, total):
            self.label, self.total, self.done, self.closed = label, total, 0, False
            bars.append(self)

        def update(self, k):
            self.done += k

        def close(self):
            self.closed = True

    sf.fit_laws({"dense": (n, d, loss)}, bootstrap=7, progress=Bar)
    assert [(b.label, b.total, b.done, b.closed) for b in bars] == [("bootstrap dense", 7, 7, True)]


ONE_THREAD_SCRIPT = """
import json, numpy as np
from threadpoolctl import threadpool_info
from moe.tools import scaling_fit as sf
seen = []
lbfgsb = sf._lbfgsb
def spy(*args, **kwargs):
    out = lbfgsb(*args, **kwargs)  # the first call loads SciPy's OpenBLAS
    seen.extend(p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas")
    return out
sf._lbfgsb = spy
n = np.geomspace(1e6, 1e8, 6)
sf.fit_parametric(n, 1e11 / n, 2 + 30 / n ** 0.3 + 400 / (1e11 / n) ** 0.3, bootstrap=0)
print(json.dumps(seen))
"""


def test_the_fit_runs_on_one_blas_thread_in_a_fresh_process():
    """L-BFGS-B calls LAPACK on 5x5 systems thousands of times; OpenBLAS spreading each call
    over every core made a fit of 6 runs take minutes. In a fresh interpreter (SciPy's OpenBLAS
    not loaded yet, so a limit set before loading it would miss it) every BLAS library the
    search sees runs one thread."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run(
        [sys.executable, "-c", ONE_THREAD_SCRIPT],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[3],
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen and set(seen) == {1}, seen


def test_constants_on_the_optimisers_bounds_are_flagged_with_what_to_add():
    """The issue's fit: 6 runs over 2 budgets, constants on their bounds. The warnings name
    each such constant, its bound and what to add, and that 2 budgets are too few; the summary
    marks the law degenerate and the interval ends that sit on a bound; the prediction says it
    rests on a degenerate law."""
    n, d, loss = _degenerate()
    runs = [
        {
            "name": f"r{i}",
            "family": "dense",
            "budget": b,
            "active_params": float(x),
            "tokens": float(t),
            "flops": b,
            "width": 16,
            "experts": 0,
            "loss": float(v),
            "steps": 300,
        }
        for i, (x, t, v, b) in enumerate(zip(n, d, loss, np.repeat([3e10, 1e11], 3)))
    ]
    analysis = scaling_report.analyse(runs, bootstrap=20)
    fit = analysis["families"]["dense"]["fit"]
    flags = fit.on_bounds()
    assert flags
    warnings = analysis["warnings"]
    for name, side, bound in flags:
        (w,) = [
            w for w in warnings if f"law's {name} = {bound:.4g} sits on the optimiser's {side}" in w
        ]
        assert scaling_report.BOUND_ADVICE[(name, side)] in w
    assert any("6 runs of 2 budget(s)" in w and "add 1 budget(s)" in w for w in warnings)
    assert any("bootstrap fits put a constant on its bound" in w for w in warnings)
    text = scaling_text.summary(analysis)
    assert "degenerate: " in text and "(its bound)" in text
    p = scaling_report.predict(analysis, "dense", 1e12)
    assert "degenerate law" in scaling_text.prediction_text(p)
    # a well-posed law has none of these
    good = [
        dict(r, budget=float(b), name=f"g{i}")
        for i, (r, b) in enumerate(
            zip(
                [
                    {
                        "family": "dense",
                        "active_params": float(x),
                        "tokens": float(t),
                        "flops": 0,
                        "width": 16,
                        "experts": 0,
                        "loss": float(v),
                        "steps": 300,
                    }
                    for x, t, v in zip(*_ladder_data((1e18, 3e18, 1e19)))
                ],
                np.repeat([1e18, 3e18, 1e19], 5),
            )
        )
    ]
    for r in good:
        r["flops"] = r["budget"]
    clean = scaling_report.analyse(good, bootstrap=10)
    assert not clean["families"]["dense"]["fit"].on_bounds()
    assert not [w for w in clean["warnings"] if "bound" in w or "budget(s)" in w]
    assert "degenerate" not in scaling_text.summary(clean)


def _budget_runs(budget, losses, n=(1e4, 2e4, 4e4, 8e4, 1.6e5)):
    runs = dense_runs([(16, x, v) for x, v in zip(n, losses)], budget)
    for i, r in enumerate(runs):
        r.update(name=f"c{budget:g}-{i}", steps=300)
    return runs


def test_an_extrapolated_or_concave_vertex_stays_out_of_the_power_law_and_the_plot():
    """The issue's sweep: the loss rising with N at a budget puts the parabola's vertex far
    below the ladder, another budget's parabola opens downwards. Neither enters N_opt = a C^b,
    the IsoFLOP route or the plot's stars; the summary prints them as what they are."""
    bracketed = {1e12: [4.3, 4.1, 4.0, 4.1, 4.3], 1e13: [3.9, 3.7, 3.55, 3.5, 3.6]}
    off = {3e11: [4.0, 4.1, 4.25, 4.45, 4.7], 3e13: [3.3, 3.6, 3.8, 3.9, 3.95]}
    runs = [r for b, v in {**bracketed, **off}.items() for r in _budget_runs(b, v)]
    analysis = scaling_report.analyse(runs, bootstrap=0)
    fam = analysis["families"]["dense"]
    kinds = {m.budget: m.kind for m in fam["minima"]}
    assert kinds == {3e11: "extrapolated", 1e12: "bracketed", 1e13: "bracketed", 3e13: "concave"}
    inside = [m for m in fam["minima"] if m.bracketed]
    assert fam["n_law"] == sf.power_law([m.budget for m in inside], [m.n_opt for m in inside])
    text = scaling_text.summary(analysis)
    far = next(m for m in fam["minima"] if m.budget == 3e11)
    assert f"N_opt {far.n_opt:.4g}" not in text and "C 3e+11: no minimum inside the ladder" in text
    assert "(through the minima of 2 budgets)" in text
    p = scaling_report.predict(analysis, "dense", 1e14)
    assert p["isoflop"]["budgets"] == 2 and p["isoflop"]["left_out"] == [3e11, 3e13]
    assert "left out: 3e+11, 3e+13" in scaling_text.prediction_text(p)
    # One bracketed budget: no power law, no IsoFLOP route, and a warning saying why.
    runs = [r for b, v in off.items() for r in _budget_runs(b, v)] + _budget_runs(
        1e12, bracketed[1e12]
    )
    analysis = scaling_report.analyse(runs, bootstrap=0)
    assert "n_law" not in analysis["families"]["dense"]
    assert any("1 of 3 budgets have a minimum inside" in w for w in analysis["warnings"])
    assert "IsoFLOP route        none" in scaling_text.prediction_text(
        scaling_report.predict(analysis, "dense", 1e14)
    )
    # The plot: stars only at bracketed vertices; the others' lowest runs hollow.
    from moe.tools import scaling_plot

    class Axis:
        def __init__(self):
            self.points = []

        def scatter(self, x, y, marker="o", **kw):
            self.points += [(float(a), float(b), marker) for a, b in zip(x, y)]

        def plot(self, *a, **kw):
            pass

        def annotate(self, *a, **kw):
            pass

    ax = Axis()
    scaling_plot._isoflop_panel(ax, analysis["families"]["dense"], "k")
    stars = [(x, y) for x, y, marker in ax.points if marker == "*"]
    m = next(m for m in analysis["families"]["dense"]["minima"] if m.bracketed)
    assert stars == [(m.n_opt, m.loss_opt)]
    assert (1e4, 4.0, "<") in ax.points and (1e4, 3.3, "<") in ax.points
