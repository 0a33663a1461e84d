"""Real launches with injected faults (moe/training/resilience/faults.py's test-only plan), and the checks
a recovered run must pass against an uninterrupted one: the same loss at every step on every
rank, every global sample consumed exactly once, every checkpoint on disk verifying. Used by
tests/integration/test_fault_campaign.py and
benchmarks/fault_campaign.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from moe.checkpoint.files import complete_tags, verify_files
from moe.core.errors import CheckpointError
from moe.training.resilience.faults import PLAN_ENV

ROOT = Path(__file__).resolve().parents[2]


def write_run_config(path: Path, run: dict) -> Path:
    path.write_text(yaml.safe_dump(run))
    return path


def launch(
    config: Path,
    overrides: list[str] = (),
    plan: dict | None = None,
    timeout: float = 900,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """moe-launch CONFIG --no-eval OVERRIDES in a fresh process, with this checkout importable
    by every rank and, if given, ``plan`` as the ranks' fault plan and ``env`` added to its
    environment."""
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = str(ROOT) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    env.pop(PLAN_ENV, None)
    if plan is not None:
        plan_path = Path(plan["fired_dir"]) / "plan.json"
        plan_path.parent.mkdir(parents=True, exist_ok=True)
        plan_path.write_text(json.dumps(plan))
        env[PLAN_ENV] = str(plan_path)
    return subprocess.run(
        [sys.executable, "-m", "launch.launch", str(config), "--no-eval", *overrides],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def step_records(run_dir: Path, rank: int) -> list[dict]:
    path = run_dir / "logs" / f"steps_rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def restarts(run_dir: Path) -> list[dict]:
    path = run_dir / "logs" / "restarts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def loss_mismatches(run_dir: Path, reference: Path, max_steps: int, ranks: int = 2) -> list[str]:
    """Steps whose record differs from the reference run's: each rank's loss (bitwise, JSON
    floats round-trip) and token hash, and every step 1..max_steps exactly once, in order."""
    out = []
    for rank in range(ranks):
        got, want = step_records(run_dir, rank), step_records(reference, rank)
        if [r["step"] for r in got] != list(range(1, max_steps + 1)):
            out.append(f"rank {rank}: steps {[r['step'] for r in got]}")
            continue
        for g, w in zip(got, want):
            if (g["loss"], g["tokens_sha256"]) != (w["loss"], w["tokens_sha256"]):
                out.append(
                    f"rank {rank} step {g['step']}: loss {g['loss']!r} vs {w['loss']!r}, "
                    f"tokens {g['tokens_sha256']} vs {w['tokens_sha256']}"
                )
    return out


def sample_problems(
    run_dir: Path, max_steps: int, global_batch: int, ranks: tuple[int, ...] = (0, 1)
) -> list[str]:
    """Every global sample index in [0, max_steps * global_batch) consumed by exactly one step
    of the final history, on the records of each of ``ranks``."""
    out = []
    for rank in ranks:
        counts = [0] * (max_steps * global_batch)
        for r in step_records(run_dir, rank):
            start, end = r["samples"]
            if end - start != global_batch or end > len(counts):
                out.append(f"rank {rank} step {r['step']}: samples [{start}, {end})")
                continue
            for i in range(start, end):
                counts[i] += 1
        repeated = sum(c > 1 for c in counts)
        skipped = sum(c == 0 for c in counts)
        if repeated or skipped:
            out.append(f"rank {rank}: {repeated} samples repeated, {skipped} skipped")
    return out


def checkpoint_problems(run_dir: Path) -> list[str]:
    """Every complete checkpoint's files verify (present, recorded sizes, every expert once)."""
    out = []
    for tag in complete_tags(run_dir / "checkpoints"):
        try:
            verify_files(run_dir / "checkpoints" / tag)
        except CheckpointError as e:
            out.append(f"{tag}: {e}")
    return out


