"""The fits of a scaling sweep (``moe/tools/scaling.py`` plans it; N, D and C are defined there).

- **Per budget**, the IsoFLOP minima and the power laws through them (Chinchilla's second
  approach) are in ``moe/tools/scaling_isoflop.py``; the minimum envelope of the training
  curves (the first approach) in ``moe/tools/scaling_envelope.py``.
- **The parametric law** L(N, D) = E + A / N^alpha + B / D^beta per family, as Besiroglu et al.
  (2024) redid Chinchilla's third approach: Huber loss on log loss, a grid of initialisations,
  bootstrap intervals. From it the compute-optimal N, D and loss of any budget (closed form, with
  C = k N D where k is the sweep's FLOPs per token per parameter). A constant that ends on the
  optimiser's bound (:data:`BOUNDS`) is reported (:func:`on_bounds`): the data do not determine it.
- For MoE, the compute multiplier: the dense compute whose optimal loss equals the MoE's at a
  budget, divided by that budget; with two or more expert counts also the expert law of Clark
  et al. 2022, log L = a log N + b log E + c log N log E + d.

The search: L-BFGS-B runs to convergence (:data:`LBFGS_OPTIONS`) from the :data:`STARTS` best
points of :data:`INIT_GRID`, and from more of the grid cheaply: the objective, its gradient and
its Hessian are evaluated for many parameter vectors at once (:func:`_batch`), so damped Newton
steps refine the :data:`GRID_STARTS` best grid points together, and L-BFGS-B also runs from the
:data:`POLISHED` best distinct points they reach. The fit is the best end of all, so never worse
than the grid starts' alone. A bootstrap resample is the same objective with each run weighted
by how often the resample draws it, so the resamples are refined in batches.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from moe.core.errors import ScalingError


def require_scipy() -> None:
    """The fits use SciPy and threadpoolctl, the 'scaling' extra: refuse with the command that
    installs them."""
    try:
        import scipy  # noqa: F401
        import threadpoolctl  # noqa: F401
    except ImportError:
        raise ScalingError(
            "moe-scaling's fits need SciPy and threadpoolctl, which the 'scaling' "
            "extra installs: python3 -m pip install -c constraints.txt -e "
            "'.[scaling]'"
        ) from None


def one_blas_thread(fn):
    """Run ``fn`` with BLAS and OpenMP on one thread. L-BFGS-B calls LAPACK on 5x5 matrices
    thousands of times; OpenBLAS spreading each call over every core made a fit of 6 runs take
    5-8 s on a busy 2-core machine instead of 0.25 s (BENCHMARKS.md), and longer with more
    cores."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        require_scipy()
        # The limit reaches only the libraries loaded when it is set: SciPy's OpenBLAS comes
        # with scipy.optimize, which the fit would import too late.
        import scipy.optimize  # noqa: F401
        from threadpoolctl import threadpool_limits

        with threadpool_limits(limits=1):
            return fn(*args, **kwargs)

    return wrapper


def power_law(x: list[float], y: list[float]) -> tuple[float, float]:
    """(a, b) of y = a x^b, least squares in log-log."""
    require_scipy()
    from scipy.stats import linregress

    fit = linregress(np.log(x), np.log(y))
    return float(math.exp(fit.intercept)), float(fit.slope)


@dataclass
class Law:
    """L(N, D) = E + A / N^alpha + B / D^beta."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float

    def loss(self, n, d):
        return self.E + self.A / np.power(n, self.alpha) + self.B / np.power(d, self.beta)

    def optimum(self, budget: float, k: float) -> tuple[float, float, float]:
        """(N, D, loss) minimising the loss at C = k N D. A law with an exponent of 0 (a
        degenerate fit) has no optimum inside: N is 0 (alpha 0: only D lowers the loss) or
        infinite (beta 0), with the loss of that end."""
        if self.alpha <= 0 or self.beta <= 0:
            n = (
                math.nan
                if self.alpha <= 0 and self.beta <= 0
                else (0.0 if self.alpha <= 0 else math.inf)
            )
        else:
            # In logs: exponents near 0 (all runs at one loss) overflow the power's float; N
            # is then 0 or infinite, as on the bound.
            s = self.alpha + self.beta
            log_n = (math.log(self.alpha * self.A) - math.log(self.beta * self.B)) / s
            log_n += self.beta / s * math.log(budget / k)
            with np.errstate(over="ignore"):
                n = float(np.exp(log_n))
        with np.errstate(divide="ignore", invalid="ignore"):
            d = np.divide(budget, k * n)
            return float(n), float(d), float(self.loss(n, d))

    def params(self) -> np.ndarray:
        """The fit's parameters: (log A, log B, log E, alpha, beta)."""
        return np.array(
            [math.log(self.A), math.log(self.B), math.log(self.E), self.alpha, self.beta]
        )


