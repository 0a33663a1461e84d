"""Chinchilla's first approach (moe/tools/scaling_envelope.py): the minimum envelope of the
training curves, on synthetic curves whose law is known."""

from __future__ import annotations

import numpy as np
import pytest

from moe.tools import scaling_envelope as se
from moe.tools import scaling_report, scaling_text
from moe.tools.scaling_fit import Law

TRUE = Law(E=1.82, A=482.0, B=2085.0, alpha=0.348, beta=0.366)
K = 6.0
BUDGETS = (1e18, 3e18, 1e19, 3e19)


def curve_runs(sizes=None, noise=0.0, steps=400, seed=0, law=TRUE):
    """For every budget, runs of the same sizes (default: factors of sqrt(2) from a quarter of
    the law's N_opt at the smallest budget to 4x that of the largest, so that no ladder is
    centred on an optimum), each with a curve: at step s the law's loss after s / steps of its
    tokens, times 1 + noise x a standard normal per step (one batch's loss)."""
    rng = np.random.default_rng(seed)
    if sizes is None:
        lo, hi = law.optimum(BUDGETS[0], K)[0] / 4, law.optimum(BUDGETS[-1], K)[0] * 4
        sizes = lo * np.sqrt(2) ** np.arange(int(np.log2(hi / lo) * 2) + 1)
    runs = []
    for b in BUDGETS:
        for n in sizes:
            d = b / (K * n)
            s = np.arange(1, steps + 1)
            loss = law.loss(n, d * s / steps) * (1 + noise * rng.standard_normal(steps))
            runs.append(
                {
                    "name": f"c{b:g}-n{n:.4g}",
                    "family": "dense",
                    "budget": b,
                    "steps": steps,
                    "active_params": float(n),
                    "tokens": d,
                    "flops": b,
                    "width": 64,
                    "experts": 0,
                    "loss": float(law.loss(n, d)),
                    "curve": (s, loss),
                }
            )
    return runs


def test_the_smoothing_follows_a_falling_curve_without_lag():
    """A local line: exact on a loss linear in ln(step) (a trailing mean of the same window
    reads it 0.1 high), and a noisy flat curve's scatter shrinks."""
    x = np.log(np.arange(1, 501))
    y = 5.0 - 0.4 * x
    assert np.allclose(se.smooth(x, y), y, atol=1e-9)
    trailing = np.array([y[(x >= v - 2 * se.SMOOTH_HALF_WIDTH) & (x <= v)].mean() for v in x])
    assert (trailing - y)[-1] > 0.05
    noisy = 3.0 + 0.05 * np.random.default_rng(0).standard_normal(500)
    assert np.std(se.smooth(x, noisy)[100:]) < np.std(noisy) / 3


def test_the_envelope_is_the_lowest_curve_at_each_compute():
    """Every point of the envelope is the lowest of the smoothed curves that reach its C, and
    is one of them."""
    env = se.envelope(curve_runs(noise=0.01))
    for j, c in enumerate(env.c):
        values = {
            name: np.interp(np.log(c), np.log(cc), ll)
            for name, (cc, ll) in env.curves.items()
            if cc[0] <= c <= cc[-1] * (1 + 1e-9)
        }
        assert env.loss[j] == pytest.approx(min(values.values()), rel=1e-12)
        assert env.run[j] == min(values, key=values.get)


@pytest.mark.parametrize("law", [TRUE, Law(E=1.82, A=482.0, B=2085.0, alpha=0.5, beta=0.25)])
def test_the_envelope_recovers_the_exponents_of_a_known_law(law):
    """The same sizes at every budget, so that only the curves tell where the optimum is.
    Noise-free: N_opt's exponent within 0.01 of beta / (alpha + beta) (0.513 and 0.333 for
    these laws; the sizes, sqrt(2) apart, make N_opt a staircase), D_opt's within 0.01 of
    alpha / (alpha + beta). With 1% noise per step, the median of five seeds within 0.02."""
    exponent = law.beta / (law.alpha + law.beta)
    env = se.envelope(curve_runs(law=law))
    assert env.n_law[1] == pytest.approx(exponent, abs=0.01)
    assert env.d_law[1] == pytest.approx(1 - exponent, abs=0.01)
    assert not env.edge.any() and env.problem == ""
    noisy = [se.envelope(curve_runs(noise=0.01, seed=s, law=law)).n_law[1] for s in range(5)]
    assert np.median(noisy) == pytest.approx(exponent, abs=0.02), noisy


