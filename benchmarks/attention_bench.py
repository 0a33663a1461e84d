"""Time of the attention back ends (model.attention_backend) against the reference, on packed
sequences with several documents each.

Every back end is timed in the same process, interleaved round by round; the median ratio to the
reference over the rounds is reported with its spread (min-max), so the ratios hold even when
the machine's absolute speed drifts.

    python benchmarks/attention_bench.py                 # S = 256, 1024, 4096; 5 rounds
    python benchmarks/attention_bench.py --seq 1024 --rounds 9

Contenders (fp32, CPU unless CUDA is present; one CausalSelfAttention, GQA 8 query / 2 kv heads
of dim 64, batch 2, rotary positions, about 6 documents per row of random lengths):
  reference  explicit (B, 1, S, S) document mask into SDPA
  sdpa       one causal SDPA call per document
  flex       flex_attention (compiled) with a document BlockMask; forward + backward on CUDA,
             forward only (inference) on CPU, where flex has no backward: its row is then
             timed against the reference's forward only, also without gradients
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moe.model.attention import CausalSelfAttention, build_attention_inputs
from moe.model.positions import RotaryEmbedding, positions_from_doc_ids

BACKENDS = ("reference", "sdpa", "flex")


def packed_doc_ids(batch: int, S: int, docs: int, gen: torch.Generator) -> torch.Tensor:
    """(batch, S) ids, ``docs`` documents per row with random boundaries."""
    rows = []
    for _ in range(batch):
        cuts = torch.randperm(S - 1, generator=gen)[: docs - 1] + 1
        starts = torch.zeros(S, dtype=torch.long)
        starts[cuts] = 1
        rows.append(starts.cumsum(0))
    return torch.stack(rows)


def step(
    attn: CausalSelfAttention, x: torch.Tensor, backend: str, rope, pos, doc, train: bool
) -> None:
    with torch.set_grad_enabled(train):
        inputs = build_attention_inputs(backend, rope, pos, doc, batch=x.shape[0])
        assert inputs.backend == backend, f"{backend} fell back to {inputs.backend}"
        y = attn(x, inputs)
        if train:
            y.square().mean().backward()


def timed(fn, reps: int, sync) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps


def bench(S: int, rounds: int, device: torch.device, batch: int, docs: int) -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(S)
    attn = CausalSelfAttention(512, 8, 2).to(device)
    rope = RotaryEmbedding(64).to(device)
    x = torch.randn(batch, S, 512, device=device, requires_grad=True)
    doc = packed_doc_ids(batch, S, docs, gen).to(device)
    pos = positions_from_doc_ids(doc)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    flex_train = device.type != "cpu"
    # (label, back end, with gradients); on CPU flex is compared with the reference's forward.
    runs = (
        [("reference", "reference", True), ("sdpa", "sdpa", True), ("flex", "flex", True)]
        if flex_train
        else [
            ("reference", "reference", True),
            ("sdpa", "sdpa", True),
            ("reference fwd", "reference", False),
            ("flex fwd", "flex", False),
        ]
    )
    fns = {
        label: (lambda b=backend, t=train: step(attn, x, b, rope, pos, doc, t))
        for label, backend, train in runs
    }
    t0 = time.perf_counter()
    for fn in fns.values():  # warm-up, and flex's compile
        fn()
        fn()
    warm_s = time.perf_counter() - t0
    reps = max(1, 2048 // S)
    times: dict[str, list[float]] = {label: [] for label in fns}
    for _ in range(rounds):
        for label, fn in fns.items():
            times[label].append(timed(fn, reps, sync))
    print(
        f"S={S}  batch {batch}  {docs} documents per row  {rounds} rounds x {reps} reps  "
        f"(warm-up incl. compile {warm_s:.1f} s)"
    )
    for label in fns:
        base = "reference fwd" if label.endswith("fwd") else "reference"
        ratios = [t / b for t, b in zip(times[label], times[base])]
        print(
            f"  {label:14s} {statistics.median(times[label]) * 1e3:9.2f} ms  "
            f"x{statistics.median(ratios):.2f} of {base} "
            f"(min {min(ratios):.2f}, max {max(ratios):.2f})"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--docs", type=int, default=6)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads, fp32")
    for S in args.seq:
        bench(S, args.rounds, device, args.batch, args.docs)


if __name__ == "__main__":
    main()