def _law(p) -> Law:
    return Law(
        E=math.exp(p[2]), A=math.exp(p[0]), B=math.exp(p[1]), alpha=float(p[3]), beta=float(p[4])
    )


HUBER_DELTA = 1e-3
"""The Huber loss's threshold on log-loss residuals (Chinchilla's and Besiroglu et al.'s)."""

PARAMS = ("A", "B", "E", "alpha", "beta")
"""The constants behind the fit's parameters (log A, log B, log E, alpha, beta)."""

BOUNDS = [(-10, 40), (-10, 40), (-5, 5), (0.0, 3.0), (0.0, 3.0)]

BOUND_TOLERANCE = 1e-6
"""A parameter this close to its bound (in log units for A, B and E) sits on it."""


def _batch(p, log_n, log_d, log_l, weight=None, hessian=False, delta=HUBER_DELTA):
    """The Huber objective (threshold ``delta``) of log-loss residuals for each row of ``p``
    (K x 5: log A, log B, log E, alpha, beta) at once, its gradient (K x 5) and, with
    ``hessian``, its Hessian (K x 5 x 5). The data are (n,) arrays, or (K, n) for a point per
    row; ``weight`` (n,) or (K, n) counts each run (a bootstrap resample)."""
    a, b, e, alpha, beta = (p[:, i : i + 1] for i in range(5))  # (K, 1)
    u, v = a - alpha * log_n, b - beta * log_d  # (K, n): log A/N^alpha, log B/D^beta
    top = np.maximum(np.maximum(u, v), e)
    wu, wv, we = np.exp(u - top), np.exp(v - top), np.exp(e - top)
    s = wu + wv + we
    r = top + np.log(s) - log_l  # log predicted - log measured
    wu, wv, we = wu / s, wv / s, we / s  # d log predicted / d (u, v, log E)
    h = np.clip(r, -delta, delta)  # the Huber loss's derivative in r
    terms = h * (r - 0.5 * h)
    if weight is not None:
        terms, h = terms * weight, h * weight
    hu, hv = h * wu, h * wv
    grad = np.stack(
        [hu.sum(1), hv.sum(1), (h * we).sum(1), -(hu * log_n).sum(1), -(hv * log_d).sum(1)], axis=1
    )
    if not hessian:
        return terms.sum(1), grad
    # d2/dp2 of sum rho(r): rho'' J J^T + rho' d2(log predicted); log predicted is the log-sum-
    # exp of (u, v, log E), each linear in p, so its Hessian is sum_j w_j M_j^T M_j - J J^T.
    inside = (np.abs(r) <= delta).astype(float)
    if weight is not None:
        inside = inside * weight
    jac = np.stack([wu, wv, we, -wu * log_n, -wv * log_d], axis=2)  # (K, n, 5)
    hess = np.einsum("kn,kni,knj->kij", inside - h, jac, jac)
    for i, j, w, x in ((0, 3, hu, log_n), (1, 4, hv, log_d)):
        hess[:, i, i] += w.sum(1)
        hess[:, i, j] -= (w * x).sum(1)
        hess[:, j, i] -= (w * x).sum(1)
        hess[:, j, j] += (w * x * x).sum(1)
    hess[:, 2, 2] += (h * we).sum(1)
    return terms.sum(1), grad, hess


def _objective(p, log_n, log_d, log_l, weight=None):
    """:func:`_batch` of one parameter vector: (value, gradient), as L-BFGS-B takes them."""
    value, grad = _batch(np.asarray(p, float)[None], log_n, log_d, log_l, weight)
    return float(value[0]), grad[0]


INIT_GRID = {
    "a": np.arange(0.0, 30.0, 5.0),
    "b": np.arange(0.0, 30.0, 5.0),
    "e": np.arange(-1.0, 1.5, 0.5),
    "alpha": np.arange(0.0, 2.5, 0.5),
    "beta": np.arange(0.0, 2.5, 0.5),
}
"""Initial points of the fit (log A, log B, log E, alpha, beta): every combination (4,500, as
Chinchilla's grid); the objective is evaluated at all of them and the :data:`GRID_STARTS` best
are refined."""

