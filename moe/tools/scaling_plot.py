"""The plot of a scaling sweep's analysis (``moe/tools/scaling_report.py``), six panels:

- **IsoFLOP curves**: each budget's runs, the parabola through them (its minimum a star), the
  fitted law's IsoFLOP curve L(N, C / (k N)) dashed over them, each labelled with its budget. A
  budget whose minimum lies outside its ladder gets no star: its lowest run is drawn hollow,
  pointing to the side where the optimum may lie.
- **N_opt and D_opt against C**: the law's compute-optimal N and D with their 95% bootstrap
  bands, the bracketed IsoFLOP minima with the power laws through them (dotted), and the
  points of the envelope of the training curves (hollow where they lie at the edge of the runs).
- **Loss against compute**: every run's smoothed training curve, their minimum envelope, the
  runs' final validation losses and the law's loss at the optimum of each C.
- **Residuals** of the parametric law, and the **MoE/dense compute multiplier** per budget.

Every line a test reads back carries a ``gid`` naming what it draws."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from moe.core.fileio import write_atomic
from moe.tools import scaling_fit

COLORS = {"dense": "tab:blue", "moe": "tab:orange"}
SIDE_MARKERS = {"smaller": "<", "larger": ">", None: "X"}
"""The marker of a lowest run whose budget has no minimum inside the ladder, by the side the
optimum may lie on (N grows to the right)."""

LAW_REACH = 1.5
"""The law's IsoFLOP curve of a budget spans its ladder widened by this factor each side."""

CURVES_FROM = 10
"""The loss panel draws the training curves from the smallest budget over this factor on."""


def _isoflop_panel(a, fam: dict, c: str, family: str = "") -> None:
    a.scatter(
        [r["active_params"] for r in fam["runs"]], [r["loss"] for r in fam["runs"]], color=c, s=14
    )
    law = fam["fit"].law if "fit" in fam else None
    for m in fam["minima"]:
        lo, hi = m.n_range
        x = np.linspace(np.log(lo), np.log(hi), 50)
        a.plot(np.exp(x), np.polyval(m.coeffs, x), color=c, alpha=0.6)
        if m.bracketed:
            a.scatter([m.n_opt], [m.loss_opt], color=c, marker="*", s=120, edgecolor="k")
        else:
            a.scatter(
                [m.lowest_n],
                [m.lowest_loss],
                facecolor="none",
                edgecolor=c,
                marker=SIDE_MARKERS[m.side],
                s=110,
                linewidths=1.5,
            )
        if law is not None:
            n = np.geomspace(lo / LAW_REACH, hi * LAW_REACH, 60)
            y = law.loss(n, m.budget / (fam["k"] * n))
            a.plot(
                n, y, color=c, linestyle="--", linewidth=1, gid=f"law-isoflop-{family}-{m.budget:g}"
            )
        # The label sits at the curve's right end, where the budgets' curves lie apart.
        a.annotate(
            f"C {m.budget:.2g}",
            (hi, float(np.polyval(m.coeffs, np.log(hi)))),
            xytext=(4, 0),
            textcoords="offset points",
            fontsize=7,
            color=c,
            va="center",
            gid=f"label-{family}-{m.budget:g}",
        )


def _law_band(a, fam: dict, grid: np.ndarray, index: int, c: str, label: str, gid: str) -> None:
    """The law's optimal N (``index`` 0) or D (1) over ``grid`` with its 95% bootstrap band; a
    law with an exponent of 0 has its optimum at 0 or infinity: nothing to draw."""
    fit, k = fam["fit"], fam["k"]
    opt = np.array([fit.law.optimum(C, k)[index] for C in grid])
    if not np.all(np.isfinite(opt) & (opt > 0)):
        return
    band = np.array(
        [
            scaling_fit.percentile_interval([b.optimum(C, k)[index] for b in fit.boot] or [o])
            for C, o in zip(grid, opt)
        ]
    )
    degenerate = " (degenerate: a constant on its bound)" if fit.on_bounds() else ""
    a.plot(
        grid, opt, color=c, label=label + degenerate, linestyle="--" if degenerate else "-", gid=gid
    )
    a.fill_between(grid, band[:, 0], band[:, 1], color=c, alpha=0.2)


def _optimum_panel(a, family: str, fam: dict, c: str, index: int) -> None:
    """N_opt (``index`` 0) or D_opt (1) against C: the law, the IsoFLOP minima and their power
    law, the envelope's points."""
    what = ("N", "D")[index]
    budgets = np.array(sorted({r["budget"] for r in fam["runs"]}))
    grid = np.geomspace(budgets.min(), budgets.max() * 10, 40)
    if "fit" in fam:
        _law_band(a, fam, grid, index, c, f"{family} law", f"law-{what}-{family}")

    def value(m):  # a minimum's N_opt, or D_opt = C / (k N_opt)
        return m.n_opt if index == 0 else m.budget / (fam["k"] * m.n_opt)

    inside = [m for m in fam["minima"] if m.bracketed]
    if inside:
        a.scatter(
            [m.budget for m in inside],
            [value(m) for m in inside],
            color=c,
            marker="*",
            s=80,
            label=f"{family} IsoFLOP minima",
            gid=f"isoflop-{what}-{family}",
        )
    for m in fam["minima"]:
        if not m.bracketed and index == 0:  # the lowest run's N, pointing to the optimum
            a.scatter(
                [m.budget],
                [m.lowest_n],
                facecolor="none",
                edgecolor=c,
                s=80,
                marker={"smaller": "v", "larger": "^"}.get(m.side, "X"),
            )
    law = fam.get(("n_law", "d_law")[index])
    if law is not None:
        a.plot(
            grid,
            law[0] * grid ** law[1],
            color=c,
            linestyle=":",
            linewidth=1,
            gid=f"isoflop-law-{what}-{family}",
        )
    env = fam.get("envelope")
    if env is not None:
        y = (env.n, env.d)[index]
        a.scatter(
            env.c[env.inside],
            y[env.inside],
            color=c,
            s=6,
            alpha=0.5,
            label=f"{family} envelope of the training curves",
        )
        a.scatter(env.c[env.edge], y[env.edge], facecolor="none", edgecolor=c, s=6, alpha=0.5)