# (kind, phase) of the campaign's faults, in turn.
FAULTS = [
    ("kill", "forward"),
    ("kill", "backward"),
    ("kill", "optimizer"),
    ("kill", "save"),
    ("kill", "eval"),
    ("term", "forward"),
    ("hang", "backward"),
    ("save_error", "save"),
]


def campaign_plan(fired_dir: Path, n: int, seed: int, eval_every: int, hang_s: float) -> dict:
    """``n`` faults, each kind in turn, at seeded random steps of a run of
    :func:`campaign_steps` steps (checkpoints every step), on a random rank. A fault in a save
    fails the step after it (the save is the step's last hook): no two faults fail the same
    step, so no failure looks like the one before (the launcher stops on a repeat)."""
    import random

    rng = random.Random(seed)
    last = campaign_steps(n)
    failing: set[int] = set()  # the step each fault makes the run fail in
    faults = []
    for i in range(n):
        kind, phase = FAULTS[i % len(FAULTS)]
        while True:
            step = rng.randrange(1, last + 1)
            fails_in = step + 1 if phase == "save" else step
            if phase == "eval" and step % eval_every and step != last:
                continue  # validation runs every eval_every steps and at the end
            if fails_in not in failing and not (phase == "save" and step == last):
                break
        failing.add(fails_in)
        faults.append(
            {
                "id": i,
                "kind": kind,
                "phase": phase,
                "step": step,
                "rank": rng.randrange(2),
                "seconds": hang_s * 20,
            }
        )
    return {"fired_dir": str(fired_dir), "faults": faults}


def campaign_steps(n: int) -> int:
    return n + n // 2 + 2


def campaign_figures(run_dir: Path, plan: dict) -> dict:
    """Faults injected (fired), recovered (restarts that led on to the next step), steps
    recomputed per fault (steps completed after the resumed checkpoint, lost) and the time from
    a fault to the first step completed after its restart."""
    fired = {
        int(p.name.split("_")[1]): float(p.read_text())
        for p in Path(plan["fired_dir"]).glob("fault_*")
    }
    records = restarts(run_dir)
    steps = {r["step"]: r["time"] for r in step_records(run_dir, 0)}
    recomputed = [
        r["step"] - 1 - int(Path(r["resume"]).name.split("_")[1]) if r["resume"] else r["step"] - 1
        for r in records
    ]
    recover = []
    for r in records:
        resumed = int(Path(r["resume"]).name.split("_")[1]) if r["resume"] else 0
        fault_time = max((t for t in fired.values() if t <= r["time"]), default=None)
        if fault_time is not None and resumed + 1 in steps:
            recover.append(steps[resumed + 1] - fault_time)
    return {
        "injected": len(fired),
        "restarts": len(records),
        "recomputed": recomputed,
        "recover_s": recover,
    }


CAMPAIGN_EVAL_EVERY, CAMPAIGN_HANG_S = 2, 6


def campaign_config(data, out_dir: Path, name: str, faults: int) -> Path:
    """The campaign's run: the tiny config, a checkpoint every step, validation every
    :data:`CAMPAIGN_EVAL_EVERY` steps, a short hang timeout, restarts enough for every fault."""
    from tests.conftest import tiny_run_dict

    d = tiny_run_dict(
        data, out_dir / "runs", max_steps=campaign_steps(faults), hang_timeout_s=CAMPAIGN_HANG_S
    )
    d.update(
        name=name,
        checkpoint={"every_n_steps": 1, "keep_last": 3},
        logging={"log_every": 1},
        eval={"every_n_steps": CAMPAIGN_EVAL_EVERY, "max_tokens": 256, "batch_size": 2},
        launch={"max_restarts": faults + 2},
    )
    return write_run_config(out_dir / f"{name}.yaml", d)


def campaign_problems(run_dir: Path, reference: Path, faults: int) -> list[str]:
    """Losses unlike the reference run's, samples not consumed exactly once, checkpoints that
    do not verify."""
    steps = campaign_steps(faults)
    return (
        loss_mismatches(run_dir, reference, steps)
        + sample_problems(run_dir, steps, global_batch=4)
        + checkpoint_problems(run_dir)
    )
