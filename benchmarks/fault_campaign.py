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
from tests.conftest import tiny_data_config, tiny_run_dict, write_corpus
from tests.helpers.fault_runs import (
    campaign_figures,
    campaign_plan,
    campaign_steps,
    checkpoint_problems,
    launch,
    loss_mismatches,
    sample_problems,
    write_run_config,
)

EVAL_EVERY, HANG_S = 2, 6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", type=int, default=100)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", help="work directory (default: a temporary one)")
    args = p.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix="fault_campaign_"))
    write_corpus(root / "corpus")
    data = tiny_data_config(root)
    prepare(data, progress=False)
    steps = campaign_steps(args.faults)

    def config(name: str) -> Path:
        d = tiny_run_dict(data, root / "runs", max_steps=steps, hang_timeout_s=HANG_S)
        d.update(name=name, checkpoint={"every_n_steps": 1, "keep_last": 3},
                 logging={"log_every": 1, "tensorboard": False},
                 eval={"every_n_steps": EVAL_EVERY, "max_tokens": 256, "batch_size": 2},
                 launch={"max_restarts": args.faults + 2})
        return write_run_config(root / f"{name}.yaml", d)

    t0 = time.time()
    ref = launch(config("reference"), ["launch.max_restarts=0"])
    ref_s = time.time() - t0
    if ref.returncode:
        sys.exit(f"reference run failed:\n{ref.stderr[-3000:]}")
    plan = campaign_plan(root / "fired", args.faults, args.seed, EVAL_EVERY, HANG_S)
    t0 = time.time()
    proc = launch(config("campaign"), plan=plan, timeout=24 * 3600)
    campaign_s = time.time() - t0
    run_dir = root / "runs" / "campaign"
    f = campaign_figures(run_dir, plan)
    problems = (loss_mismatches(run_dir, root / "runs" / "reference", steps)
                + sample_problems(run_dir, steps, global_batch=4) + checkpoint_problems(run_dir))
    rec, rs = f["recomputed"], f["recover_s"]
    print(f"faults injected         {f['injected']} (plan {args.faults}, seed {args.seed}, "
          f"{steps} steps, checkpoint every step)")
    print(f"recovered               {f['restarts']} restarts, job exit code {proc.returncode}")
    if rec:
        print(f"steps recomputed/fault  mean {statistics.mean(rec):.2f}, max {max(rec)} "
              f"(checkpoint interval 1)")
    if rs:
        print(f"time to recover         median {statistics.median(rs):.1f}s, max {max(rs):.1f}s "
              f"(fault -> first step completed after the restart)")
    print(f"samples repeated/skipped {sum('repeated' in p for p in problems)} problem lines "
          f"(0 means every sample exactly once)")
    print(f"losses equal reference  {not any('step' in p for p in problems)}")
    print(f"wall time               campaign {campaign_s:.0f}s, uninterrupted run {ref_s:.0f}s")
    for line in problems:
        print("PROBLEM", line)
    sys.exit(1 if problems or proc.returncode else 0)


if __name__ == "__main__":
    main()
