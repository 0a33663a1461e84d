"""Chinchilla's first approach on a scaling sweep: the minimum envelope of the training curves.

Every run logs its training loss at every step (``steps_rank*.jsonl`` of its run directory). At
step s of S a run of budget C_run has spent C = C_run s / S. For each compute C on a grid
between the sweep's smallest and largest budget, the run whose (smoothed) curve is lowest at C
is the compute-optimal run of C among those trained: its N is N_opt(C) and the tokens it has
seen by then D_opt(C). Power laws N_opt = a C^b and D_opt = a' C^b' are fitted through these
points in log-log, each grid point weighing the same.

- **Smoothing.** A step's loss is one batch's: each curve is smoothed by a local linear fit of
  the loss on ln(step) over the steps within :data:`SMOOTH_HALF_WIDTH` of it in ln(step), which
  follows a falling curve without lagging behind it (a trailing mean would read every point
  high, the more so where the curve falls faster). It is exact where the loss is linear in
  ln(step); on a curve convex in ln(step) it reads a little low at the run's last step, where
  the window is one-sided (1e-4 of the loss on the synthetic curves of the tests).
- **The edge.** A point whose lowest run has the smallest or the largest N of the runs that reach
  that C says only that the optimum lies at or beyond that end: it is kept out of the power laws,
  as an IsoFLOP minimum outside its ladder is (``moe/tools/scaling_isoflop.py``).
- **The schedule.** Chinchilla trained each size with several cosine cycle lengths, because a
  run's loss part-way through a longer schedule is above that of a run whose schedule ends
  there. Here each run decays its learning rate over its own steps, so a run's curve before its
  end reads high: at a sweep budget the runs ending there compete with runs of larger budgets
  that are part-way through, and between budgets only the latter compete. The envelope is
  therefore a cross-check of the IsoFLOP route and the parametric law, not a third estimate of
  equal standing; where the three disagree, the sweep's budgets are too far apart.
- For MoE the training loss includes the router's auxiliary loss (about its coefficient, the
  same at every size), the final evaluation does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SMOOTH_HALF_WIDTH = 0.15
"""Half the window of the local linear smoothing, in ln(step): steps within 16% of each other."""

GRID_POINTS = 60
"""Compute values of the envelope, log-spaced from the smallest budget to the largest."""


def smooth(x: np.ndarray, y: np.ndarray, half_width: float = SMOOTH_HALF_WIDTH) -> np.ndarray:
    """At each x (ascending), the value of the least-squares line through the points within
    ``half_width`` of it (the mean, where they share one x)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    lo = np.searchsorted(x, x - half_width, "left")
    hi = np.searchsorted(x, x + half_width, "right")

    def window(v):  # the sums of v over each point's window
        c = np.concatenate([[0.0], np.cumsum(v)])
        return c[hi] - c[lo]

    # Centred on each point's own x: the sums stay well conditioned.
    count = hi - lo
    sx, sy = window(x) - count * x, window(y)
    sxx = window(x * x) - 2 * x * window(x) + count * x * x
    sxy = window(x * y) - x * sy
    var = sxx - sx * sx / count
    slope = np.divide(sxy - sx * sy / count, var, out=np.zeros_like(var), where=var > 1e-12)
    return sy / count - slope * sx / count


@dataclass
class Envelope:
    """The minimum envelope of one family's training curves (see the module docstring)."""

    c: np.ndarray
    """The grid of compute (FLOPs)."""
    loss: np.ndarray
    """The lowest smoothed training loss at each C."""
    run: list[str]
    """The run that reaches it."""
    n: np.ndarray
    d: np.ndarray
    """N of that run, and the tokens it has trained on at C."""
    smallest: np.ndarray
    largest: np.ndarray
    """Whether that run has the smallest (the largest) N of the runs that reach C."""
    curves: dict[str, tuple[np.ndarray, np.ndarray]]
    """Each run's smoothed curve: (C at each step, loss)."""
    n_law: tuple[float, float] | None = None
    d_law: tuple[float, float] | None = None
    problem: str = ""
    """Why there are no power laws ('' when there are)."""

    @property
    def edge(self) -> np.ndarray:
        return self.smallest | self.largest

    @property
    def inside(self) -> np.ndarray:
        return ~self.edge


def _curve(run: dict) -> tuple[np.ndarray, np.ndarray]:
    steps, loss = (np.asarray(v, float) for v in run["curve"])
    keep = np.isfinite(loss) & (steps >= 1)
    steps, loss = steps[keep], loss[keep]
    return run["budget"] * steps / run["steps"], smooth(np.log(steps), loss)


def envelope(runs: list[dict], points: int = GRID_POINTS) -> Envelope | None:
    """The envelope of ``runs`` (one family's; each with ``curve``: (steps, losses), and its
    ``budget``, ``steps``, ``active_params``, ``tokens``); None when fewer than two budgets have
    runs with curves."""
    runs = [r for r in runs if r.get("curve") is not None and len(r["curve"][0]) >= 2]
    budgets = sorted({r["budget"] for r in runs})
    if len(budgets) < 2:
        return None
    curves = {r["name"]: _curve(r) for r in runs}
    grid = np.geomspace(budgets[0], budgets[-1], points)
    log_grid = np.log(grid)
    at = np.full((len(runs), points), np.nan)  # each run's smoothed loss at each C it reaches
    for i, r in enumerate(runs):
        c, loss = curves[r["name"]]
        reach = (log_grid >= np.log(c[0])) & (log_grid <= np.log(c[-1]) + 1e-9)
        at[i, reach] = np.interp(log_grid[reach], np.log(c), loss)
    n_runs = np.array([r["active_params"] for r in runs], float)
    best = np.nanargmin(at, axis=0)
    reached = ~np.isnan(at)
    lowest = np.array([n_runs[reached[:, j]].min() for j in range(points)])
    highest = np.array([n_runs[reached[:, j]].max() for j in range(points)])
    n = n_runs[best]
    tokens_per_c = np.array([r["tokens"] / r["budget"] for r in runs])[best]
    out = Envelope(
        c=grid,
        loss=at[best, np.arange(points)],
        run=[runs[i]["name"] for i in best],
        n=n,
        d=grid * tokens_per_c,
        smallest=n <= lowest,
        largest=n >= highest,
        curves=curves,
    )
    _fit_laws(out)
    return out


def edge_text(env: Envelope) -> str:
    """How many points lie at each edge, and what that says."""
    parts = [
        f"at {int(v.sum())} of {len(env.c)} points the lowest curve is the {end} run "
        f"reaching that compute (add {more} sizes)"
        for v, end, more in (
            (env.smallest, "smallest", "smaller"),
            (env.largest, "largest", "larger"),
        )
        if v.any()
    ]
    return "; ".join(parts)


def _fit_laws(env: Envelope) -> None:
    """The power laws through the points off the edge, when they hold two or more sizes."""
    keep = env.inside
    sizes = len(set(env.n[keep]))
    if sizes < 2:
        env.problem = (
            f"{int(keep.sum())} of {len(env.c)} points lie off the edge of the runs "
            f"that reach them, with {sizes} size(s) among them, and the power laws "
            f"need 2: {edge_text(env)}"
        )
        return
    log_c = np.log(env.c[keep])
    b, log_a = np.polyfit(log_c, np.log(env.n[keep]), 1)
    bd, log_ad = np.polyfit(log_c, np.log(env.d[keep]), 1)
    env.n_law = (float(np.exp(log_a)), float(b))
    env.d_law = (float(np.exp(log_ad)), float(bd))
