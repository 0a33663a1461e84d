"""The plot of a scaling sweep's analysis (``moe/tools/scaling_report.py``): IsoFLOP curves with
their minima, the fitted frontier with its 95% band, the residuals of the parametric law, and the
MoE/dense compute multiplier per budget. A budget whose minimum lies outside its ladder gets no
star: its lowest run is drawn hollow, pointing to the side where the optimum may lie."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moe.tools import scaling_fit

COLORS = {"dense": "tab:blue", "moe": "tab:orange"}
SIDE_MARKERS = {"smaller": "<", "larger": ">", None: "X"}
"""The marker of a lowest run whose budget has no minimum inside the ladder, by the side the
optimum may lie on (N grows to the right)."""


def _isoflop_panel(a, fam: dict, c: str) -> None:
    a.scatter([r["active_params"] for r in fam["runs"]], [r["loss"] for r in fam["runs"]],
              color=c, s=14)
    for m in fam["minima"]:
        n = np.array([r["active_params"] for r in fam["runs"] if r["budget"] == m.budget])
        x = np.linspace(np.log(n.min()), np.log(n.max()), 50)
        a.plot(np.exp(x), np.polyval(m.coeffs, x), color=c, alpha=0.6)
        if m.bracketed:
            a.scatter([m.n_opt], [m.loss_opt], color=c, marker="*", s=120, edgecolor="k")
        else:
            a.scatter([m.lowest_n], [m.lowest_loss], facecolor="none", edgecolor=c,
                      marker=SIDE_MARKERS[m.side], s=110, linewidths=1.5)


def _frontier_panel(a, family: str, fam: dict, c: str) -> None:
    budgets = np.array(sorted({r["budget"] for r in fam["runs"]}))
    opt = np.array([])
    if "fit" in fam and len(budgets):
        grid = np.geomspace(budgets.min(), budgets.max() * 10, 40)
        opt = np.array([fam["fit"].law.optimum(C, fam["k"])[0] for C in grid])
    # A law with an exponent of 0 has its optimum at N = 0 or infinity: no frontier to draw.
    if len(opt) and np.all(np.isfinite(opt) & (opt > 0)):
        band = np.array([scaling_fit.percentile_interval(
            [b.optimum(C, fam["k"])[0] for b in fam["fit"].boot] or [o])
            for C, o in zip(grid, opt)])
        degenerate = " (degenerate: a constant on its bound)" if fam["fit"].on_bounds() else ""
        a.plot(grid, opt, color=c, label=f"{family} law{degenerate}",
               linestyle="--" if degenerate else "-")
        a.fill_between(grid, band[:, 0], band[:, 1], color=c, alpha=0.2)
    inside = [m for m in fam["minima"] if m.bracketed]
    if inside:
        a.scatter([m.budget for m in inside], [m.n_opt for m in inside], color=c, marker="*",
                  s=80, label=f"{family} IsoFLOP minima")
    for m in fam["minima"]:
        if not m.bracketed:  # the lowest run's N, pointing to where the optimum may lie
            a.scatter([m.budget], [m.lowest_n], facecolor="none", edgecolor=c, s=80,
                      marker={"smaller": "v", "larger": "^"}.get(m.side, "X"))


def draw(analysis: dict, path: Path) -> Path:
    """Write the four panels to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(12, 9))
    for family, fam in analysis["families"].items():
        c = COLORS.get(family, "k")
        _isoflop_panel(ax[0, 0], fam, c)
        _frontier_panel(ax[0, 1], family, fam, c)
        if "fit" in fam:
            law = fam["fit"].law
            res = [np.log(law.loss(r["active_params"], r["tokens"])) - np.log(r["loss"])
                   for r in fam["runs"]]
            ax[1, 0].scatter([r["active_params"] for r in fam["runs"]], res, color=c, s=14,
                             label=family)
        if "multiplier" in fam:
            items = sorted(fam["multiplier"].items())
            bound = fam.get("multiplier_bound", set())
            ax[1, 1].plot([b for b, _ in items], [v for _, v in items], "-", color=c)
            ax[1, 1].scatter([b for b, _ in items if b not in bound],
                             [v for b, v in items if b not in bound], color=c, marker="o")
            ax[1, 1].scatter([b for b, _ in items if b in bound],
                             [v for b, v in items if b in bound], facecolor="none", edgecolor=c,
                             marker="^", s=60, label="at least (minimum outside the ladder)")
    ax[0, 0].set(xlabel="active parameters N", ylabel="final validation loss",
                 title="IsoFLOP curves (stars: minima; hollow: lowest run, the optimum beyond "
                       "the ladder on the side pointed to)")
    ax[0, 1].set(xlabel="training FLOPs C", ylabel="N_opt",
                 title="compute-optimal size (band: 95% bootstrap)")
    ax[1, 0].set(xlabel="N", ylabel="log predicted - log measured", title="residuals of L(N, D)")
    ax[1, 1].set(xlabel="budget C", ylabel="dense FLOPs / MoE FLOPs",
                 title="MoE compute multiplier")
    ax[0, 0].title.set_fontsize(9)
    # A panel without data (too few runs for a minimum or a law) keeps linear axes: matplotlib
    # cannot lay out an empty log axis.
    for a, scales in ((ax[0, 0], {"xscale": "log"}), (ax[0, 1], {"xscale": "log", "yscale": "log"}),
                      (ax[1, 0], {"xscale": "log"}), (ax[1, 1], {"xscale": "log"})):
        if a.has_data():
            a.set(**scales)
    ax[1, 0].axhline(0, color="k", lw=0.5)
    ax[1, 1].axhline(1, color="k", lw=0.5)
    for a in (ax[0, 1], ax[1, 0], ax[1, 1]):
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