STARTS = 16
"""Grid points of lowest objective from which L-BFGS-B runs to convergence."""

GRID_STARTS = 512
"""Grid points refined together by damped Newton steps (:func:`_refine`); L-BFGS-B also runs
from the :data:`POLISHED` best distinct points they reach."""

POLISHED = 4

BOOT_STARTS = 8
"""Grid points refined, with the fit's constants, for each bootstrap resample; L-BFGS-B runs
from the fit's constants and from the best refined point."""

CONTINUATION = ((1.0, 15), (1e-1, 5), (1e-2, 10), (3e-3, 10), (HUBER_DELTA, 20))
"""The Newton refinement's (Huber threshold, steps): residuals of 0.01-0.1 at the starts put
the objective of threshold 1e-3 in its linear part, where Newton steps crawl (300 steps to reach
the minimum L-BFGS-B finds); least squares first, then thresholds shrinking to the fit's, reach
it in 60 steps."""

LBFGS_OPTIONS = {"ftol": 1e-15, "gtol": 1e-12, "maxiter": 10_000}
"""L-BFGS-B's stopping rules. With the Huber threshold of 1e-3 the objective is small (about
1e-4 for 40 runs at 1% noise) and flat along the E-alpha and B-beta valleys, so SciPy's defaults
(a step that lowers it by less than about 2e-9 of its value ends the search) stop far from the
minimum: on a synthetic law (beta 0.35) they stopped at beta 0.48 with twice the objective of the
minimum at beta 0.348 (tests/moe/tools/test_scaling_fit.py)."""


def _grid() -> np.ndarray:
    mesh = np.meshgrid(*INIT_GRID.values(), indexing="ij")
    return np.stack([m.ravel() for m in mesh], axis=1)


def _grid_terms(grid: np.ndarray, log_n, log_d, log_l) -> np.ndarray:
    """Each grid point's Huber term of each run (G x n): a resample's objective at every grid
    point is then this matrix times its counts of the runs."""
    a, b, e, alpha, beta = (grid[:, i : i + 1] for i in range(5))
    u, v = a - alpha * log_n, b - beta * log_d
    top = np.maximum(np.maximum(u, v), e)
    r = top + np.log(np.exp(u - top) + np.exp(v - top) + np.exp(e - top)) - log_l
    h = np.clip(r, -HUBER_DELTA, HUBER_DELTA)
    return h * (r - 0.5 * h)


def _refine(p, log_n, log_d, log_l, weight=None) -> tuple[np.ndarray, np.ndarray]:
    """Levenberg-Marquardt steps on every row of ``p`` at once, kept inside :data:`BOUNDS`, for
    each (threshold, steps) of :data:`CONTINUATION`; a step is taken only where it lowers the
    objective. Returns the points and their objective (of threshold :data:`HUBER_DELTA`)."""
    p = np.array(p, float)
    for delta, steps in CONTINUATION:
        p = _newton(p, log_n, log_d, log_l, weight, delta, steps)
    return p, _batch(p, log_n, log_d, log_l, weight)[0]


def _newton(p, log_n, log_d, log_l, weight, delta: float, steps: int) -> np.ndarray:
    lo, hi = np.array(BOUNDS, float).T
    p = np.clip(p, lo, hi)
    value, grad, hess = _batch(p, log_n, log_d, log_l, weight, True, delta)
    damping = np.full(len(p), 1e-3)
    eye = np.eye(5)
    for _ in range(steps):
        # A parameter on a bound that the gradient pushes outwards stays there: its row and
        # column of the system become the identity's, its step zero (projected Newton).
        held = ((p <= lo) & (grad > 0)) | ((p >= hi) & (grad < 0))  # (K, 5)
        free = (~held).astype(float)
        scale = np.maximum(np.abs(np.diagonal(hess, axis1=1, axis2=2)), 1e-9)
        system = (
            hess * free[:, :, None] * free[:, None, :]
            + damping[:, None, None] * (scale[:, :, None] * eye) * free[:, :, None]
            + held[:, :, None] * eye
        )
        try:
            step = np.linalg.solve(system, -(grad * free)[..., None])[..., 0]
        except np.linalg.LinAlgError:  # a singular system: damp harder, towards the gradient
            damping *= 10
            continue
        trial = np.clip(p + step, lo, hi)
        t_value, t_grad, t_hess = _batch(trial, log_n, log_d, log_l, weight, True, delta)
        better = t_value < value
        p[better], value[better] = trial[better], t_value[better]
        grad[better], hess[better] = t_grad[better], t_hess[better]
        damping = np.clip(np.where(better, damping / 3, damping * 4), 1e-9, 1e9)
    return p


