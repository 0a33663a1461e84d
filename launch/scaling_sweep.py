"""What a scaling sweep's directory holds, read back: the plan (``sweep.json``), which runs
finished, and each finished run's final validation loss (``moe-scaling fit`` and ``predict``
read these; ``moe-scaling run`` skips the finished runs)."""

from __future__ import annotations

import json
from pathlib import Path

from moe.errors import ScalingError
from moe.run_dir import RunDir
from moe.tools import scaling

SWEEP_FILE = "sweep.json"


def load_sweep(sweep_dir: Path) -> tuple[dict, list[scaling.PlannedRun]]:
    try:
        sweep = json.loads((sweep_dir / SWEEP_FILE).read_text())
    except FileNotFoundError:
        raise ScalingError(f"{sweep_dir / SWEEP_FILE}: no sweep planned there "
                           "(moe-scaling plan CONFIG --budgets ... --out DIR)") from None
    except (OSError, ValueError) as e:
        raise ScalingError(f"{sweep_dir / SWEEP_FILE}: unreadable ({e})") from None
    return sweep, [scaling.planned_run_from_dict(r) for r in sweep["runs"]]


def finished(sweep_dir: Path, run: scaling.PlannedRun) -> dict | None:
    """The final evaluation of a run that trained all its steps, or None."""
    run_dir = sweep_dir / "runs" / run.name
    try:
        summary = json.loads(RunDir(run_dir).summary.read_text())
        report = json.loads((Path(summary["checkpoint"]) / "eval" / "eval.json").read_text())
        result = report["checkpoints"][-1]
    except (FileNotFoundError, KeyError, IndexError, TypeError, ValueError):
        return None
    if summary.get("steps") != run.steps or result.get("step") != run.steps:
        return None
    return result


def results(sweep_dir: Path, exclude: str | None = None) -> list[dict]:
    """Each finished run's plan and final validation loss, less the runs ``exclude`` names
    (comma-separated run names; a name the sweep does not plan is an error)."""
    _, runs = load_sweep(sweep_dir)
    names = [n.strip() for n in (exclude or "").split(",") if n.strip()]
    unknown = sorted(set(names) - {r.name for r in runs})
    if unknown:
        raise ScalingError(f"--exclude: {unknown} are not runs of {sweep_dir} (its runs are "
                           f"listed in {sweep_dir / 'plan.md'})")
    out = []
    for r in runs:
        if r.name in names:
            continue
        ev = finished(sweep_dir, r)
        if ev is not None:
            out.append({**scaling.planned_run_to_dict(r), "loss": float(ev["loss"])})
    if not out:
        raise ScalingError(f"{sweep_dir}: no finished run to fit ({len(runs)} planned; "
                           f"moe-scaling run {sweep_dir})")
    return out