def test_points_at_the_edge_of_the_runs_stay_out_of_the_power_laws():
    """Every size larger than every budget's optimum: the lowest curve at every C is the
    smallest run that reaches it, which says only that the optimum is at or below it; no power
    law, and the summary says why and what to add."""
    runs = curve_runs(sizes=TRUE.optimum(BUDGETS[-1], K)[0] * np.array([4.0, 8.0, 16.0]))
    env = se.envelope(runs)
    assert env.smallest.all() and not env.largest.any() and env.n_law is None
    assert env.problem.startswith("0 of 60 points lie off the edge")
    assert (
        "at 60 of 60 points the lowest curve is the smallest run reaching that compute (add "
        "smaller sizes)" in env.problem
    )
    text = scaling_text.summary(scaling_report.analyse(runs, bootstrap=0))
    assert "envelope of the training curves: no power law (0 of 60 points" in text


def test_the_summary_prints_the_envelope_laws_and_runs_without_curves_have_none():
    runs = curve_runs(sizes=TRUE.optimum(BUDGETS[1], K)[0] * np.geomspace(0.25, 4, 6))
    analysis = scaling_report.analyse(runs, bootstrap=0)
    env = analysis["families"]["dense"]["envelope"]
    a, b = env.n_law
    assert f"envelope of the training curves: N_opt = {a:.3g} C^{b:.3f}" in scaling_text.summary(
        analysis
    )
    for r in runs:
        r["curve"] = None
    bare = scaling_report.analyse(runs, bootstrap=0)
    assert bare["families"]["dense"]["envelope"] is None
    assert "envelope" not in scaling_text.summary(bare)


def test_validation_losses_unlike_the_training_curves_are_warned_about():
    """The envelope reads training losses, the IsoFLOP minima and the law validation losses:
    when the runs' last training losses lie far from their validation losses (here 30% above:
    validation tokens easier than the training data), the warning says the two measure
    different text; 3% apart (noise) says nothing."""
    runs = curve_runs(sizes=TRUE.optimum(BUDGETS[1], K)[0] * np.geomspace(0.25, 4, 5))
    for r in runs:
        r["loss"] = float(r["curve"][1][-1] / 1.3)
    (w,) = [
        w for w in scaling_report.analyse(runs, bootstrap=0)["warnings"] if "training losses" in w
    ]
    assert w.startswith(
        "dense: the runs' last training losses lie +30% from their final "
        "validation losses (median of 20 runs"
    )
    for r in runs:
        r["loss"] = float(r["curve"][1][-1] * 0.97)
    assert scaling_report._train_validation_gap("dense", runs, se.envelope(runs)) == []


def test_an_envelope_outside_the_routes_interval_is_warned_about():
    """Where the envelope's N_opt at its largest compute lies outside the IsoFLOP route's 95%
    interval there, a warning says so and which to take; inside it, nothing."""
    from moe.tools import scaling_isoflop

    runs = curve_runs(sizes=TRUE.optimum(BUDGETS[1], K)[0] * np.geomspace(0.25, 4, 5))
    env = se.envelope(runs)
    by_budget = {
        b: (
            [r["active_params"] for r in runs if r["budget"] == b],
            [r["loss"] * (1 + 0.003 * np.sin(i)) for i, r in enumerate(runs) if r["budget"] == b],
        )
        for b in BUDGETS
    }
    fam = {"envelope": env, "route_boot": scaling_isoflop.bootstrap_route(by_budget, K, 50)}
    top = env.c[env.inside].max()  # the largest compute the envelope's laws were fitted on
    lo, hi = fam["route_boot"].n_interval(top)
    assert lo < env.n_law[0] * top ** env.n_law[1] < hi
    assert scaling_report._envelope_against_route("dense", fam) == []
    env.n_law = (env.n_law[0] * 2, env.n_law[1])
    (w,) = scaling_report._envelope_against_route("dense", fam)
    assert w.startswith(
        f"dense: the envelope of the training curves puts N_opt at C {top:.3g} "
        f"at {env.n_law[0] * top ** env.n_law[1]:.4g}"
    )
    assert f"outside the IsoFLOP route's 95% interval there ({lo:.4g} to {hi:.4g})" in w
    # the summary marks the envelope's figures where they are printed
    assert scaling_text._envelope_line(env, fam["envelope_outside"]).endswith(
        f"outside the IsoFLOP route's 95% interval ({lo:.4g} to {hi:.4g}): take the route's "
        "(see the warnings)"
    )