def _distinct(points, values, count: int) -> list[np.ndarray]:
    """The ``count`` best of ``points`` (by ``values``) that differ from each other."""
    chosen: list[np.ndarray] = []
    for i in np.argsort(values):
        if all(np.abs(points[i] - c).max() > 1e-3 for c in chosen):
            chosen.append(points[i])
        if len(chosen) == count:
            break
    return chosen


def _lbfgsb(starts, log_n, log_d, log_l, weight=None) -> np.ndarray:
    """L-BFGS-B to convergence (:data:`LBFGS_OPTIONS`) from each start; the best end."""
    from scipy.optimize import minimize

    best = None
    for p0 in starts:
        r = minimize(
            _objective,
            p0,
            args=(log_n, log_d, log_l, weight),
            jac=True,
            method="L-BFGS-B",
            bounds=BOUNDS,
            options=LBFGS_OPTIONS,
        )
        if best is None or r.fun < best.fun:
            best = r
    return best.x


@dataclass
class ParametricFit:
    law: Law
    boot: list[Law]
    """The law refitted on bootstrap resamples of the runs."""

    def interval(self, fn, q=(2.5, 97.5)) -> tuple[float, float]:
        """Percentiles of ``fn`` over the bootstrap laws; NaN without any (``--bootstrap 0``)."""
        values = [fn(b) for b in self.boot]
        if not values:
            return float("nan"), float("nan")
        return percentile_interval(values, q)

    def on_bounds(self) -> list[tuple[str, str, float]]:
        """The law's constants that sit on the optimiser's bounds (:func:`on_bounds`)."""
        return on_bounds(self.law)

    def boot_on_bounds(self) -> int:
        """How many bootstrap laws have a constant on a bound."""
        return sum(bool(on_bounds(b)) for b in self.boot)


def on_bounds(law: Law) -> list[tuple[str, str, float]]:
    """(constant, ``lower`` or ``upper``, the bound as a value of the constant) for each of the
    law's constants within :data:`BOUND_TOLERANCE` of its bound in :data:`BOUNDS`."""
    out = []
    for name, value, (lo, hi) in zip(PARAMS, law.params(), BOUNDS):
        for side, bound in (("lower", lo), ("upper", hi)):
            if abs(value - bound) <= BOUND_TOLERANCE:
                out.append((name, side, math.exp(bound) if name in "ABE" else float(bound)))
    return out


def percentile_interval(values, q=(2.5, 97.5)) -> tuple[float, float]:
    """The ``q`` percentiles of ``values``, interpolated; where the sample holds an infinite
    value (a multiplier that no dense law reaches, an optimum a bootstrap law puts at infinity)
    the lower percentile is rounded down to a value of the sample and the upper one up, so the
    interval keeps the infinity instead of interpolating inf - inf to NaN."""
    v = np.asarray(values, float)
    finite = bool(np.isfinite(v).all())
    return (
        float(np.percentile(v, q[0], method="linear" if finite else "lower")),
        float(np.percentile(v, q[1], method="linear" if finite else "higher")),
    )


BOOT_CHUNK = 10
"""Bootstrap resamples refined in one batch (the progress callback is told after each)."""


