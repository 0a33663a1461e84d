"""Is the default config's training step slower than it was? The step time of
``configs/default.yaml`` (2 ranks through ``moe-launch``, as users run it) with this checkout's
code against another commit's, in alternating rounds. Each side trains on its own tree's
config (a key one release adds the other refuses); the keys in which they differ are printed.

    flock /tmp/moe-integration.lock python benchmarks/cpu_step_ab.py --base main
    python benchmarks/cpu_step_ab.py --base HEAD~3 --rounds 5 --steps 60
    python benchmarks/cpu_step_ab.py --ranges --rounds 5 --steps 20   # one process, no launcher

The other commit's files (``git archive``) go into a temporary folder, removed afterwards. Each run trains ``--steps`` steps of the same config on the same prepared
data (this checkout's ``data/stdlib``, prepared first if missing) from scratch, logging every
step; its figure is the median of the step log's tokens/s after ``--skip`` steps. Rounds
alternate the order (base then this, this then base, ...), and each round's ratio is this
checkout's median over the base's: the result is the median of those ratios and their spread
(lower than 1: this checkout is slower). The runs use the launcher's fixed port: one at a time
on a machine (``flock``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

from moe.core.run_dir import RunDir

ROOT = Path(__file__).resolve().parents[1]


def config_differences(base: Path, this: Path) -> list[str]:
    """The keys whose values differ between two trees' configs/default.yaml (each side trains
    on its own, since a key one release adds the other refuses): what besides the code differs
    between the two sides' steps."""
    import yaml

    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    a, b = (
        flat(yaml.safe_load((t / "configs" / "default.yaml").read_text())) for t in (base, this)
    )
    return [
        f"{k}: {a.get(k, '(absent)')} -> {b.get(k, '(absent)')}"
        for k in sorted(a.keys() | b.keys())
        if a.get(k) != b.get(k)
    ]


def run_steps(tree: Path, runs: Path, name: str, steps: int, extra: list[str]) -> list[float]:
    """Tokens/s of each logged step of one training run of ``tree``'s code."""
    cmd = [
        sys.executable,
        "-m",
        "launch.launch",
        str(tree / "configs" / "default.yaml"),  # its own: config keys come and go
        f"name={name}",
        f"output_dir={runs}",
        f"data.dir={ROOT / 'data' / 'stdlib'}",
        f"train.max_steps={steps}",
        "logging.log_every=1",
        "checkpoint.every_n_steps=100000",
        *extra,
        "--no-eval",
    ]
    env = {**os.environ, "PYTHONPATH": str(tree)}  # the launcher passes it on to the ranks
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    history = json.loads(RunDir(str(runs / name)).summary.read_text())["history"]
    return [h["tokens_per_s"] for h in history]


