"""Finished runs of a scaling sweep as the report reads them (moe/tools/scaling_report.py)."""


def dense_runs(points, budget: float = 3e9) -> list[dict]:
    """Dense runs of one ``budget``, one per (width, active parameters, final loss) of
    ``points``."""
    return [
        {
            "name": f"w{w}",
            "family": "dense",
            "budget": budget,
            "active_params": n,
            "tokens": budget / (6 * n),
            "flops": budget,
            "width": w,
            "experts": 0,
            "loss": loss,
        }
        for w, n, loss in points
    ]
