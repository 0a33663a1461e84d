"""Step time of the tiny default model with compiled blocks (``train.compile``) against eager.

configs/default.yaml's model (d 256, 4 layers, 8 SwiGLU experts of hidden 512, top-2,
dropless) with a 4096-token vocabulary, on one process: one micro-batch of 8 x 256 tokens, fp32,
a step is forward + backward + AdamW step. Both models start from the same weights and see the
same batches; after warm-up steps (the compiled model compiles in them, not timed) the two are
timed interleaved round by round, each round the mean of ``--steps`` steps. Reported: the median
and min-max spread over the rounds of each mode's step time and of compiled / eager in the same
round.

    PYTHONPATH=$PWD python benchmarks/compile_bench.py             # 5 rounds of 5 steps
    PYTHONPATH=$PWD python benchmarks/compile_bench.py --rounds 7 --threads 2
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from moe.config.run import load_config
from moe.model.compile import compile_blocks
from moe.model.transformer import MoETransformer


def build(compiled: bool, vocab: int) -> tuple[MoETransformer, torch.optim.Optimizer]:
    cfg = copy.deepcopy(load_config("configs/default.yaml").model)
    cfg.vocab_size = vocab
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    if compiled:
        compile_blocks(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(model, opt, batch_BS: torch.Tensor) -> None:
    out = model(batch_BS[:, :-1], batch_BS[:, 1:])
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per mode per round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
        for _ in range(args.warmup + args.steps)
    ]
    runs = {"eager": build(False, args.vocab), "compiled": build(True, args.vocab)}
    for name, (model, opt) in runs.items():
        t0 = time.perf_counter()
        for b in batches[: args.warmup]:
            step(model, opt, b)
        print(f"warm-up {name}: {time.perf_counter() - t0:.1f} s ({args.warmup} steps)")
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (model, opt) in runs.items():
            t0 = time.perf_counter()
            for b in batches[args.warmup :]:
                step(model, opt, b)
            times[name].append((time.perf_counter() - t0) / args.steps)
    ratios = [c / e for c, e in zip(times["compiled"], times["eager"])]
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), batch {args.batch} x {args.seq}, "
        f"{args.rounds} rounds of {args.steps} steps"
    )
    for name, ts in times.items():
        print(
            f"{name:>9}: {1e3 * statistics.median(ts):7.1f} ms/step "
            f"(min {1e3 * min(ts):.1f}, max {1e3 * max(ts):.1f})"
        )
    print(
        f"compiled / eager: {statistics.median(ratios):.3f} "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f})"
    )


if __name__ == "__main__":
    main()
