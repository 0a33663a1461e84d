"""What a scaling sweep's directory holds, read back: the plan (``sweep.json``), which runs
finished, and each finished run's final validation loss (``moe-scaling fit`` and ``predict``
read these; ``moe-scaling run`` skips the finished runs)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from data_pipeline.errors import DataError
from data_pipeline.prepared import PreparedData
from data_pipeline.text_bytes import predicted_text_bytes
from data_pipeline.token_stream import TokenStream
from data_pipeline.tokenizer import Tokenizer
from moe.config.run import load_config
from moe.core.errors import MoEError, ScalingError
from moe.core.run_dir import RunDir
from moe.tools import scaling

SWEEP_FILE = "sweep.json"


def load_sweep(sweep_dir: Path) -> tuple[dict, list[scaling.PlannedRun]]:
    try:
        sweep = json.loads((sweep_dir / SWEEP_FILE).read_text())
    except FileNotFoundError:
        raise ScalingError(
            f"{sweep_dir / SWEEP_FILE}: no sweep planned there "
            "(moe-scaling plan CONFIG --budgets ... --out DIR)"
        ) from None
    except (OSError, ValueError) as e:
        raise ScalingError(f"{sweep_dir / SWEEP_FILE}: unreadable ({e})") from None
    try:
        runs = [scaling.planned_run_from_dict(r) for r in sweep["runs"]]
        _ = sweep["config"], sweep["overrides"]  # predict reads them back
    except (KeyError, TypeError) as e:
        raise ScalingError(
            f"{sweep_dir / SWEEP_FILE}: not a plan moe-scaling wrote (edited by hand, or "
            f"another file of that name: {type(e).__name__} {e}); plan the sweep again with "
            "moe-scaling plan ... --force"
        ) from None
    if not runs:
        raise ScalingError(f"{sweep_dir / SWEEP_FILE}: the plan has no runs")
    return sweep, runs


def finished(sweep_dir: Path, run: scaling.PlannedRun) -> dict | None:
    """The final evaluation of a run that trained all its steps, or None."""
    run_dir = sweep_dir / "runs" / run.name
    try:
        summary = json.loads(RunDir(run_dir).summary.read_text())
        # The checkpoint by its name in this run directory: the summary's path is where the run
        # trained, which a sweep moved or copied elsewhere is no longer.
        tag_dir = RunDir(run_dir).checkpoints / Path(summary["checkpoint"]).name
        report = json.loads((tag_dir / "eval" / "eval.json").read_text())
        result = report["checkpoints"][-1]
    except (FileNotFoundError, KeyError, IndexError, TypeError, ValueError):
        return None
    if summary.get("steps") != run.steps or result.get("step") != run.steps:
        return None
    return result


def results(sweep_dir: Path, exclude: str | None = None) -> list[dict]:
    """Each finished run's plan, final validation loss (``loss``), the validation tokens it
    averages over (``eval_tokens``) and training curve (``curve``, :func:`training_curve`), less
    the runs ``exclude`` names (comma-separated run names; a name the sweep does not plan is an
    error)."""
    _, runs = load_sweep(sweep_dir)
    names = [n.strip() for n in (exclude or "").split(",") if n.strip()]
    unknown = sorted(set(names) - {r.name for r in runs})
    if unknown:
        raise ScalingError(
            f"--exclude: {unknown} are not runs of {sweep_dir} (its runs are "
            f"listed in {sweep_dir / 'plan.md'})"
        )
    out = []
    for r in runs:
        if r.name in names:
            continue
        ev = finished(sweep_dir, r)
        if ev is not None:
            out.append(
                {
                    **scaling.planned_run_to_dict(r),
                    "loss": float(ev["loss"]),
                    "eval_tokens": ev.get("tokens"),
                    "curve": training_curve(sweep_dir / "runs" / r.name),
                }
            )
    if not out:
        raise ScalingError(
            f"{sweep_dir}: no finished run to fit ({len(runs)} planned; "
            f"moe-scaling run {sweep_dir})"
        )
    return out


def training_curve(run_dir: Path) -> tuple[list[int], list[float]] | None:
    """(steps, training loss) of a run from the step records every rank writes
    (``RunDir.step_records``: one line per step, each rank's own loss): at each step the mean
    over the ranks; a step whose loss is not finite is left out. None without records."""
    sums: dict[int, list[float]] = {}
    for path in RunDir(run_dir).all_step_records():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
                step, loss = int(record["step"]), float(record["loss"])
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a kill
            if math.isfinite(loss):
                sums.setdefault(step, []).append(loss)
    if not sums:
        return None
    steps = sorted(sums)
    return steps, [sum(sums[s]) / len(sums[s]) for s in steps]


COVERAGE_WARN = 0.5
"""Runs scored on fewer than this fraction of the validation split's documents are warned
about: the evaluated tokens are the split's first documents, not a sample of it."""


def validation_text(sweep_dir: Path, rows: list[dict]) -> tuple[float | None, list[str]]:
    """The UTF-8 bytes per predicted token of the validation text the runs ``rows`` were
    evaluated on (None when the data cannot be read or were not the runs': another number of
    predictions than their evaluations made), for bits per byte; and the warnings: why bits per
    byte are left out, and whether the evaluated tokens (``eval.max_tokens``, the first of the
    split) hold only a small part of the split's documents."""
    path = sweep_dir / "configs" / f"{rows[0]['name']}.yaml"
    try:
        cfg = load_config(path)
        data = PreparedData.from_config(cfg.data)
        seen = predicted_text_bytes(
            TokenStream(data, "valid"), Tokenizer(data.tokenizer_file()), cfg.eval.max_tokens
        )
    except (MoEError, DataError, OSError) as e:
        return None, [f"bits per byte left out: the validation text of {path} is unreadable ({e})"]
    evaluated = sorted({r.get("eval_tokens") for r in rows}, key=str)
    if evaluated != [seen.targets] or not seen.bytes:
        return None, [
            f"bits per byte left out: the runs were evaluated on "
            f"{', '.join(map(str, evaluated))} validation targets, the data of {path} "
            f"gives {seen.targets:,} (prepared again since?)"
        ]
    split = data.manifest.splits["valid"]
    warnings = []
    if seen.documents < COVERAGE_WARN * split.documents:
        warnings.append(
            f"the runs are scored on the first {seen.targets:,} validation tokens "
            f"(eval.max_tokens {cfg.eval.max_tokens:,}), which reach into {seen.documents:,} of "
            f"the split's {split.documents:,} documents ({split.tokens:,} tokens): its first "
            "documents in the order of the sources and their files, not a sample of the corpus; "
            "every validation loss, minimum, law and bits per byte here describes those "
            "documents. Score the whole split (eval.max_tokens: null) with a smaller "
            "data.valid_fraction, which samples documents from every file, or raise "
            "eval.max_tokens"
        )
    return seen.bytes / seen.targets, warnings