def _loss_panel(a, family: str, fam: dict, c: str) -> None:
    """Training curves, their minimum envelope, final validation losses and the law's loss at
    the optimum of each C."""
    env = fam.get("envelope")
    if env is not None:
        for cc, loss in env.curves.values():
            # From a tenth of the smallest budget on: the first steps' losses, several times
            # the final ones, would set the scale.
            keep = cc >= env.c[0] / CURVES_FROM
            a.plot(cc[keep], loss[keep], color=c, alpha=0.25, linewidth=0.6)
        a.plot(
            env.c,
            env.loss,
            color=c,
            linewidth=2.5,
            label=f"{family} envelope",
            gid=f"envelope-{family}",
        )
    a.scatter(
        [r["budget"] for r in fam["runs"]],
        [r["loss"] for r in fam["runs"]],
        color=c,
        s=14,
        marker="s",
        label=f"{family} final validation loss",
    )
    if "fit" in fam:
        budgets = [r["budget"] for r in fam["runs"]]
        grid = np.geomspace(min(budgets), max(budgets) * 10, 40)
        best = np.array([fam["fit"].law.optimum(C, fam["k"])[2] for C in grid])
        if np.all(np.isfinite(best)):
            a.plot(
                grid,
                best,
                color=c,
                linestyle="--",
                label=f"{family} law at the optimum",
                gid=f"law-loss-{family}",
            )


def _multiplier_panel(a, fam: dict, c: str) -> None:
    items = sorted(fam["multiplier"].items())
    bound = fam.get("multiplier_bound", set())
    a.plot([b for b, _ in items], [v for _, v in items], "-", color=c)
    a.scatter(
        [b for b, _ in items if b not in bound],
        [v for b, v in items if b not in bound],
        color=c,
        marker="o",
    )
    a.scatter(
        [b for b, _ in items if b in bound],
        [v for b, v in items if b in bound],
        facecolor="none",
        edgecolor=c,
        marker="^",
        s=60,
        label="at least (minimum outside the ladder)" if bound else None,
    )


TITLES = {
    (0, 0): (
        "active parameters N",
        "final validation loss",
        "IsoFLOP curves (stars: minima; hollow: lowest run, optimum off the ladder on the "
        "side pointed to;\ndashed: the fitted law)",
    ),
    (0, 1): ("training FLOPs C", "N_opt", "compute-optimal size (band: 95% bootstrap)"),
    (0, 2): ("training FLOPs C", "D_opt (tokens)", "compute-optimal tokens (band: 95% bootstrap)"),
    (1, 0): (
        "training FLOPs C",
        "loss (nats per token)",
        "loss against compute: training curves, their envelope, final losses",
    ),
    (1, 1): ("N", "log predicted - log measured", "residuals of L(N, D)"),
    (1, 2): ("budget C", "dense FLOPs / MoE FLOPs", "MoE compute multiplier"),
}
SCALES = {
    (0, 0): {"xscale": "log"},
    (0, 1): {"xscale": "log", "yscale": "log"},
    (0, 2): {"xscale": "log", "yscale": "log"},
    (1, 0): {"xscale": "log"},
    (1, 1): {"xscale": "log"},
    (1, 2): {"xscale": "log"},
}


def draw_panels(analysis: dict, ax) -> None:
    """The six panels on ``ax`` (2 x 3 axes)."""
    for family, fam in analysis["families"].items():
        c = COLORS.get(family, "k")
        _isoflop_panel(ax[0, 0], fam, c, family)
        _optimum_panel(ax[0, 1], family, fam, c, 0)
        _optimum_panel(ax[0, 2], family, fam, c, 1)
        _loss_panel(ax[1, 0], family, fam, c)
        if "fit" in fam:
            law = fam["fit"].law
            res = [
                np.log(law.loss(r["active_params"], r["tokens"])) - np.log(r["loss"])
                for r in fam["runs"]
            ]
            ax[1, 1].scatter(
                [r["active_params"] for r in fam["runs"]], res, color=c, s=14, label=family
            )
        if "multiplier" in fam:
            _multiplier_panel(ax[1, 2], fam, c)
    if not ax[1, 2].has_data():
        ax[1, 2].text(
            0.5,
            0.5,
            "no MoE family with a dense law",
            ha="center",
            va="center",
            transform=ax[1, 2].transAxes,
        )
    for (i, j), (xlabel, ylabel, title) in TITLES.items():
        a = ax[i, j]
        a.set(xlabel=xlabel, ylabel=ylabel, title=title)
        a.title.set_fontsize(8)
        # A panel without data (too few runs for a minimum or a law) keeps linear axes:
        # matplotlib cannot lay out an empty log axis.
        if a.has_data():
            a.set(**SCALES[(i, j)])
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=7)
    ax[1, 1].axhline(0, color="k", lw=0.5)
    if any("multiplier" in fam for fam in analysis["families"].values()):
        ax[1, 2].axhline(1, color="k", lw=0.5)


def draw(analysis: dict, path: Path) -> Path:
    """Write the six panels to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 3, figsize=(17, 9.5))
    draw_panels(analysis, ax)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=90)
    plt.close(fig)
    write_atomic(path, png.getbuffer())  # a full disk keeps the plot of the last fit whole
    return path
