"""Chinchilla's second approach on a scaling sweep: per budget, a parabola of loss in ln N
through the runs of the ladder, its vertex the budget's compute-optimal N when the ladder
brackets it; then the power laws N_opt = a C^b and D_opt = a' C^b' through the bracketed minima,
with bootstrap intervals on their exponents and on the tokens per parameter D_opt / N_opt.

A vertex is the budget's minimum only when the vertex lies inside the ladder and the lowest run
is not at an end of it. Otherwise (:class:`IsoFlopMinimum` ``kind``) the lowest run sits at an
end (``edge``), the vertex lies beyond the ladder (``extrapolated``) or the parabola opens
downwards and has no minimum (``concave``): the side where the optimum may lie is named, and
such a budget is left out of the power laws.

D_opt of a budget is C / (k N_opt), with k the family's FLOPs per token per parameter (the median
over its runs), so b' = 1 - b and the tokens per parameter of the laws are C^(1 - 2b) / (k a^2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moe.core.errors import ScalingError
from moe.tools.scaling_fit import percentile_interval


@dataclass
class IsoFlopMinimum:
    budget: float
    n_opt: float
    """The parabola's vertex (for ``concave``, which has none: the lowest run's N)."""
    loss_opt: float
    kind: str
    """``bracketed`` (a minimum inside the ladder), ``edge`` (the lowest run at an end of the
    ladder), ``extrapolated`` (the vertex beyond the ladder) or ``concave`` (no minimum)."""
    side: str | None
    """Where the optimum may lie beyond the ladder: ``smaller`` or ``larger`` N (None when
    bracketed, or for a concave parabola whose lowest run is inside the ladder)."""
    coeffs: tuple[float, float, float]
    """Loss = c0 x^2 + c1 x + c2 in x = ln N."""
    lowest_n: float
    lowest_loss: float
    n_range: tuple[float, float]
    """The smallest and largest N of the budget's runs."""

    @property
    def bracketed(self) -> bool:
        return self.kind == "bracketed"

    @property
    def at_edge(self) -> bool:
        return not self.bracketed

    def problem(self) -> str:
        """Why the vertex is not a minimum of the runs ('' when it is)."""
        lo, hi = self.n_range
        if self.kind == "concave":
            return "the parabola through the runs opens downwards: it has no minimum"
        if self.kind == "extrapolated":
            factor = lo / self.n_opt if self.side == "smaller" else self.n_opt / hi
            where = "below the smallest" if self.side == "smaller" else "above the largest"
            return (
                f"the parabola's vertex (N {self.n_opt:.3g}) lies {factor:.3g}x {where} run: "
                "an extrapolation"
            )
        if self.kind == "edge":
            end = "smallest" if self.side == "smaller" else "largest"
            return f"the loss is lowest at the {end} size of the ladder (the edge of the ladder)"
        return ""

    def advice(self) -> str:
        """What to add to the ladder (the side named)."""
        if self.side is None:
            return (
                "add sizes on both sides of the lowest run, or look for a run that failed to train"
            )
        return (
            f"the optimum may lie at {self.side} N than the ladder's: add sizes with "
            f"{self.side} N (--widths)"
        )


def isoflop_minimum(budget: float, n: list[float], loss: list[float]) -> IsoFlopMinimum:
    """The minimum over sizes at one budget: a parabola of loss in ln N, classified as the
    :class:`IsoFlopMinimum` ``kind`` says."""
    if len(n) < 3:
        raise ScalingError(f"budget {budget:.3g}: {len(n)} finished runs; a parabola needs 3")
    x, y = np.log(np.asarray(n, float)), np.asarray(loss, float)
    c = tuple(map(float, np.polyfit(x, y, 2)))
    low = int(np.argmin(y))
    end = "smaller" if x[low] == x.min() else "larger" if x[low] == x.max() else None
    common = dict(
        coeffs=c,
        lowest_n=float(n[low]),
        lowest_loss=float(y[low]),
        n_range=(float(min(n)), float(max(n))),
    )
    if c[0] <= 0:
        return IsoFlopMinimum(budget, float(n[low]), float(y[low]), "concave", end, **common)
    x_opt = -c[1] / (2 * c[0])
    vertex = dict(n_opt=float(math.exp(x_opt)), loss_opt=float(np.polyval(c, x_opt)))
    if not x.min() < x_opt < x.max():
        side = "smaller" if x_opt <= x.min() else "larger"
        return IsoFlopMinimum(budget, **vertex, kind="extrapolated", side=side, **common)
    if end is not None:
        return IsoFlopMinimum(budget, **vertex, kind="edge", side=end, **common)
    return IsoFlopMinimum(budget, **vertex, kind="bracketed", side=None, **common)


