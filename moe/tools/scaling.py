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
  (32 below a width of 128, 16 where 32 does not divide the width, 8 where 16 does not, one head
  of the whole width below 16); ``n_layers = max(2, round(width / 64))`` (an aspect ratio of 64);
  MoE experts keep the base config's expert width / model width ratio, its expert count (or
  ``experts``), top-k and shared experts. The dense twin of each MoE shape has one FFN of the
  MoE's active width (top-k + shared experts), so both families have the same N at each width.
- **Each budget's ladder** is the ``sizes`` consecutive widths centred on the width whose N is
  nearest the expected optimum: the rule of thumb of :data:`TOKENS_PER_PARAM` tokens per
  parameter at the ladder's own FLOPs per token (:func:`rule_of_thumb`), or a ``centre`` the
  caller gives (``moe-scaling plan --centre-from``: the trend of a sweep's measured minima).
  :func:`ladder_warnings` names the budgets whose ladder cannot put sizes on both sides of it,
  and the side.
- **Run names** carry the budget exactly (:func:`budget_label`): ``dense-c1.6e11-w64``.
- **Batch**: the base config's, halved (accumulation first) until the run has ``min_steps``
  optimizer steps (``--min-steps``, default :data:`MIN_STEPS`, the same number below which
  ``moe-scaling fit`` warns about a run); a run that cannot reach :data:`STEPS_FLOOR` steps at
  one sequence per rank is refused.
- **Learning rate**: the base config's, scaled by ``sqrt(base width / width)`` and by
  ``sqrt(batch / base batch)`` (minimum too); warm-up: the base config's, at most a tenth of the
  run's steps.

The fits are in ``moe/tools/scaling_fit.py``, the analysis and report in
``moe/tools/scaling_report.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import numpy as np

from moe.core.errors import ScalingError
from moe.model.size import count_parameters, flops_per_token
from moe.model.transformer import ModelConfig
from moe.tools.scaling_fit import Law

WIDTHS = (
    8,
    12,
    16,
    24,
    32,
    48,
    64,
    96,
    128,
    192,
    256,
    384,
    512,
    768,
    1024,
    1536,
    2048,
    3072,
    4096,
    6144,
    8192,
)
"""Model widths a ladder draws from (about sqrt(2) apart)."""

STEPS_FLOOR = 25
"""A run needs at least this many optimizer steps: a budget is then spent within 2% (the
steps are rounded) and the warm-up and decay have room. Fewer is refused."""

MIN_STEPS = 200
"""The optimizer steps a run should have: ``moe-scaling plan`` halves a run's batch until it has
this many (``--min-steps``' default), and warns, as ``fit`` does, about a run that cannot reach
them. On our 2-core sweeps, runs of 77 to 132 steps ended 3-19% lower when trained again on the
same tokens with 200 or more steps (smaller batches; BENCHMARKS.md), and the two that had failed
to train trained normally."""

TOKENS_PER_PARAM = 20
"""The rule of thumb that centres a ladder: the compute-optimal run trains about 20 tokens per
parameter (Hoffmann et al. 2022)."""

BUDGET_TOLERANCE = 0.02
"""A planned run's FLOPs lie within this fraction of its budget."""

FAMILIES = ("dense", "moe")


def shape_for_width(
    base: ModelConfig, width: int, family: str, num_experts: int | None = None
) -> ModelConfig:
    """The ladder's model of ``width`` for ``family`` (see the module docstring)."""
    if family not in FAMILIES:
        raise ScalingError(f"family {family!r}: must be one of {FAMILIES}")
    head_dim = (
        64
        if width >= 128 and width % 64 == 0
        else 32
        if width % 32 == 0
        else 16
        if width % 16 == 0
        else 8
        if width >= 16
        else width
    )
    ratio = base.moe.expert_hidden / base.d_model
    expert_hidden = max(8, 8 * round(width * ratio / 8))
    moe = replace(
        base.moe,
        expert_hidden=expert_hidden,
        dense_hidden=None,
        num_experts=num_experts or base.moe.num_experts,
    )
    return replace(
        base,
        d_model=width,
        n_heads=width // head_dim,
        n_kv_heads=None,
        n_layers=max(2, round(width / 64)),
        ffn=family,
        moe=moe,
    )


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
    scale = math.sqrt(
        base.model.d_model
        / cfg.d_model
        * micro
        * accum
        / (base.micro_batch_size * base.grad_accum_steps)
    )
    return PlannedRun(
        name=name,
        family=family,
        budget=budget,
        width=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        experts=cfg.moe.num_experts if family == "moe" else 0,
        active_params=int(fpt["matmul_params"]),
        total_params=counts.total_params,
        tokens=tokens,
        steps=steps,
        batch_sequences=batch,
        micro_batch_size=micro,
        grad_accum_steps=accum,
        flops=tokens * fpt["training"],
        lr=base.lr * scale,
        min_lr=base.min_lr * scale,
        warmup_steps=min(base.warmup_steps, max(1, steps // 10)),
        epochs=tokens / base.corpus_tokens if base.corpus_tokens else float("inf"),
    )


Centre = Callable[[str, float], "float | None"]
"""(family, budget) -> the N a budget's ladder is centred on, or None for the rule of thumb."""


def budget_label(budget: float) -> str:
    """The budget as run names carry it: the shortest scientific notation that reads back as
    exactly ``budget`` (1.6e11, 2e11, 2.4e11), so that no two budgets share a name."""
    return np.format_float_scientific(budget, trim="-", exp_digits=1).replace("+", "")


def run_name(family: str, experts: int | None, budget: float, width: int) -> str:
    return f"{family}{f'-e{experts}' if experts else ''}-c{budget_label(budget)}-w{width}"


def _refuse_repeats(values, flag: str) -> None:
    twice = sorted({v for v in values if list(values).count(v) > 1}, key=str)
    if twice:
        raise ScalingError(
            f"{flag}: {', '.join(f'{v:g}' for v in twice)} given more than once "
            "(each names runs of its own)"
        )


def plan_sweep(
    base: Base,
    budgets: list[float],
    sizes: int,
    families: list[str],
    experts: list[int] | None = None,
    widths: list[int] | None = None,
    allow_repeat: bool = False,
    centre: Centre | None = None,
) -> tuple[list[PlannedRun], dict[str, ModelConfig]]:
    """Every run of the sweep and its model config, by run name. The ladder of each budget is
    the ``sizes`` consecutive widths centred on the expected optimum (``centre``, else
    :func:`rule_of_thumb`), unless ``widths`` names them. Raises ScalingError for a budget,
    width, expert count or family given twice, and listing every run that cannot spend its
    budget or would repeat the corpus."""
    if sizes < 3 and widths is None:
        raise ScalingError(f"--sizes {sizes}: a ladder needs at least 3 sizes to locate a minimum")
    if sizes > len(WIDTHS) and widths is None:
        raise ScalingError(
            f"--sizes {sizes}: the ladder has {len(WIDTHS)} widths ({WIDTHS[0]} to {WIDTHS[-1]})"
        )
    # Heads of 8 dimensions or more from a width of 16 (one head of the whole width below).
    unbuildable = [w for w in widths or [] if w >= 16 and w % 8]
    if unbuildable:
        raise ScalingError(
            f"--widths: {', '.join(map(str, unbuildable))} cannot be split into heads: a width "
            "of 16 or more must be a multiple of 8"
        )
    bad = [f for f in families if f not in FAMILIES]
    if bad:
        raise ScalingError(f"--families: {bad} not among {list(FAMILIES)}")
    for values, flag in (
        (budgets, "--budgets"),
        (widths or [], "--widths"),
        (experts or [], "--experts"),
        (families, "--families"),
    ):
        _refuse_repeats(values, flag)
    runs, models, problems = [], {}, []
    for budget in sorted(budgets):
        for family, e in _variants(families, experts):
            for w in widths or _ladder(base, budget, sizes, family, e, centre):
                cfg = shape_for_width(base.model, w, family, e)
                name = run_name(
                    family, cfg.moe.num_experts if family == "moe" and experts else None, budget, w
                )
                run = _run_for(base, cfg, family, budget, name)
                problem = _problem(base, run, allow_repeat)
                if problem:
                    problems.append(problem)
                runs.append(run)
                models[name] = cfg
    if len(models) < len(runs):  # the names carry every budget, width and expert count exactly
        raise ScalingError(
            "two planned runs share a name: "
            + ", ".join(sorted({r.name for r in runs if sum(q.name == r.name for q in runs) > 1}))
        )
    if problems:
        raise _refusal(base, runs, problems, sizes, families, experts, widths, allow_repeat)
    return runs, models


def _problem(base: Base, run: PlannedRun, allow_repeat: bool) -> str | None:
    """Why ``run`` cannot be planned, or None."""
    if run.steps < STEPS_FLOOR:
        per_token = (
            f"{run.flops / run.tokens:.3g} FLOPs per token"
            if run.tokens
            else "not one token's FLOPs"
        )
        return (
            f"{run.name}: the budget {run.budget:.3g} FLOPs buys {run.tokens:,} tokens "
            f"= {run.steps} steps of one sequence per rank ({run.active_params:,} "
            f"active parameters, {per_token}); at least {STEPS_FLOOR} steps are needed: "
            "raise the budget or use smaller widths"
        )
    if abs(run.flops / run.budget - 1) > BUDGET_TOLERANCE:
        return (
            f"{run.name}: {run.flops:.4g} FLOPs is not within {BUDGET_TOLERANCE:.0%} of "
            f"the budget {run.budget:.4g}"
        )
    if run.epochs > 1 and not allow_repeat:
        return (
            f"{run.name}: {run.tokens:,} tokens is {run.epochs:.2f} epochs of the "
            f"prepared corpus ({base.corpus_tokens:,} training tokens); use a "
            "larger corpus, smaller budgets, or --allow-repeat"
        )
    return None


def _refusal(base, runs, problems, sizes, families, experts, widths, allow_repeat) -> ScalingError:
    head = "the sweep cannot be planned"
    repeats = [r for r in runs if r.epochs > 1] if not allow_repeat else []
    if repeats:
        fits = largest_budget_without_repeat(base, sizes, families, experts, widths)
        head += (
            f": {len(repeats)} of {len(runs)} runs would read the prepared corpus "
            f"({base.corpus_tokens:,} training tokens) more than once "
            f"({min(r.epochs for r in repeats):.2f} to "
            f"{max(r.epochs for r in repeats):.2f} epochs); "
            + (
                f"with this corpus and ladder the largest budget that repeats nothing "
                f"is about {fits:.2g} FLOPs"
                if fits
                else "no budget of this ladder both has enough steps and repeats nothing"
            )
        )
    shown = problems[:MAX_PROBLEMS_SHOWN]
    more = len(problems) - len(shown)
    return ScalingError(
        head
        + ":\n"
        + "\n".join(f"  - {p}" for p in shown)
        + (f"\n  ... and {more} more like these" if more else "")
    )


def _variants(families: list[str], experts: list[int] | None):
    """(family, expert count) of each ladder a budget gets: one per expert count for MoE
    (None: the base config's), one for dense."""
    for family in families:
        for e in (experts or [None]) if family == "moe" else [None]:
            yield family, e


MAX_PROBLEMS_SHOWN = 12
"""A plan refused for many runs lists this many of them, then counts the rest."""


def largest_budget_without_repeat(
    base: Base,
    sizes: int,
    families: list[str],
    experts: list[int] | None = None,
    widths: list[int] | None = None,
) -> float | None:
    """The largest budget (to two significant figures) whose every ladder run has
    :data:`STEPS_FLOOR` steps and reads the prepared corpus at most once; None if there is
    none. Scanned downwards: the ladder moves to larger widths as the budget grows, so whether a
    budget fits is not monotonic in it."""
    if not base.corpus_tokens:
        return None

    def fits(budget: float) -> bool:
        for family, e in _variants(families, experts):
            for w in widths or _ladder(base, budget, sizes, family, e):
                run = _run_for(
                    base, shape_for_width(base.model, w, family, e), family, budget, "probe"
                )
                if run.steps < STEPS_FLOOR or run.epochs > 1:
                    return False
        return True

    # The tokens of a run grow with its budget, so a budget above corpus tokens x the largest
    # FLOPs per token of any ladder shape cannot fit: start the scan there.
    top = (
        max(
            flops_per_token(shape_for_width(base.model, w, f, e), base.seq_len)["training"]
            for f, e in _variants(families, experts)
            for w in (widths or WIDTHS)
        )
        * base.corpus_tokens
    )
    for exponent in np.arange(math.floor(math.log10(top) * 20) / 20, 6, -0.05):
        budget = float(f"{10**exponent:.2g}")
        if fits(budget):
            return budget
    return None


def ladder_costs(base: Base, family: str, experts: int | None = None) -> list[tuple[float, float]]:
    """(N, training FLOPs per token) of the ladder's model at each of :data:`WIDTHS`."""
    out = []
    for w in WIDTHS:
        fpt = flops_per_token(shape_for_width(base.model, w, family, experts), base.seq_len)
        out.append((fpt["matmul_params"], fpt["training"]))
    return out


def rule_of_thumb(
    base: Base,
    budget: float,
    family: str,
    experts: int | None = None,
    costs: list[tuple[float, float]] | None = None,
) -> float:
    """The N that trains :data:`TOKENS_PER_PARAM` tokens per parameter on ``budget``, at the
    FLOPs per token per parameter of the ladder shape nearest it (attention over the sequence
    makes that more than 6 at small widths)."""
    costs = costs or ladder_costs(base, family, experts)
    n, fpt = min(costs, key=lambda c: abs(math.log(budget / c[1] / c[0] / TOKENS_PER_PARAM)))
    return math.sqrt(budget / (TOKENS_PER_PARAM * fpt / n))


def expected_optimum(
    base: Base,
    budget: float,
    family: str,
    experts: int | None = None,
    centre: Centre | None = None,
    costs: list[tuple[float, float]] | None = None,
) -> float:
    """The N a budget's ladder is centred on: ``centre``'s, else :func:`rule_of_thumb`."""
    n = centre(family, budget) if centre is not None else None
    return n if n is not None else rule_of_thumb(base, budget, family, experts, costs)


def best_ladder_run(
    base: Base,
    law: Law,
    budget: float,
    family: str,
    experts: int | None = None,
    name: str = "predicted",
) -> tuple[PlannedRun, ModelConfig]:
    """The run of ``budget`` on the ladder shape the law ranks best: the least ``law.loss`` at
    the run's own N and tokens (batch rounding included), over the widths whose run has
    :data:`STEPS_FLOOR` steps. Along C = k N D the law's loss has one minimum in N, so this is
    one of the two shapes either side of N_opt; the nearer of them in log N is not always the
    better one (the loss rises more steeply on the small side of N_opt than on the large)."""
    best = None
    for w in WIDTHS:
        cfg = shape_for_width(base.model, w, family, experts)
        run = _run_for(base, cfg, family, budget, name)
        if run.steps < STEPS_FLOOR:
            continue
        loss = float(law.loss(run.active_params, run.tokens))
        if best is None or loss < best[0]:
            best = (loss, run, cfg)
    if best is None:
        raise ScalingError(
            f"the budget {budget:.3g} FLOPs gives no ladder shape {STEPS_FLOOR} "
            "steps of one sequence per rank"
        )
    return best[1], best[2]


def _ladder(
    base: Base,
    budget: float,
    sizes: int,
    family: str,
    experts: int | None,
    centre: Centre | None = None,
) -> list[int]:
    costs = ladder_costs(base, family, experts)
    target = expected_optimum(base, budget, family, experts, centre, costs)
    middle = min(range(len(WIDTHS)), key=lambda i: abs(math.log(costs[i][0] / target)))
    start = min(max(0, middle - sizes // 2), len(WIDTHS) - sizes)
    return list(WIDTHS[start : start + sizes])


def ladder_warnings(
    base: Base,
    runs: list[PlannedRun],
    centre: Centre | None = None,
    source: str = "the rule of thumb",
) -> list[str]:
    """A line for each budget and ladder whose sizes do not lie on both sides of the expected
    optimum (:func:`expected_optimum`; ``source`` says where it comes from), or lie mostly on
    one side of it, naming the side to add sizes on: such a ladder cannot bracket, or barely
    brackets, the minimum ``moe-scaling fit`` looks for."""
    groups: dict[tuple, list[PlannedRun]] = {}
    for r in runs:
        groups.setdefault((r.family, r.experts, r.budget), []).append(r)
    out = []
    for (family, experts, budget), rs in groups.items():
        target = expected_optimum(base, budget, family, experts or None, centre)
        rs = sorted(rs, key=lambda r: r.active_params)
        below = sum(r.active_params < target for r in rs)
        side = "smaller" if below <= len(rs) - 1 - below else "larger"
        few = min(below, len(rs) - below)
        if few >= (len(rs) - 1) // 2 and few > 0:
            continue
        end = rs[0] if side == "smaller" else rs[-1]
        optimum = f"the expected optimum (N {target:,.0f}, {source})"
        what = (
            f"{optimum} lies {'below' if side == 'smaller' else 'above'} the ladder's "
            f"{'smallest' if side == 'smaller' else 'largest'} size ({end.name}, N "
            f"{end.active_params:,})"
            if few == 0
            else f"only {few} of the ladder's {len(rs)} sizes have {side} N than {optimum}"
        )
        text = (
            f"{family}{f' ({experts} experts)' if experts else ''}, budget {budget:.3g}: "
            f"{what}; the loss may be lowest at that end: add sizes with {side} N "
            "(--widths)"
        )
        if side == "smaller" and end.width == WIDTHS[0]:
            head = (base.model.vocab_size or 0) * end.width / end.active_params
            text += (
                f"; {WIDTHS[0]} is the smallest width, whose output head is {head:.0%} of "
                "its N: a smaller vocabulary or a larger budget moves the optimum inside"
            )
        elif side == "larger":
            text += ", or plan a smaller budget"
        out.append(text)
    return out


def short_runs_warning(runs: list[dict], planned: bool = False) -> str | None:
    """The warning ``plan`` (``planned``) and ``fit`` give about runs of fewer than
    :data:`MIN_STEPS` optimizer steps, with the fix: a smaller batch (``--min-steps``) or, for
    a run at one sequence per rank already, a larger budget. None when there is none."""
    short = sorted(
        (r for r in runs if r.get("steps", MIN_STEPS) < MIN_STEPS), key=lambda r: r["steps"]
    )
    if not short:
        return None
    floor = [r for r in short if (r.get("micro_batch_size"), r.get("grad_accum_steps")) == (1, 1)]
    fixes = []
    if len(floor) < len(short):
        fixes.append(
            f"plan with --min-steps {MIN_STEPS} (the default) to give them smaller batches"
        )
    if floor:
        fixes.append(
            f"{len(floor)} of them train one sequence per rank already: a larger "
            "budget (or fewer ranks) gives them more steps"
        )
    return (
        f"{len(short)} run(s) {'will train' if planned else 'trained'} fewer than "
        f"{MIN_STEPS} optimizer steps ("
        + ", ".join(f"{r['name']} {r['steps']}" for r in short[:6])
        + (", ..." if len(short) > 6 else "")
        + "): such runs can be held back by their "
        "batch rather than their size; " + "; ".join(fixes)
    )


def run_table(runs: list[PlannedRun]) -> str:
    """A markdown table of the planned runs."""
    head = (
        "| run | family | width | layers | experts | N (active) | total params | tokens "
        "| tokens/N | steps | batch | FLOPs | budget error | lr | epochs |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
    )
    rows = [
        f"| {r.name} | {r.family} | {r.width} | {r.n_layers} | {r.experts or '-'} "
        f"| {r.active_params:,} | {r.total_params:,} | {r.tokens:,} | {r.tokens_per_param:.1f} "
        f"| {r.steps} | {r.batch_sequences} | {r.flops:.3e} | {r.flops / r.budget - 1:+.2%} "
        f"| {r.lr:.2e} | {r.epochs:.3f} |"
        for r in runs
    ]
    return head + "\n".join(rows) + "\n"


def planned_run_from_dict(d: dict) -> PlannedRun:
    return PlannedRun(**d)


def planned_run_to_dict(run: PlannedRun) -> dict:
    return asdict(run)
