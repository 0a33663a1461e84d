"""Scaling-law sweeps: which model, how many experts and how many tokens for a compute budget.

A sweep trains, for each compute budget C and family (dense, MoE), a ladder of model shapes,
each for the number of tokens that spends C; then it fits how the final validation loss depends
on the model size N and the tokens D, and predicts the compute-optimal run of a larger budget.

Definitions (the same everywhere in this module and in ``docs/scaling.md``):

- **N** is the active parameters that multiply a token's activations (``matmul_params`` of
  :func:`moe.model.size.flops_per_token`: attention, router, the active routed experts, shared
  experts, dense FFNs and the output head; not the embedding lookup, positions or norms).
- **D** is the training tokens; **C** the training FLOPs, D times the project's own training
  FLOPs per token (attention over the sequence included), so C is what ``moe-plan`` and the
  trainer's MFU count.
- **The ladder** (:func:`shape_for_width`): widths from :data:`WIDTHS`; heads of 64 dimensions
  (32 below a width of 128, 16 where 32 does not divide the width, 8 where 16 does not);
  ``n_layers = max(2, round(width / 64))`` (an aspect ratio of 64);
  MoE experts keep the base config's expert width / model width ratio, its expert count (or
  ``experts``), top-k and shared experts. The dense twin of each MoE shape has one FFN of the
  MoE's active width (top-k + shared experts), so both families have the same N at each width.
- **Batch**: the base config's, halved (accumulation first) until the run has ``min_steps``
  optimizer steps (``--min-steps``, default :data:`MIN_STEPS`).
- **Learning rate**: the base config's, scaled by ``sqrt(base width / width)`` and by
  ``sqrt(batch / base batch)`` (minimum too); warm-up: the base config's, at most a tenth of the
  run's steps.

Fits (scipy; :func:`fit_parametric` follows the corrections Besiroglu et al. 2024 made to
Chinchilla's third approach: Huber loss on log loss, a grid of initialisations, bootstrap
intervals):

- per budget, a parabola of loss in log N; its minimum is flagged when it is not inside the
  ladder (the true optimum may lie beyond the sizes trained);
- power laws N_opt = a C^b and D_opt = a' C^b' through the per-budget minima;
- the parametric law L(N, D) = E + A / N^alpha + B / D^beta per family, and from it the
  compute-optimal N, D and loss of any budget (closed form, with C = k N D where k is the
  sweep's FLOPs per token per parameter);
- for MoE, the compute multiplier: the dense compute whose optimal loss equals the MoE's at
  each budget, divided by that budget; with two or more expert counts also the expert law of
  Clark et al. 2022, log L = a log N + b log E + c log N log E + d.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np

from moe.errors import ScalingError
from moe.model.size import count_parameters, flops_per_token
from moe.model.transformer import ModelConfig

WIDTHS = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
"""Model widths a ladder draws from (about sqrt(2) apart)."""

MIN_STEPS = 25
"""A run needs at least this many optimizer steps: a budget is then spent within 2% (the
steps are rounded) and the warm-up and decay have room."""

BUDGET_TOLERANCE = 0.02
"""A planned run's FLOPs lie within this fraction of its budget."""

FAMILIES = ("dense", "moe")


def shape_for_width(base: ModelConfig, width: int, family: str,
                    num_experts: int | None = None) -> ModelConfig:
    """The ladder's model of ``width`` for ``family`` (see the module docstring)."""
    if family not in FAMILIES:
        raise ScalingError(f"family {family!r}: must be one of {FAMILIES}")
    head_dim = (64 if width >= 128 and width % 64 == 0 else 32 if width % 32 == 0
                else 16 if width % 16 == 0 else 8)
    ratio = base.moe.expert_hidden / base.d_model
    expert_hidden = max(8, 8 * round(width * ratio / 8))
    moe = replace(base.moe, expert_hidden=expert_hidden, dense_hidden=None,
                  num_experts=num_experts or base.moe.num_experts)
    return replace(base, d_model=width, n_heads=width // head_dim, n_kv_heads=None,
                   n_layers=max(2, round(width / 64)), ffn=family, moe=moe)


