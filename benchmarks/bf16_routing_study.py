"""How far apart do the expert choices of two trained tiny models drift, and what causes it?

Trains the tiny test config (2 layers, 4 experts, top-2, 2 ranks, expert parallelism 2, ZeRO 2)
for 30 steps under several variants and, for each seed, prints the fraction of (token, k) slots
of a fixed batch (the first 64 validation windows) whose expert the reference model also picks:

- ``bf16``: trained in bf16 against trained in fp32, the same initial weights (each evaluated in
  the precision it trained in);
- ``bf16_same_start``: the same, both starting from weights rounded to bf16 once, so that the
  two forwards of step 1 see identical weights;
- ``fp32_rounded_start``: fp32 training from the initial weights rounded to bf16 once against
  fp32 training from the unrounded ones: no bf16 arithmetic at all;
- ``fp32_rel<r>``: fp32 training from the initial weights each multiplied by ``1 + r * u``,
  ``u`` uniform in [-1, 1] (bf16 rounding is a relative error of at most 2^-9 = 1.95e-3);
- ``bf16_router_bug``: bf16 training with the router computing its logits in bf16, a deliberate
  bug, to see which check notices it;
- ``same_weights``: no second training: the fp32-trained weights run in bf16 against in fp32,
  with the router correct and with the bug.

    python benchmarks/bf16_routing_study.py [--seeds 42,1,2,3,4] [--variants bf16,...]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data_pipeline.prepare import prepare
from tests.conftest import tiny_data_config, tiny_run_dict, write_corpus
from tests.helpers.distributed import run_distributed

STEPS = 30
ROWS = 64
VARIANTS = [
    "bf16",
    "bf16_same_start",
    "fp32_rounded_start",
    "fp32_rel1e-5",
    "fp32_rel1e-4",
    "fp32_rel1e-3",
    "bf16_router_bug",
    "same_weights",
]


def _perturb_initial_weights(how: str) -> None:
    """Make every MoETransformer built in this process start from perturbed weights."""
    from moe.model import transformer

    build = transformer.MoETransformer.__init__

    def init(self, *args, **kwargs):
        build(self, *args, **kwargs)
        gen = torch.Generator().manual_seed(123)  # the same on every rank
        with torch.no_grad():
            for p in self.parameters():
                if how == "bf16":
                    p.copy_(p.bfloat16().float())
                else:
                    p.mul_(1 + float(how) * (2 * torch.rand(p.shape, generator=gen) - 1))

    transformer.MoETransformer.__init__ = init


def _router_in_bf16() -> None:
    from moe.model import router

    router.at_least_fp32 = lambda t: t


def _train_worker(rank, world, cfg_dicts, start, bug):
    from moe.config.run import RunConfig
    from moe.core.config_schema import from_dict
    from moe.training.trainer import DistEnv, train

    if start:
        _perturb_initial_weights(start)
    if bug:
        _router_in_bf16()
    for cfg_dict in cfg_dicts:
        train(from_dict(RunConfig, copy.deepcopy(cfg_dict)), DistEnv(rank, world, rank, world))


def _routing(model, ids):
    from moe.model.router import TopKRouter

    picked = []
    hooks = [
        m.register_forward_hook(lambda mod, a, out: picked.append(out.indices_TK))
        for m in model.modules()
        if isinstance(m, TopKRouter)
    ]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return picked


def _agreement(a, b):
    same = sum((x[:, :, None] == y[:, None, :]).any(-1).sum().item() for x, y in zip(a, b))
    return same / sum(x.numel() for x in a)


def _fixed_batch(data):
    from data_pipeline.token_stream import validation_windows

    windows = list(validation_windows(data.dir, data.seq_len, ROWS * (data.seq_len + 1)))
    return torch.stack([w for w, _ in windows[:ROWS]])[:, :-1]


# variant -> (run name, precision, start perturbation, router bug) of the run compared, and the
# reference it is compared with
TRAINED = {
    "bf16": (("bf16", "bf16", None, False), "fp32"),
    "bf16_same_start": (("bf16_rounded", "bf16", "bf16", False), "fp32_rounded"),
    "fp32_rounded_start": (("fp32_rounded", "fp32", "bf16", False), "fp32"),
    "bf16_router_bug": (("bf16_router_bug", "bf16", None, True), "fp32"),
}


def _runs(variants: list[str]) -> dict[str, tuple]:
    """The trainings the variants compare, by name: (name, precision, start, router bug)."""
    runs = {"fp32": ("fp32", "fp32", None, False)}
    for v in variants:
        if v in TRAINED:
            run, ref = TRAINED[v]
            runs[run[0]] = run
            if ref == "fp32_rounded":
                runs[ref] = TRAINED["fp32_rounded_start"][0]
        elif v.startswith("fp32_rel"):
            runs[v] = (v, "fp32", v[len("fp32_rel") :], False)
    return runs


def _train(runs: dict[str, tuple], seeds: list[int], data, root: Path) -> None:
    """Every run for every seed, into ``root/runs/NAME_SEED``."""
    for name, precision, start, bug in runs.values():
        todo = []
        for seed in seeds:
            d = tiny_run_dict(data, root / "runs", max_steps=STEPS, precision=precision, seed=seed)
            d["name"] = f"{name}_{seed}"
            d["logging"] = {"log_every": 10, "tensorboard": False}
            d["checkpoint"] = {"every_n_steps": STEPS}
            todo.append(d)
        # one start of the ranks per variant: a perturbation patches the process
        run_distributed(_train_worker, 2, todo, start, bug)


def _variant_rows(v: str, seeds: list[int], root: Path, ids) -> list[tuple]:
    """Per seed, the agreement of variant ``v`` with its reference (``same_weights``: with the
    router correct and with the bug)."""
    from moe.evaluation.evaluate import load_model
    from moe.model import router

    def run_dir(name, seed):
        return root / "runs" / f"{name}_{seed}"

    def picks(name, seed, bf16=False):
        model, _, _ = load_model(run_dir(name, seed))
        return _routing(model.bfloat16() if bf16 else model, ids)

    rows = []
    for seed in seeds:
        if v == "same_weights":
            model, _, _ = load_model(run_dir("fp32", seed))
            ref = _routing(model, ids)
            correct = _agreement(ref, _routing(copy.deepcopy(model).bfloat16(), ids))
            saved = router.at_least_fp32
            router.at_least_fp32 = lambda t: t
            try:
                buggy = _agreement(ref, _routing(copy.deepcopy(model).bfloat16(), ids))
            finally:
                router.at_least_fp32 = saved
            rows.append((correct, buggy))
            continue
        if v.startswith("fp32_rel"):
            name, ref, bf16 = v, "fp32", False
        else:
            (name, precision, _, _), ref = TRAINED[v]
            bf16 = precision == "bf16"
        rows.append((_agreement(picks(ref, seed), picks(name, seed, bf16)),))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="42,1,2,3,4")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"--variants: unknown variant {v!r}; choose from {', '.join(VARIANTS)}")

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = tiny_data_config(root)
        write_corpus(root / "corpus")
        prepare(data, progress=False)
        ids = _fixed_batch(data)
        _train(_runs(variants), seeds, data, root)
        print(
            f"expert slots agreeing after {STEPS} steps, {ROWS} x {data.seq_len} tokens, "
            f"top-2 of 4 experts, 2 MoE layers; seeds {args.seeds}"
        )
        for v in variants:
            cols = list(zip(*_variant_rows(v, seeds, root, ids)))
            labels = ["router correct", "router in bf16"] if v == "same_weights" else [""]
            for label, col in zip(labels, cols):
                per_seed = " ".join(f"{x:.4f}" for x in col)
                print(
                    f"{v:20s} {label:15s} min {min(col):.4f} median {statistics.median(col):.4f}"
                    f"  [{per_seed}]",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
