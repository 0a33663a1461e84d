"""Part (b) of benchmarks/finetune_bench.py: the routed experts' LoRA path, grouped (one
grouped matmul over every expert's adapters) against a loop over experts, forward and backward,
in interleaved rounds. finetune_bench.py runs it and prints the ratio."""

from __future__ import annotations

import time

import torch

from moe.model.experts import grouped_mm, uses_grouped_kernel


def expert_lora_path(args, T: int) -> dict:
    E, K, D, H, r = args.experts, args.top_k, args.d_model, args.expert_hidden, args.expert_rank
    gen = torch.Generator().manual_seed(0)
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    # Routed copies sorted by expert, with the imbalance of a random top-k routing.
    counts = torch.bincount(
        torch.rand(T, E, generator=gen).topk(K, dim=1).indices.flatten(), minlength=E
    )
    counts_host = counts.tolist()
    N = sum(counts_host)
    x_in = torch.randn(N, D, generator=gen).to(dev, dtype)  # the experts' input rows
    x_out = torch.randn(N, H, generator=gen).to(dev, dtype)  # the activations w_out reads
    factors = {
        "in": (
            torch.randn(E, D, r, generator=gen) * D**-0.5,
            torch.randn(E, r, 2 * H, generator=gen) * 0.01,
        ),
        "out": (
            torch.randn(E, H, r, generator=gen) * H**-0.5,
            torch.randn(E, r, D, generator=gen) * 0.01,
        ),
    }
    factors = {
        k: tuple(t.to(dev, dtype).requires_grad_(True) for t in ab) for k, ab in factors.items()
    }
    counts = counts.to(dev)
    # The gradient that reaches each projection's output from above: given, so that what is
    # timed is the LoRA branch alone (a loss over the (N, 2H) and (N, D) outputs would be
    # common to both contenders and, on the CPU, cost more than the branch itself).
    upstream = {
        "in": torch.randn(N, 2 * H, generator=gen).to(dev, dtype),
        "out": torch.randn(N, D, generator=gen).to(dev, dtype),
    }
    if not all(uses_grouped_kernel(x_in, t) for ab in factors.values() for t in ab):
        raise SystemExit(
            f"(b): torch._grouped_mm does not take {args.dtype} on {args.device} "
            "with these shapes (on CUDA it takes bfloat16 only; every dimension "
            "must be a multiple of 16 bytes), so there is no grouped pass to time"
        )

    def grouped(x, a, b):
        return grouped_mm(grouped_mm(x, a, counts, counts_host), b, counts, counts_host)

    def loop(x, a, b):
        return torch.cat([(xe @ a[e]) @ b[e] for e, xe in enumerate(x.split(counts_host))])

    def run(fn):
        xs = {k: v.detach().requires_grad_(True) for k, v in (("in", x_in), ("out", x_out))}
        synchronize(dev)
        t0 = time.perf_counter()
        ys = [fn(xs[k], *factors[k]) for k in ("in", "out")]
        torch.autograd.backward(ys, [upstream["in"], upstream["out"]])
        synchronize(dev)
        return time.perf_counter() - t0, ys

    _, want = run(loop)
    _, got = run(grouped)
    tol = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-3}
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **({"rtol": 1e-4, "atol": 1e-5} | tol))
    times = {"grouped": [], "loop": []}
    for i in range(args.rounds):
        for name in ("grouped", "loop") if i % 2 == 0 else ("loop", "grouped"):
            times[name].append(
                min(run(grouped if name == "grouped" else loop)[0] for _ in range(args.iters))
            )
    ratios = [lo / g for lo, g in zip(times["loop"], times["grouped"])]
    return {"rows": N, "times": times, "ratios": ratios}


def synchronize(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