@dataclass
class PlannedRun:
    name: str
    family: str
    budget: float
    width: int
    n_layers: int
    n_heads: int
    experts: int
    active_params: int
    """N: the active parameters that multiply activations (see the module docstring)."""
    total_params: int
    tokens: int
    steps: int
    batch_sequences: int
    """Sequences per optimizer step (micro_batch_size x grad_accum_steps x ranks)."""
    micro_batch_size: int
    grad_accum_steps: int
    flops: float
    lr: float
    min_lr: float
    warmup_steps: int
    epochs: float
    """Passes over the prepared training tokens."""

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.active_params


@dataclass
class Base:
    """What a sweep takes from the user's config."""
    model: ModelConfig
    seq_len: int
    world_size: int
    micro_batch_size: int
    grad_accum_steps: int
    lr: float
    min_lr: float
    warmup_steps: int
    corpus_tokens: int
    """Training tokens of the prepared data (for the epochs column)."""
    min_steps: int = MIN_STEPS
    """A run's batch is halved (accumulation first, never below one sequence per rank) until
    the run has this many optimizer steps (``moe-scaling plan --min-steps``)."""


def _run_for(base: Base, cfg: ModelConfig, family: str, budget: float, name: str) -> PlannedRun:
    fpt = flops_per_token(cfg, base.seq_len)
    counts = count_parameters(cfg)
    micro, accum = base.micro_batch_size, base.grad_accum_steps
    tokens_needed = budget / fpt["training"]
    # Shrink the batch until the run has min_steps steps (never below one sequence per rank).
    while tokens_needed / (micro * accum * base.world_size * base.seq_len) < base.min_steps:
        if accum > 1:
            accum //= 2
        elif micro > 1:
            micro //= 2
        else:
            break
    batch = micro * accum * base.world_size
    steps = round(tokens_needed / (batch * base.seq_len))
    tokens = steps * batch * base.seq_len
    # The learning rate: sqrt(base width / width), and sqrt(batch / base batch) for a batch
    # shrunk to reach min_steps (Adam's square-root scaling rule).
    scale = math.sqrt(base.model.d_model / cfg.d_model * micro * accum
                      / (base.micro_batch_size * base.grad_accum_steps))
    return PlannedRun(
        name=name, family=family, budget=budget, width=cfg.d_model, n_layers=cfg.n_layers,
        n_heads=cfg.n_heads, experts=cfg.moe.num_experts if family == "moe" else 0,
        active_params=int(fpt["matmul_params"]), total_params=counts.total_params,
        tokens=tokens, steps=steps, batch_sequences=batch, micro_batch_size=micro,
        grad_accum_steps=accum, flops=tokens * fpt["training"],
        lr=base.lr * scale, min_lr=base.min_lr * scale,
        warmup_steps=min(base.warmup_steps, max(1, steps // 10)),
        epochs=tokens / base.corpus_tokens if base.corpus_tokens else float("inf"))


def plan_sweep(base: Base, budgets: list[float], sizes: int, families: list[str],
               experts: list[int] | None = None, widths: list[int] | None = None,
               allow_repeat: bool = False) -> tuple[list[PlannedRun], dict[str, ModelConfig]]:
    """Every run of the sweep and its model config, by run name. The ladder of each budget is
    the ``sizes`` consecutive widths centred on the width whose N is nearest the rule-of-thumb
    optimum sqrt(C / 120) (20 tokens per parameter), unless ``widths`` names them. Raises
    ScalingError listing every run that cannot spend its budget or would repeat the corpus."""
    if sizes < 3 and widths is None:
        raise ScalingError(f"--sizes {sizes}: a ladder needs at least 3 sizes to locate a minimum")
    bad = [f for f in families if f not in FAMILIES]
    if bad:
        raise ScalingError(f"--families: {bad} not among {list(FAMILIES)}")
    runs, models, problems = [], {}, []
    for budget in sorted(budgets):
        for family, e in _variants(families, experts):
            ladder = widths or _ladder(base, budget, sizes, family, e)
            for w in ladder:
                cfg = shape_for_width(base.model, w, family, e)
                suffix = f"-e{cfg.moe.num_experts}" if family == "moe" and experts else ""
                name = f"{family}{suffix}-c{budget:.0e}-w{w}".replace("+", "")
                run = _run_for(base, cfg, family, budget, name)
                if run.steps < MIN_STEPS:
                    problems.append(
                        f"{name}: the budget {budget:.3g} FLOPs buys {run.tokens:,} tokens "
                        f"= {run.steps} steps of one sequence per rank ({run.active_params:,} "
                        f"active parameters, {run.flops / max(run.tokens, 1):.3g} FLOPs per "
                        f"token); at least {MIN_STEPS} steps are needed: raise the budget or "
                        "use smaller widths")
                elif abs(run.flops / budget - 1) > BUDGET_TOLERANCE:
                    problems.append(f"{name}: {run.flops:.4g} FLOPs is not within "
                                    f"{BUDGET_TOLERANCE:.0%} of the budget {budget:.4g}")
                elif run.epochs > 1 and not allow_repeat:
                    problems.append(
                        f"{name}: {run.tokens:,} tokens is {run.epochs:.2f} epochs of the "
                        f"prepared corpus ({base.corpus_tokens:,} training tokens); use a "
                        "larger corpus, smaller budgets, or --allow-repeat")
                runs.append(run)
                models[name] = cfg
    if problems:
        head = "the sweep cannot be planned"
        repeats = [r for r in runs if r.epochs > 1] if not allow_repeat else []
        if repeats:
            fits = largest_budget_without_repeat(base, sizes, families, experts, widths)
            head += (f": {len(repeats)} of {len(runs)} runs would read the prepared corpus "
                     f"({base.corpus_tokens:,} training tokens) more than once "
                     f"({min(r.epochs for r in repeats):.2f} to "
                     f"{max(r.epochs for r in repeats):.2f} epochs); "
                     + (f"with this corpus and ladder the largest budget that repeats nothing "
                        f"is about {fits:.2g} FLOPs" if fits else
                        "no budget of this ladder both has enough steps and repeats nothing"))
        shown = problems[:MAX_PROBLEMS_SHOWN]
        more = len(problems) - len(shown)
        raise ScalingError(head + ":\n" + "\n".join(f"  - {p}" for p in shown)
                           + (f"\n  ... and {more} more like these" if more else ""))
    return runs, models


def _variants(families: list[str], experts: list[int] | None):
    """(family, expert count) of each ladder a budget gets: one per expert count for MoE
    (None: the base config's), one for dense."""
    for family in families:
        for e in (experts or [None]) if family == "moe" else [None]:
            yield family, e


MAX_PROBLEMS_SHOWN = 12
"""A plan refused for many runs lists this many of them, then counts the rest."""


def largest_budget_without_repeat(base: Base, sizes: int, families: list[str],
                                  experts: list[int] | None = None,
                                  widths: list[int] | None = None) -> float | None:
    """The largest budget (to two significant figures) whose every ladder run has
    :data:`MIN_STEPS` steps and reads the prepared corpus at most once; None if there is none.
    Scanned downwards: the ladder moves to larger widths as the budget grows, so whether a
    budget fits is not monotonic in it."""
    if not base.corpus_tokens:
        return None

    def fits(budget: float) -> bool:
        for family, e in _variants(families, experts):
            for w in widths or _ladder(base, budget, sizes, family, e):
                run = _run_for(base, shape_for_width(base.model, w, family, e), family,
                               budget, "probe")
                if run.steps < MIN_STEPS or run.epochs > 1:
                    return False
        return True

    # The tokens of a run grow with its budget, so a budget above corpus tokens x the largest
    # FLOPs per token of any ladder shape cannot fit: start the scan there.
    top = max(flops_per_token(shape_for_width(base.model, w, f, e), base.seq_len)["training"]
              for f, e in _variants(families, experts)
              for w in (widths or WIDTHS)) * base.corpus_tokens
    for exponent in np.arange(math.floor(math.log10(top) * 20) / 20, 6, -0.05):
        budget = float(f"{10 ** exponent:.2g}")
        if fits(budget):
            return budget
    return None


def ladder_params(base: Base, family: str, experts: int | None = None) -> list[float]:
    """N (active parameters) of the ladder's model at each of :data:`WIDTHS`."""
    return [flops_per_token(shape_for_width(base.model, w, family, experts), base.seq_len)
            ["matmul_params"] for w in WIDTHS]


def best_ladder_run(base: Base, law: Law, budget: float, family: str,
                    experts: int | None = None, name: str = "predicted"
                    ) -> tuple[PlannedRun, ModelConfig]:
    """The run of ``budget`` on the ladder shape the law ranks best: the least ``law.loss`` at
    the run's own N and tokens (batch rounding included), over the widths whose run has
    :data:`MIN_STEPS` steps. Along C = k N D the law's loss has one minimum in N, so this is one
    of the two shapes either side of N_opt; the nearer of them in log N is not always the better
    one (the loss rises more steeply on the small side of N_opt than on the large)."""
    best = None
    for w in WIDTHS:
        cfg = shape_for_width(base.model, w, family, experts)
        run = _run_for(base, cfg, family, budget, name)
        if run.steps < MIN_STEPS:
            continue
        loss = float(law.loss(run.active_params, run.tokens))
        if best is None or loss < best[0]:
            best = (loss, run, cfg)
    if best is None:
        raise ScalingError(f"the budget {budget:.3g} FLOPs gives no ladder shape {MIN_STEPS} "
                           "steps of one sequence per rank")
    return best[1], best[2]


def _ladder(base: Base, budget: float, sizes: int, family: str, experts: int | None) -> list[int]:
    target = math.sqrt(budget / 120)
    n = ladder_params(base, family, experts)
    centre = min(range(len(WIDTHS)), key=lambda i: abs(math.log(n[i] / target)))
    start = min(max(0, centre - sizes // 2), len(WIDTHS) - sizes)
    return list(WIDTHS[start:start + sizes])


def run_table(runs: list[PlannedRun]) -> str:
    """A markdown table of the planned runs."""
    head = ("| run | family | width | layers | experts | N (active) | total params | tokens "
            "| tokens/N | steps | batch | FLOPs | budget error | lr | epochs |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
    rows = [f"| {r.name} | {r.family} | {r.width} | {r.n_layers} | {r.experts or '-'} "
            f"| {r.active_params:,} | {r.total_params:,} | {r.tokens:,} | {r.tokens_per_param:.1f} "
            f"| {r.steps} | {r.batch_sequences} | {r.flops:.3e} | {r.flops / r.budget - 1:+.2%} "
            f"| {r.lr:.2e} | {r.epochs:.3f} |" for r in runs]
    return head + "\n".join(rows) + "\n"


def planned_run_from_dict(d: dict) -> PlannedRun:
    return PlannedRun(**d)


def planned_run_to_dict(run: PlannedRun) -> dict:
    return asdict(run)


# ---------------------------------------------------------------------------------------------
# Fits


@dataclass
class IsoFlopMinimum:
    budget: float
    n_opt: float
    loss_opt: float
    at_edge: bool
    """The parabola's minimum is not inside the ladder (or the parabola opens downwards): the
    true optimum may lie beyond the sizes trained."""
    coeffs: tuple[float, float, float]
    """Loss = c0 x^2 + c1 x + c2 in x = ln N."""


def isoflop_minimum(budget: float, n: list[float], loss: list[float]) -> IsoFlopMinimum:
    """The minimum over sizes at one budget: a parabola of loss in ln N."""
    if len(n) < 3:
        raise ScalingError(f"budget {budget:.3g}: {len(n)} finished runs; a parabola needs 3")
    x = np.log(np.asarray(n, float))
    c = np.polyfit(x, np.asarray(loss, float), 2)
    if c[0] <= 0:
        i = int(np.argmin(loss))
        return IsoFlopMinimum(budget, float(n[i]), float(loss[i]), True, tuple(map(float, c)))
    x_opt = -c[1] / (2 * c[0])
    at_edge = not (x.min() < x_opt < x.max()) or int(np.argmin(loss)) in (0, len(n) - 1)
    return IsoFlopMinimum(budget, float(math.exp(x_opt)), float(np.polyval(c, x_opt)), at_edge,
                          tuple(map(float, c)))


def require_scipy() -> None:
    """The fits use SciPy, an optional extra: refuse with the command that installs it."""
    try:
        import scipy  # noqa: F401
    except ImportError:
        raise ScalingError("moe-scaling's fits need SciPy, which the 'scaling' extra installs: "
                           "python3 -m pip install -c constraints.txt -e '.[scaling]'") from None


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
        """(N, D, loss) minimising the loss at C = k N D."""
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1 / (self.alpha + self.beta))
        n = g * (budget / k) ** (self.beta / (self.alpha + self.beta))
        d = budget / (k * n)
        return float(n), float(d), float(self.loss(n, d))


HUBER_DELTA = 1e-3
"""The Huber loss's threshold on log-loss residuals (Chinchilla's and Besiroglu et al.'s)."""


def _objective(p, log_n, log_d, log_l):
    """Huber loss of log-loss residuals, and its gradient in (log A, log B, log E, alpha, beta)."""
    a, b, e, alpha, beta = p
    z = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])
    top = z.max(axis=0)
    w = np.exp(z - top)
    pred = top + np.log(w.sum(axis=0))
    w /= w.sum(axis=0)
    r = pred - log_l
    small = np.abs(r) <= HUBER_DELTA
    value = np.where(small, 0.5 * r * r, HUBER_DELTA * (np.abs(r) - 0.5 * HUBER_DELTA)).sum()
    h = np.where(small, r, HUBER_DELTA * np.sign(r))
    grad = np.array([(h * w[0]).sum(), (h * w[1]).sum(), (h * w[2]).sum(),
                     -(h * w[0] * log_n).sum(), -(h * w[1] * log_d).sum()])
    return float(value), grad


INIT_GRID = {"a": np.arange(0.0, 30.0, 5.0), "b": np.arange(0.0, 30.0, 5.0),
             "e": np.arange(-1.0, 1.5, 0.5), "alpha": np.arange(0.0, 2.5, 0.5),
             "beta": np.arange(0.0, 2.5, 0.5)}
"""Initial points of the fit (log A, log B, log E, alpha, beta): every combination (4,500, as
Chinchilla's grid); the objective is evaluated at all of them and L-BFGS-B starts from the
:data:`STARTS` best."""

STARTS = 16

BOUNDS = [(-10, 40), (-10, 40), (-5, 5), (0.0, 3.0), (0.0, 3.0)]

LBFGS_OPTIONS = {"ftol": 1e-15, "gtol": 1e-12, "maxiter": 10_000}
"""L-BFGS-B's stopping rules. With the Huber threshold of 1e-3 the objective is small (about
1e-4 for 40 runs at 1% noise) and flat along the E-alpha and B-beta valleys, so SciPy's defaults
(a step that lowers it by less than about 2e-9 of its value ends the search) stop far from the
minimum: on a synthetic law (beta 0.35) they stopped at beta 0.48 with twice the objective of the
minimum at beta 0.348 (tests/moe/tools/test_scaling.py)."""


def _grid() -> np.ndarray:
    mesh = np.meshgrid(*INIT_GRID.values(), indexing="ij")
    return np.stack([m.ravel() for m in mesh], axis=1)


def _best_starts(grid: np.ndarray, log_n, log_d, log_l, count: int) -> np.ndarray:
    """The ``count`` grid points of lowest objective (evaluated for all points at once)."""
    a, b, e, alpha, beta = (grid[:, i:i + 1] for i in range(5))
    z = np.stack([a - alpha * log_n, b - beta * log_d, np.broadcast_to(e, (len(grid), len(log_n)))])
    top = z.max(axis=0)
    r = top + np.log(np.exp(z - top).sum(axis=0)) - log_l
    value = np.where(np.abs(r) <= HUBER_DELTA, 0.5 * r * r,
                     HUBER_DELTA * (np.abs(r) - 0.5 * HUBER_DELTA)).sum(axis=1)
    return grid[np.argsort(value)[:count]]


def _fit_once(log_n, log_d, log_l, starts) -> np.ndarray:
    require_scipy()
    from scipy.optimize import minimize

    best = None
    for p0 in starts:
        r = minimize(_objective, p0, args=(log_n, log_d, log_l), jac=True, method="L-BFGS-B",
                     bounds=BOUNDS, options=LBFGS_OPTIONS)
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


def percentile_interval(values, q=(2.5, 97.5)) -> tuple[float, float]:
    """The ``q`` percentiles of ``values``, interpolated; where the sample holds an infinite
    value (a multiplier that no dense law reaches, an optimum a bootstrap law puts at infinity)
    the lower percentile is rounded down to a value of the sample and the upper one up, so the
    interval keeps the infinity instead of interpolating inf - inf to NaN."""
    v = np.asarray(values, float)
    finite = bool(np.isfinite(v).all())
    return (float(np.percentile(v, q[0], method="linear" if finite else "lower")),
            float(np.percentile(v, q[1], method="linear" if finite else "higher")))


def fit_parametric(n, d, loss, bootstrap: int = 100, seed: int = 0) -> ParametricFit:
    """L(N, D) = E + A/N^alpha + B/D^beta by Huber loss on log loss, started from the best
    points of :data:`INIT_GRID`; ``bootstrap`` refits on resamples (with replacement) of the
    points, started from the best fit and the resample's three best grid points."""
    log_n, log_d = np.log(np.asarray(n, float)), np.log(np.asarray(d, float))
    log_l = np.log(np.asarray(loss, float))
    if len(log_n) < 5:
        raise ScalingError(f"{len(log_n)} finished runs; the parametric law has 5 constants")
    grid = _grid()
    best = _fit_once(log_n, log_d, log_l, _best_starts(grid, log_n, log_d, log_l, STARTS))

    def law(p):
        return Law(E=math.exp(p[2]), A=math.exp(p[0]), B=math.exp(p[1]), alpha=p[3], beta=p[4])

    rng = np.random.default_rng(seed)
    boot = []
    for _ in range(bootstrap):
        idx = rng.integers(0, len(log_n), len(log_n))
        starts = _best_starts(grid, log_n[idx], log_d[idx], log_l[idx], 3)
        boot.append(law(_fit_once(log_n[idx], log_d[idx], log_l[idx], [best, *starts])))
    return ParametricFit(law(best), boot)


def _shared_objective(p, groups):
    """The sum of :func:`_objective` over families that share log E (``p[0]``); each family has
    (log A, log B, alpha, beta) at ``p[1 + 4 i : 5 + 4 i]``."""
    value, grad = 0.0, np.zeros_like(p)
    for i, (log_n, log_d, log_l) in enumerate(groups):
        a, b, alpha, beta = p[1 + 4 * i:5 + 4 * i]
        v, g = _objective(np.array([a, b, p[0], alpha, beta]), log_n, log_d, log_l)
        value += v
        grad[0] += g[2]
        grad[1 + 4 * i:5 + 4 * i] = g[[0, 1, 3, 4]]
    return value, grad


def _fit_shared_once(groups, starts) -> np.ndarray:
    require_scipy()
    from scipy.optimize import minimize

    bounds = [BOUNDS[2]] + [BOUNDS[0], BOUNDS[1], BOUNDS[3], BOUNDS[4]] * len(groups)
    best = None
    for p0 in starts:
        r = minimize(_shared_objective, p0, args=(groups,), jac=True, method="L-BFGS-B",
                     bounds=bounds, options=LBFGS_OPTIONS)
        if best is None or r.fun < best.fun:
            best = r
    return best.x


def fit_shared_floor(data: dict[str, tuple], bootstrap: int = 100,
                     seed: int = 0) -> dict[str, ParametricFit]:
    """One law per family, L_f(N, D) = E + A_f/N^alpha_f + B_f/D^beta_f, with the floor E shared:
    the irreducible loss is the entropy of the text, the same for every model trained on the same
    data and tokenizer (dense and MoE share it in the joint laws of Clark et al. 2022 and
    Ludziejewski et al. 2025). ``data`` maps each family to (N, D, loss). The families' own fits
    (:func:`fit_parametric`) give the starts, with E set in turn to each family's E, their
    geometric mean and the values of :data:`INIT_GRID`; L-BFGS-B on the summed Huber objectives
    from each. ``bootstrap`` refits on resamples of each family's runs, started from the best fit."""
    if len(data) < 2:
        raise ScalingError(f"a shared floor needs two or more families; the runs have {sorted(data)}")
    names = sorted(data)
    groups = []
    for f in names:
        n, d, loss = data[f]
        if len(n) < 5:
            raise ScalingError(f"{f}: {len(n)} finished runs; the parametric law has 5 constants")
        groups.append((np.log(np.asarray(n, float)), np.log(np.asarray(d, float)),
                       np.log(np.asarray(loss, float))))
    own = [fit_parametric(*data[f], bootstrap=0).law for f in names]
    log_es = [math.log(law.E) for law in own]
    candidates = [*log_es, float(np.mean(log_es)), *INIT_GRID["e"]]
    rest = np.concatenate([[math.log(law.A), math.log(law.B), law.alpha, law.beta] for law in own])
    best = _fit_shared_once(groups, [np.concatenate([[e], rest]) for e in candidates])

    def laws(p):
        return [Law(E=math.exp(p[0]), A=math.exp(p[1 + 4 * i]), B=math.exp(p[2 + 4 * i]),
                    alpha=p[3 + 4 * i], beta=p[4 + 4 * i]) for i in range(len(names))]

    rng = np.random.default_rng(seed)
    boot: list[list[Law]] = [[] for _ in names]
    for _ in range(bootstrap):
        sample = []
        for g in groups:
            idx = rng.integers(0, len(g[0]), len(g[0]))
            sample.append(tuple(x[idx] for x in g))
        for i, law in enumerate(laws(_fit_shared_once(sample, [best]))):
            boot[i].append(law)
    return {f: ParametricFit(law, boot[i]) for i, (f, law) in enumerate(zip(names, laws(best)))}


def fit_laws(data: dict[str, tuple], floor: str = "family", bootstrap: int = 100,
             seed: int = 0) -> dict[str, ParametricFit]:
    """Each family's parametric law from its (N, D, loss): ``floor="family"`` fits every family
    on its own (:func:`fit_parametric`), ``"shared"`` fits them together with one E
    (:func:`fit_shared_floor`; a single family is fitted on its own)."""
    if floor not in FLOORS:
        raise ScalingError(f"floor {floor!r}: expected one of {', '.join(FLOORS)}")
    if floor == "shared" and len(data) >= 2:
        return fit_shared_floor(data, bootstrap, seed)
    return {f: fit_parametric(*v, bootstrap=bootstrap, seed=seed) for f, v in data.items()}


FLOORS = ("family", "shared")
"""How the loss floor E of the families' laws is fitted: each its own, or one for all."""


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
