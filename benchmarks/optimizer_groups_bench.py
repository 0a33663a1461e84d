"""Optimizer-group layout benchmark (not a test): training-step time of the default config's
model (2 ranks, expert parallelism 2, ZeRO 2, gloo on CPU) with DeepSpeed's own MoE parameter
groups (all expert tensors of an expert group in one optimizer group) against ours (one group
per expert tensor, which is what lets DeepSpeed's zero_to_fp32 rebuild the experts). Interleaved
rounds in one run; prints the median step time of each and the ratio ours / DeepSpeed's.

    python benchmarks/optimizer_groups_bench.py [--rounds 3] [--steps 16]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tests.helpers.distributed import run_distributed  # noqa: E402


def _deepspeed_groups(model, weight_decay):
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    decay, no_decay = [], []
    for _, p in model.named_parameters():
        (no_decay if p.ndim < 2 else decay).append(p)
    return split_params_into_different_moe_groups_for_optimizer(
        [
            {"params": decay, "weight_decay": weight_decay, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
        ]
    )


def _worker(rank, world, variant, steps, out):
    import moe.training.trainer as trainer
    from moe.config.run import load_config

    if variant == "deepspeed":
        trainer.optimizer_param_groups = _deepspeed_groups
    cfg = load_config(ROOT / "configs" / "default.yaml")
    cfg.model.vocab_size = 4096
    torch.set_num_threads(1)
    engine, _ = trainer.build_engine(cfg, trainer.DistEnv(rank, world, rank, world))
    x = torch.randint(
        0,
        4096,
        (cfg.train.micro_batch_size, cfg.data.seq_len + 1),
        generator=torch.Generator().manual_seed(rank),
    )
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logp = engine(x[:, :-1]).logits.float().log_softmax(-1)
        engine.backward(-logp.gather(-1, x[:, 1:, None]).mean())
        engine.step()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(
            json.dumps({"groups": len(engine.optimizer.optimizer.param_groups), "times": times[2:]})
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    medians: dict[str, list[float]] = {"deepspeed": [], "ours": []}
    groups = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for variant in medians:
                out = Path(tmp) / f"{variant}.json"
                run_distributed(_worker, 2, variant, args.steps, str(out))
                r = json.loads(out.read_text())
                t = sorted(r["times"])
                medians[variant].append(t[len(t) // 2])
                groups[variant] = r["groups"]
    print(
        json.dumps(
            {
                "optimizer_groups": groups,
                "median_step_s": {k: [round(v, 4) for v in vs] for k, vs in medians.items()},
                "ratio_ours_to_deepspeed_per_round": [
                    round(a / b, 3) for a, b in zip(medians["ours"], medians["deepspeed"])
                ],
                "ratio_of_best": round(min(medians["ours"]) / min(medians["deepspeed"]), 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