def ranges_ab(rounds: int, steps: int) -> dict:
    """In one process, one rank: configs/default.yaml's model (fp32, one micro-batch of 8 x 256,
    AdamW) with the model's profiler ranges as they are, against the same steps with each
    range site calling a bare no-op instead (what the step costs without them). Each round
    times ``steps`` steps of each, one step at a time, alternating; its ratio is the median
    of the pairs' ratios. No launcher: it needs no lock."""
    import contextlib
    import time

    import torch

    from moe.config.run import load_config
    from moe.model import block, moe_layer, transformer
    from moe.model.transformer import MoETransformer

    torch.set_num_threads(1)
    cfg = load_config(ROOT / "configs" / "default.yaml")
    cfg.model.vocab_size = cfg.data.tokenizer.vocab_size
    torch.manual_seed(0)
    model = MoETransformer(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    B, S, V = cfg.train.micro_batch_size, cfg.data.seq_len, cfg.model.vocab_size
    shipped = {m: m.region for m in (block, moe_layer, transformer)}
    off = contextlib.nullcontext()
    bare = lambda name: off

    def timed(use_ranges: bool) -> float:
        for m, f in shipped.items():
            m.region = f if use_ranges else bare
        x = torch.randint(0, V, (B, S + 1))
        t0 = time.perf_counter()
        model(x[:, :-1], x[:, 1:]).loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    timed(True)  # warm-up
    times = {"ranges": [], "none": []}
    ratios = []
    try:
        for r in range(rounds):
            pairs = []
            for i in range(steps):
                order = ("ranges", "none") if (r + i) % 2 == 0 else ("none", "ranges")
                t = {side: timed(side == "ranges") for side in order}
                pairs.append(t["ranges"] / t["none"])
                for side in order:
                    times[side].append(t[side])
            ratios.append(median(pairs))
            print(f"round {r + 1}: ranges / none {ratios[-1]:.4f}", flush=True)
    finally:
        for m, f in shipped.items():
            m.region = f
    print(
        f"step time with ranges / without: {median(ratios):.4f} (min {min(ratios):.4f}, max "
        f"{max(ratios):.4f}); {median(times['none']) * 1000:,.0f} ms per step without"
    )
    per_call = range_call_ns()
    print(
        "one range site with no profiler: "
        + ", ".join(f"{k} {v:,.0f} ns" for k, v in per_call.items())
    )
    return {"step_s": times, "ratios": ratios, "ratio": median(ratios), "call_ns": per_call}


def range_call_ns(n: int = 200_000) -> dict[str, float]:
    """What one ``with`` range site costs with no profiler running (best of 5 loops of ``n``):
    the model's gated ``region``, a bare ``record_function``, and an empty loop."""
    import time

    from torch.profiler import record_function

    from moe.model.regions import region

    def empty():
        pass

    def gated():
        with region("attention"):
            pass

    def bare():
        with record_function("attention"):
            pass

    out = {}
    for name, fn in (("empty loop", empty), ("region()", gated), ("record_function", bare)):
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter() - t0) / n)
        out[name] = best * 1e9
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", help="the commit to compare with (e.g. main)")
    p.add_argument(
        "--ranges",
        action="store_true",
        help="instead: the model's profiler ranges on and off in one process",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40, help="steps per run")
    p.add_argument("--skip", type=int, default=10, help="first steps left out (warm-up)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config overrides for both sides",
    )
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    if args.ranges:
        result = ranges_ab(args.rounds, args.steps)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
        return result
    if not args.base:
        p.error("give --base COMMIT (or --ranges)")
    if args.skip >= args.steps:
        p.error("--skip must be smaller than --steps")
    if not (ROOT / "data" / "stdlib" / "manifest.json").exists():
        subprocess.run(
            [sys.executable, "-m", "launch.prepare", "configs/default.yaml"], cwd=ROOT, check=True
        )
    tmp = Path(tempfile.mkdtemp(prefix="cpu_step_ab_"))
    base = tmp / "base"
    base.mkdir()
    tar = subprocess.run(
        ["git", "archive", "--format=tar", args.base], cwd=ROOT, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(base)], input=tar, check=True)
    for line in config_differences(base, ROOT):
        print(f"configs/default.yaml differs: {line}", flush=True)
    sides = {"base": base, "this": ROOT}
    medians: dict[str, list[float]] = {"base": [], "this": []}
    try:
        for r in range(args.rounds):
            for side in ("base", "this") if r % 2 == 0 else ("this", "base"):
                rates = run_steps(
                    sides[side], tmp / "runs", f"ab-{side}-{r}", args.steps, args.overrides
                )
                medians[side].append(median(rates[args.skip :]))
                print(
                    f"round {r + 1} {side:>4}: {medians[side][-1]:,.0f} tokens/s "
                    f"(median of steps {args.skip + 1}-{len(rates)})",
                    flush=True,
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ratios = [t / b for t, b in zip(medians["this"], medians["base"])]
    result = {
        "base": args.base,
        "rounds": args.rounds,
        "steps": args.steps,
        "skip": args.skip,
        "tokens_per_s": medians,
        "ratios": ratios,
        "ratio": median(ratios),
        "step_time_ratio": 1 / median(ratios),
    }
    print(
        f"this / base tokens/s: {median(ratios):.3f} (min {min(ratios):.3f}, max "
        f"{max(ratios):.3f}); step time this / base {1 / median(ratios):.3f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