@dataclass
class RouteBootstrap:
    """The power law N_opt = a C^b refitted on resampled losses (a residual bootstrap): each
    budget's parabola keeps its fitted values, to which residuals drawn with replacement from the
    pooled residuals of every budget's parabola are added (scaled by sqrt(n / (n - 3)), a
    parabola having 3 constants); each budget's minimum is found and classified again, and the
    law drawn through the resample's bracketed minima. A resample with fewer than two bracketed
    budgets gives no law: it is counted in ``failed``, not in the intervals.

    Resampling the runs themselves instead (with replacement, per budget) redraws ladders with
    repeated sizes whose parabolas swing widely: on 100 synthetic sweeps (4 budgets x 5 sizes,
    1% noise) its 95% intervals of the exponent were 2.4 times as wide as 1.96 standard
    deviations of the estimate either side, and covered the noise-free exponent 99% of the time;
    these were 1.2-1.4 times as wide and covered it 93% (tests/moe/tools/test_scaling_isoflop.py)."""

    log_a: np.ndarray
    b: np.ndarray
    k: float
    resamples: int
    failed: int

    def exponent_interval(self) -> tuple[float, float]:
        """95% interval of b, the exponent of N_opt (that of D_opt is 1 - b)."""
        return _interval(self.b)

    def n_interval(self, budget: float) -> tuple[float, float]:
        """95% interval of N_opt = a C^b at ``budget``."""
        return _interval(np.exp(self.log_a + self.b * math.log(budget)))

    def ratio(self, budget: float, log_a, b):
        """D_opt / N_opt at ``budget`` of N_opt = e^log_a C^b: C / (k N_opt^2)."""
        return np.exp(
            math.log(budget) * (1 - 2 * np.asarray(b)) - math.log(self.k) - 2 * np.asarray(log_a)
        )

    def ratio_interval(self, budget: float) -> tuple[float, float]:
        """95% interval of the tokens per parameter D_opt / N_opt at ``budget``."""
        return _interval(self.ratio(budget, self.log_a, self.b))


def _interval(values: np.ndarray) -> tuple[float, float]:
    return percentile_interval(values) if len(values) else (math.nan, math.nan)


PARABOLA_CONSTANTS = 3


def bootstrap_route(
    by_budget: dict[float, tuple[list[float], list[float]]], k: float, resamples: int, seed: int = 0
) -> RouteBootstrap | None:
    """:class:`RouteBootstrap` of the runs ``by_budget`` (budget -> (N, loss) of its runs; the
    budgets of fewer than 3 runs are left out, as in the fit). None when no budget has more than
    3 runs: each parabola then passes through its runs, which show no scatter to resample."""
    fitted, residuals = {}, []
    for budget, (n, loss) in sorted(by_budget.items()):
        if len(n) < PARABOLA_CONSTANTS:
            continue
        x, y = np.log(np.asarray(n, float)), np.asarray(loss, float)
        values = np.polyval(np.polyfit(x, y, 2), x)
        fitted[budget] = (list(n), values)
        if len(n) > PARABOLA_CONSTANTS:
            residuals.append((y - values) * math.sqrt(len(n) / (len(n) - PARABOLA_CONSTANTS)))
    if not residuals:
        return None
    pool = np.concatenate(residuals)
    rng = np.random.default_rng(seed)
    log_a, slopes, failed = [], [], 0
    for _ in range(resamples):
        budgets, optima = [], []
        for budget, (n, values) in fitted.items():
            m = isoflop_minimum(budget, n, list(values + rng.choice(pool, len(n))))
            if m.bracketed:
                budgets.append(budget)
                optima.append(m.n_opt)
        if len(budgets) < 2:
            failed += 1
            continue
        slope, intercept = np.polyfit(np.log(budgets), np.log(optima), 1)
        log_a.append(float(intercept))
        slopes.append(float(slope))
    return RouteBootstrap(np.array(log_a), np.array(slopes), k, resamples, failed)
