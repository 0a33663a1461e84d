"""Step time and saved-activation memory of each activation-recompute mode against ``none``.

The model is configs/moe-125m.yaml's, shrunk to fit a CPU step: 4 of its 12 layers and a
4096-token vocabulary instead of 32000 (the head would otherwise be most of the step); width
768, 12 heads, 16 SwiGLU experts of hidden 432, top-3, one shared expert, z-loss and RoPE as in
the preset; one
micro-batch of 2 x 256 tokens (the preset: 8 x 2048), fp32. A step is forward + backward, no
optimizer. Modes are timed interleaved round by round; the median of the rounds and the
min-max spread are reported, with each mode's ratio to ``none`` in the same round.

Saved-activation bytes: every storage autograd saves in the forward or a checkpointed region
holds as its input, each once (moe.model.recompute.saved_activation_bytes), weights excluded.

    python benchmarks/recompute_bench.py               # 5 rounds
    python benchmarks/recompute_bench.py --rounds 7 --layers 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moe.config.run import load_config
from moe.model.recompute import apply_recompute, saved_activation_bytes
from moe.model.transformer import MoETransformer
from moe.training.cpu_allocator import keep_freed_memory

MODES = {
    "none": ("none", 1),
    "selective": ("selective", 1),
    "full": ("full", 1),
    "full, every 2nd block": ("full", 2),
}


def build(layers: int, vocab: int, seq: int) -> MoETransformer:
    cfg = load_config("configs/moe-125m.yaml").model
    cfg.n_layers, cfg.vocab_size, cfg.max_seq_len = layers, vocab, seq
    torch.manual_seed(0)
    return MoETransformer(cfg)


def step(model, batch_BS) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = model(batch_BS[:, :-1], batch_BS[:, 1:]).loss
    loss.backward()
    return loss.detach()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    args = ap.parse_args()
    if args.rounds < 3:
        ap.error("--rounds: at least 3")
    keep_freed_memory()  # as moe-train runs on CPU
    model = build(args.layers, args.vocab, args.seq)
    g = torch.Generator().manual_seed(1)
    batch_BS = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)

    saved, losses = {}, {}
    for name, (mode, every) in MODES.items():
        apply_recompute(model, mode, every)
        step(model, batch_BS)  # warm-up
        model.zero_grad(set_to_none=True)
        with saved_activation_bytes(exclude=model) as s:
            loss = model(batch_BS[:, :-1], batch_BS[:, 1:]).loss
        loss.backward()
        saved[name], losses[name] = s["bytes"], loss.detach()
    assert all(torch.equal(v, losses["none"]) for v in losses.values()), losses

    times = {name: [] for name in MODES}
    for _ in range(args.rounds):
        for name, (mode, every) in MODES.items():
            apply_recompute(model, mode, every)
            t0 = time.perf_counter()
            step(model, batch_BS)
            times[name].append(time.perf_counter() - t0)

    print(
        f"moe-125m shrunk: {args.layers} layers, vocab {args.vocab}, {args.batch} x {args.seq} "
        f"tokens, fp32, {torch.get_num_threads()} threads, {args.rounds} rounds"
    )
    print(
        "| mode | step time (median) | time / none (median, min-max) | saved activations | "
        "saved / none |"
    )
    print("| --- | --- | --- | --- | --- |")
    for name in MODES:
        ratios = [t / n for t, n in zip(times[name], times["none"])]
        print(
            f"| {name} | {statistics.median(times[name]) * 1e3:.0f} ms | "
            f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | "
            f"{saved[name] / 2**20:.1f} MiB | {saved[name] / saved['none']:.2f}x |"
        )


if __name__ == "__main__":
    main()