@one_blas_thread
def fit_parametric(n, d, loss, bootstrap: int = 100, seed: int = 0, progress=None) -> ParametricFit:
    """L(N, D) = E + A/N^alpha + B/D^beta by Huber loss on log loss (the search is described in
    the module docstring); ``bootstrap`` refits on resamples (with replacement) of the points:
    the fit's constants and the resample's :data:`BOOT_STARTS` best grid points are refined
    together, then L-BFGS-B runs from the fit's constants and the best refined point.
    ``progress(k)`` is called as each ``k`` more resamples are done."""
    log_n, log_d = np.log(np.asarray(n, float)), np.log(np.asarray(d, float))
    log_l = np.log(np.asarray(loss, float))
    if len(log_n) < 5:
        raise ScalingError(f"{len(log_n)} finished runs; the parametric law has 5 constants")
    grid = _grid()
    terms = _grid_terms(grid, log_n, log_d, log_l)
    order = np.argsort(terms.sum(1))
    refined = _refine(grid[order[:GRID_STARTS]], log_n, log_d, log_l)
    best = _lbfgsb([*grid[order[:STARTS]], *_distinct(*refined, POLISHED)], log_n, log_d, log_l)
    rng = np.random.default_rng(seed)
    counts = np.array(
        [
            np.bincount(rng.integers(0, len(log_n), len(log_n)), minlength=len(log_n))
            for _ in range(bootstrap)
        ],
        float,
    ).reshape(bootstrap, len(log_n))
    boot = []
    for chunk in np.array_split(counts, math.ceil(bootstrap / BOOT_CHUNK)) if bootstrap else []:
        # Each resample: its best grid points and the fit refined together, L-BFGS-B from the
        # fit and from the best refined point.
        nearest = np.argsort(terms @ chunk.T, axis=0)[:BOOT_STARTS].T  # (resamples, starts)
        p = np.concatenate([np.repeat(best[None, None], len(chunk), 0), grid[nearest]], 1)
        per = p.shape[1]
        points, values = _refine(
            p.reshape(-1, 5), log_n, log_d, log_l, np.repeat(chunk, per, axis=0)
        )
        for i, w in enumerate(chunk):
            rows = slice(i * per, (i + 1) * per)
            top = points[rows][np.argmin(values[rows])]
            boot.append(_law(_lbfgsb([best, top], log_n, log_d, log_l, w)))
        if progress is not None:
            progress(len(chunk))
    return ParametricFit(_law(best), boot)


def _shared_objective(p, groups):
    """The sum of :func:`_objective` over families that share log E (``p[0]``); each family has
    (log A, log B, alpha, beta) at ``p[1 + 4 i : 5 + 4 i]``."""
    value, grad = 0.0, np.zeros_like(p)
    for i, (log_n, log_d, log_l) in enumerate(groups):
        a, b, alpha, beta = p[1 + 4 * i : 5 + 4 * i]
        v, g = _objective(np.array([a, b, p[0], alpha, beta]), log_n, log_d, log_l)
        value += v
        grad[0] += g[2]
        grad[1 + 4 * i : 5 + 4 * i] = g[[0, 1, 3, 4]]
    return value, grad


def _fit_shared_once(groups, starts) -> np.ndarray:
    from scipy.optimize import minimize

    bounds = [BOUNDS[2]] + [BOUNDS[0], BOUNDS[1], BOUNDS[3], BOUNDS[4]] * len(groups)
    best = None
    for p0 in starts:
        r = minimize(
            _shared_objective,
            p0,
            args=(groups,),
            jac=True,
            method="L-BFGS-B",
            bounds=bounds,
            options=LBFGS_OPTIONS,
        )
        if best is None or r.fun < best.fun:
            best = r
    return best.x


