"""How fast is the parametric fit of ``moe-scaling fit`` and ``predict``, against a baseline
revision of the project, on the same data, and are its constants the same?

For each data set, ``--repeats`` rounds of the baseline's ``fit_parametric`` then this tree's
(interleaved), each with ``--bootstrap`` resamples; prints the median time of each with its
spread (min-max), their ratio, and how far this tree's constants (log A, log B, log E, alpha,
beta) and Huber objective are from the baseline's, and both bootstrap intervals of alpha, beta
and E.

    python benchmarks/scaling_fit_bench.py --baseline 9bb9d5c --bootstrap 20 --repeats 3

The baseline is the file ``moe/tools/scaling.py`` (where the fits lived) or
``moe/tools/scaling_fit.py`` at that revision, read with ``git show``, run as shipped (BLAS with
as many threads as it takes); ``--baseline-one-thread`` runs it with BLAS on one thread too, to
separate that change from the search's.

Data sets: ``issue6``, the issue's fit (6 runs, 2 budgets x 3 sizes, the loss rising with N,
constants ending on their bounds); ``ladder15``, 3 budgets x 5 sizes around the optimum of a known
law with 0.3% noise; ``grid40``, 8 sizes x 5 token counts of that law with 1% noise."""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moe.tools import scaling_fit  # noqa: E402

TRUE = scaling_fit.Law(E=1.82, A=482.0, B=2085.0, alpha=0.348, beta=0.366)


def datasets() -> dict[str, tuple]:
    rng = np.random.default_rng(1)
    n6 = np.array([1.6e4, 2.3e4, 3.3e4] * 2)
    loss6 = np.array([4.9, 5.05, 5.3, 4.5, 4.6, 4.8]) * (1 + 0.01 * rng.standard_normal(6))
    budgets = np.repeat([1e18, 3e18, 1e19], 5)
    n15 = np.concatenate(
        [TRUE.optimum(b, 6.0)[0] * np.array([0.25, 0.5, 1, 2, 4]) for b in (1e18, 3e18, 1e19)]
    )
    d15 = budgets / (6.0 * n15)
    n40, d40 = (
        a.ravel() for a in np.meshgrid(np.geomspace(1e7, 1e10, 8), np.geomspace(1e9, 1e12, 5))
    )
    return {
        "issue6": (n6, np.repeat([3e10, 1e11], 3) / (8 * n6), loss6),
        "ladder15": (n15, d15, TRUE.loss(n15, d15) * (1 + 0.003 * rng.standard_normal(15))),
        "grid40": (n40, d40, TRUE.loss(n40, d40) * (1 + 0.01 * rng.standard_normal(40))),
    }


def baseline_module(rev: str):
    """The fits of revision ``rev``, imported from its source as module ``baseline_fits``."""
    for path in ("moe/tools/scaling_fit.py", "moe/tools/scaling.py"):
        out = subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True
        )
        if out.returncode == 0 and "def fit_parametric" in out.stdout:
            break
    else:
        raise SystemExit(f"{rev}: no fit_parametric in moe/tools/scaling_fit.py or scaling.py")
    src = Path(tempfile.mkdtemp()) / "baseline_fits.py"
    src.write_text(out.stdout)
    spec = importlib.util.spec_from_file_location("baseline_fits", src)
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_fits"] = module
    spec.loader.exec_module(module)
    return module


def params(law) -> np.ndarray:
    return np.array([np.log(law.A), np.log(law.B), np.log(law.E), law.alpha, law.beta])


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--baseline", default="main", help="git revision of the baseline")
    p.add_argument("--bootstrap", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--data", default="issue6,ladder15,grid40")
    p.add_argument("--baseline-one-thread", action="store_true")
    args = p.parse_args()
    base = baseline_module(args.baseline)
    from threadpoolctl import threadpool_limits

    limit = (lambda: threadpool_limits(limits=1)) if args.baseline_one_thread else nullcontext
    print(
        f"baseline {args.baseline}{' (BLAS on one thread)' if args.baseline_one_thread else ''}"
        f", {args.bootstrap} bootstrap resamples, {args.repeats} interleaved rounds"
    )
    print(
        "| data | runs | baseline s, median (min-max) | this tree s, median (min-max) | "
        "speed-up | max abs diff of the constants | objective this / baseline |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    notes = []
    for name in args.data.split(","):
        n, d, loss = datasets()[name]
        times = {"baseline": [], "new": []}
        for _ in range(args.repeats):
            with limit():
                t = time.perf_counter()
                old = base.fit_parametric(n, d, loss, bootstrap=args.bootstrap)
                times["baseline"].append(time.perf_counter() - t)
            t = time.perf_counter()
            new = scaling_fit.fit_parametric(n, d, loss, bootstrap=args.bootstrap)
            times["new"].append(time.perf_counter() - t)
        med = {k: statistics.median(v) for k, v in times.items()}
        logs = np.log(n), np.log(d), np.log(loss)
        obj = [scaling_fit._objective(params(f.law), *logs)[0] for f in (old, new)]
        diff = np.abs(params(old.law) - params(new.law)).max()
        print(
            f"| {name} | {len(n)} | {med['baseline']:.2f} ({min(times['baseline']):.2f}-"
            f"{max(times['baseline']):.2f}) | {med['new']:.2f} ({min(times['new']):.2f}-"
            f"{max(times['new']):.2f}) | {med['baseline'] / med['new']:.1f}x | {diff:.2e} | "
            f"{obj[1] / obj[0]:.9f} |"
        )
        for const in ("alpha", "beta", "E"):
            lo = [f.interval(lambda b, c=const: getattr(b, c)) for f in (old, new)]
            notes.append(
                f"{name} {const} 95%: baseline {lo[0][0]:.4f}-{lo[0][1]:.4f}, "
                f"this tree {lo[1][0]:.4f}-{lo[1][1]:.4f}"
            )
    print("\n" + "\n".join(notes))


if __name__ == "__main__":
    main()
