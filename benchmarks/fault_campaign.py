"""Fault campaign: N seeded faults (default 100) in one 2-rank training job of the tiny config
with a checkpoint every step, each recovered by the launcher's automatic restart; then the
checks of tests/integration/test_fault_campaign.py and the figures: faults injected, recovered,
steps recomputed per fault, time from a fault to the first step completed after its restart,
samples repeated or skipped.

    python benchmarks/fault_campaign.py [--faults N] [--seed S] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data_pipeline.prepare import prepare
from tests.conftest import tiny_data_config, write_corpus
from tests.helpers import fault_runs as fr


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--faults", type=int, default=100)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", help="work directory (default: a temporary one)")
    args = p.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix="fault_campaign_"))
    write_corpus(root / "corpus")
    data = tiny_data_config(root)
    prepare(data, progress=False)
    steps = fr.campaign_steps(args.faults)

    t0 = time.time()
    ref = fr.launch(
        fr.campaign_config(data, root, "reference", args.faults), ["launch.max_restarts=0"]
    )
    ref_s = time.time() - t0
    if ref.returncode:
        sys.exit(f"reference run failed:\n{ref.stderr[-3000:]}")
    plan = fr.campaign_plan(
        root / "fired", args.faults, args.seed, fr.CAMPAIGN_EVAL_EVERY, fr.CAMPAIGN_HANG_S
    )
    t0 = time.time()
    proc = fr.launch(
        fr.campaign_config(data, root, "campaign", args.faults), plan=plan, timeout=24 * 3600
    )
    campaign_s = time.time() - t0
    run_dir = root / "runs" / "campaign"
    f = fr.campaign_figures(run_dir, plan)
    losses = fr.loss_mismatches(run_dir, root / "runs" / "reference", steps)
    samples = fr.sample_problems(run_dir, steps, global_batch=4)
    problems = losses + samples + fr.checkpoint_problems(run_dir)
    rec, rs = f["recomputed"], f["recover_s"]
    print(
        f"faults injected         {f['injected']} (plan {args.faults}, seed {args.seed}, "
        f"{steps} steps, checkpoint every step)"
    )
    print(f"recovered               {f['restarts']} restarts, job exit code {proc.returncode}")
    if rec:
        print(
            f"steps recomputed/fault  mean {statistics.mean(rec):.2f}, max {max(rec)} "
            f"(checkpoint interval 1)"
        )
    if rs:
        print(
            f"time to recover         median {statistics.median(rs):.1f}s, max {max(rs):.1f}s "
            f"(fault -> first step completed after the restart)"
        )
    print(
        f"samples                 {'every index consumed exactly once' if not samples else samples}"
    )
    print(f"losses equal reference  {'at every step, both ranks' if not losses else losses}")
    print(f"wall time               campaign {campaign_s:.0f}s, uninterrupted run {ref_s:.0f}s")
    for line in problems:
        print("PROBLEM", line)
    sys.exit(1 if problems or proc.returncode else 0)


if __name__ == "__main__":
    main()