@one_blas_thread
def fit_shared_floor(
    data: dict[str, tuple], bootstrap: int = 100, seed: int = 0, progress=None
) -> dict[str, ParametricFit]:
    """One law per family, L_f(N, D) = E + A_f/N^alpha_f + B_f/D^beta_f, with the floor E shared:
    the irreducible loss is the entropy of the text, the same for every model trained on the same
    data and tokenizer (dense and MoE share it in the joint laws of Clark et al. 2022 and
    Ludziejewski et al. 2025). ``data`` maps each family to (N, D, loss). The families' own fits
    (:func:`fit_parametric`) give the starts, with E set in turn to each family's E, their
    geometric mean and the values of :data:`INIT_GRID`; L-BFGS-B on the summed Huber objectives
    from each. ``bootstrap`` refits on resamples of each family's runs, started from the best fit;
    ``progress(1)`` is called after each."""
    if len(data) < 2:
        raise ScalingError(
            f"a shared floor needs two or more families; the runs have {sorted(data)}"
        )
    names = sorted(data)
    groups = []
    for f in names:
        n, d, loss = data[f]
        if len(n) < 5:
            raise ScalingError(f"{f}: {len(n)} finished runs; the parametric law has 5 constants")
        groups.append(
            (
                np.log(np.asarray(n, float)),
                np.log(np.asarray(d, float)),
                np.log(np.asarray(loss, float)),
            )
        )
    own = [fit_parametric(*data[f], bootstrap=0).law for f in names]
    log_es = [math.log(law.E) for law in own]
    candidates = [*log_es, float(np.mean(log_es)), *INIT_GRID["e"]]
    rest = np.concatenate([[math.log(law.A), math.log(law.B), law.alpha, law.beta] for law in own])
    best = _fit_shared_once(groups, [np.concatenate([[e], rest]) for e in candidates])

    def laws(p):
        return [
            Law(
                E=math.exp(p[0]),
                A=math.exp(p[1 + 4 * i]),
                B=math.exp(p[2 + 4 * i]),
                alpha=p[3 + 4 * i],
                beta=p[4 + 4 * i],
            )
            for i in range(len(names))
        ]

    rng = np.random.default_rng(seed)
    boot: list[list[Law]] = [[] for _ in names]
    for _ in range(bootstrap):
        sample = []
        for g in groups:
            idx = rng.integers(0, len(g[0]), len(g[0]))
            sample.append(tuple(x[idx] for x in g))
        for i, law in enumerate(laws(_fit_shared_once(sample, [best]))):
            boot[i].append(law)
        if progress is not None:
            progress(1)
    return {f: ParametricFit(law, boot[i]) for i, (f, law) in enumerate(zip(names, laws(best)))}


FLOORS = ("family", "shared")
"""How the loss floor E of the families' laws is fitted: each its own, or one for all."""


def fit_laws(
    data: dict[str, tuple],
    floor: str = "family",
    bootstrap: int = 100,
    seed: int = 0,
    progress=None,
) -> dict[str, ParametricFit]:
    """Each family's parametric law from its (N, D, loss): ``floor="family"`` fits every family
    on its own (:func:`fit_parametric`), ``"shared"`` fits them together with one E
    (:func:`fit_shared_floor`; a single family is fitted on its own). ``progress(label, total)``
    (for example ``tqdm``) gives the object whose ``update(k)`` is called as ``k`` more bootstrap
    resamples are done, and whose ``close()`` ends it."""
    if floor not in FLOORS:
        raise ScalingError(f"floor {floor!r}: expected one of {', '.join(FLOORS)}")
    shared = floor == "shared" and len(data) >= 2
    jobs = [("+".join(sorted(data)), None)] if shared else [(f, f) for f in data]
    out: dict[str, ParametricFit] = {}
    for label, family in jobs:
        bar = progress(f"bootstrap {label}", bootstrap) if progress and bootstrap else None
        tick = bar.update if bar is not None else None
        try:
            if family is None:
                out.update(fit_shared_floor(data, bootstrap, seed, tick))
            else:
                out[family] = fit_parametric(
                    *data[family], bootstrap=bootstrap, seed=seed, progress=tick
                )
        finally:
            if bar is not None:
                bar.close()
    return out


def clark_law(n, experts, loss) -> dict:
    """log L = a log N + b log E + c log N log E + d (Clark et al. 2022), least squares; needs
    two or more expert counts."""
    require_scipy()
    from scipy.optimize import least_squares

    log_n, log_e = np.log(np.asarray(n, float)), np.log(np.asarray(experts, float))
    log_l = np.log(np.asarray(loss, float))
    if len(set(experts)) < 2:
        raise ScalingError("the expert law needs runs with two or more expert counts (--experts)")

    def residual(p):
        return p[0] * log_n + p[1] * log_e + p[2] * log_n * log_e + p[3] - log_l

    r = least_squares(residual, np.zeros(4))
    return dict(zip("abcd", map(float, r.x)))


def compute_multiplier(dense: Law, k_dense: float, moe_loss: float, budget: float) -> float:
    """The dense compute whose optimal loss equals ``moe_loss``, over ``budget``; inf when the
    dense law never reaches that loss."""
    require_scipy()
    from scipy.optimize import brentq

    if moe_loss <= dense.E:
        return float("inf")

    def gap(log_c):
        return dense.optimum(math.exp(log_c), k_dense)[2] - moe_loss

    lo, hi = math.log(budget) - 20, math.log(budget) + 40
    if gap(lo) < 0:
        return 0.0
    if gap(hi) > 0:
        return float("inf")
    return math.exp(brentq(gap, lo, hi)) / budget
