"""The plot of a scaling sweep (moe/tools/scaling_plot.py), read back from matplotlib's axes on
synthetic runs of a known law: what each panel draws is what the analysis holds."""

from __future__ import annotations

import numpy as np
import pytest

from moe.tools import scaling_plot, scaling_report
from tests.moe.tools.test_scaling_envelope import BUDGETS, TRUE, curve_runs


@pytest.fixture(scope="module")
def drawn():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    analysis = scaling_report.analyse(curve_runs(), bootstrap=8)
    fig, ax = plt.subplots(2, 3)
    scaling_plot.draw_panels(analysis, ax)
    yield analysis, ax
    plt.close(fig)


def _by_gid(axis, gid):
    (found,) = [a for a in [*axis.lines, *axis.collections, *axis.texts] if a.get_gid() == gid]
    return found


def test_the_laws_isoflop_curves_are_drawn_over_each_budget_with_its_label(drawn):
    """Each budget: the fitted law's L(N, C / (k N)) dashed across its ladder, its lowest point
    the law's optimal loss of that budget (the fit of these noise-free runs recovers the true
    law's within 0.5%), and a label naming the budget at the end of its parabola."""
    analysis, ax = drawn
    fam = analysis["families"]["dense"]
    law, k = fam["fit"].law, fam["k"]
    for budget in BUDGETS:
        line = _by_gid(ax[0, 0], f"law-isoflop-dense-{budget:g}")
        n, y = line.get_xdata(), line.get_ydata()
        assert np.allclose(y, law.loss(n, budget / (k * n)), rtol=1e-12)
        assert line.get_linestyle() == "--"
        assert y.min() == pytest.approx(TRUE.optimum(budget, k)[2], rel=5e-3)
        label = _by_gid(ax[0, 0], f"label-dense-{budget:g}")
        m = next(m for m in fam["minima"] if m.budget == budget)
        assert label.get_text() == f"C {budget:.2g}" and label.xy[0] == m.n_range[1]


def test_the_d_opt_panel_draws_the_law_the_minima_and_their_power_law(drawn):
    analysis, ax = drawn
    fam = analysis["families"]["dense"]
    law, k = fam["fit"].law, fam["k"]
    line = _by_gid(ax[0, 2], "law-D-dense")
    c, d = line.get_xdata(), line.get_ydata()
    assert np.allclose(d, [law.optimum(x, k)[1] for x in c], rtol=1e-12)
    assert np.allclose(d, [TRUE.optimum(x, k)[1] for x in c], rtol=0.03)
    points = _by_gid(ax[0, 2], "isoflop-D-dense").get_offsets()
    inside = [m for m in fam["minima"] if m.bracketed]
    assert np.allclose(points, [(m.budget, m.budget / (k * m.n_opt)) for m in inside])
    power = _by_gid(ax[0, 2], "isoflop-law-D-dense")
    a, b = fam["d_law"]
    assert np.allclose(power.get_ydata(), a * power.get_xdata() ** b)
    assert np.allclose(
        _by_gid(ax[0, 1], "law-N-dense").get_ydata(), [law.optimum(x, k)[0] for x in c], rtol=1e-12
    )


def test_the_loss_panel_draws_the_envelope_and_the_laws_optimal_loss(drawn):
    analysis, ax = drawn
    fam = analysis["families"]["dense"]
    env = _by_gid(ax[1, 0], "envelope-dense")
    assert np.array_equal(env.get_xdata(), fam["envelope"].c)
    assert np.array_equal(env.get_ydata(), fam["envelope"].loss)
    best = _by_gid(ax[1, 0], "law-loss-dense")
    assert np.allclose(
        best.get_ydata(), [fam["fit"].law.optimum(x, fam["k"])[2] for x in best.get_xdata()]
    )
    # The envelope is the lowest of the runs' losses at each C (within 2e-4: the local line
    # through a curve convex in ln(step) reads a little low at a run's last step), so on or
    # above the law's optimal loss.
    runs = fam["runs"]
    lowest = [
        min(
            TRUE.loss(r["active_params"], r["tokens"] * x / r["budget"])
            for r in runs
            if x <= r["budget"] * (1 + 1e-9)
        )
        for x in fam["envelope"].c
    ]
    assert np.allclose(fam["envelope"].loss, lowest, rtol=2e-4)
    optimum = np.array([TRUE.optimum(x, fam["k"])[2] for x in fam["envelope"].c])
    assert np.all(fam["envelope"].loss >= optimum * (1 - 2e-4))
    assert ax[1, 2].texts[0].get_text() == "no MoE family with a dense law"
