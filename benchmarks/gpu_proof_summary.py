"""The GPU proof's summary (benchmarks/gpu_proof.py): ``summary.md`` with the machine, one row
per part, the training benchmark and its step profiles, and ``summary.json`` with every part's
figures. Imports only the standard library, as the proof itself does."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return "[" + " ".join(map(str, v)) + "]" if v else "none"
    return str(v)


def machine_lines(env: dict) -> list[str]:
    """The GPU, driver and library versions the env part found (none when it did not run)."""
    if not env:
        return []
    return [
        f"- GPU: {env.get('gpu', 'none')} (capability {env.get('capability', '-')}, "
        f"{env.get('gpu_memory_gib', '-')} GiB, {env.get('gpus', 0)} visible)",
        f"- driver {env.get('driver')}; torch {env.get('torch')}, CUDA "
        f"{env.get('cuda')}, cuDNN "
        f"{env.get('cudnn')}, NCCL {env.get('nccl')}, triton {env.get('triton')}",
        f"- Python {env.get('python')}, DeepSpeed {env.get('deepspeed')} "
        f"(accelerator {env.get('deepspeed_accelerator')})",
        "",
    ]


def part_lines(parts: list) -> list[str]:
    """One row per part: status, wall and CPU seconds, log, figures (the note first)."""
    lines = [
        "| part | status | seconds | CPU s | log | figures |",
        "| --- | --- | ---: | ---: | --- | --- |",
    ]
    for p in parts:
        figs = {
            k: v
            for k, v in p.figures.items()
            if k not in ("rows", "eager_rows") and p.name != "env"
        }
        text = ", ".join(f"{k}={fmt(v)}" for k, v in figs.items())
        if p.note:
            text = f"**{p.note}**" + (f"; {text}" if text else "")
        lines.append(
            f"| {p.name} | {p.status} | {p.seconds:.1f} | {p.cpu_seconds:.1f} | {p.log} | {text} |"
        )
    return lines


def bench_lines(bench) -> list[str]:
    """The bench part's table: the device's defaults' and the plain settings' tokens/s, MFU,
    peak against planned memory."""
    if not (bench and bench.figures.get("rows")):
        return []
    lines = [
        "",
        f"Training benchmark on {bench.figures.get('device')} (tokens/s: the settings the "
        "device chooses; eager: the plain settings, benchmarks/plain_settings.py):",
        "",
        "| model | B x S | tokens/s | MFU | peak MiB | planned MiB | eager "
        "tokens/s | default / eager |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    eager = {r["model"]: r for r in bench.figures.get("eager_rows", [])}
    ratios = bench.figures.get("default_over_eager", {})
    for r in bench.figures["rows"]:
        mib = lambda b: "n/a" if b is None else f"{b / 2**20:,.0f}"
        mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
        c = eager.get(r["model"])
        ctext = (
            f"{c['tokens_per_s']:,.0f} | {ratios[r['model']]:.2f}x"
            if c and r["model"] in ratios
            else "n/a | n/a"
        )
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['tokens_per_s']:,.0f} | {mfu} | "
            f"{mib(r['peak_mem'])} | {mib(r['planned_mem'])} | {ctext} |"
        )
    chosen = bench.figures["rows"][0].get("device_settings")
    if chosen:
        lines += [
            "",
            "Settings the device chose: "
            + ", ".join(f"`{k}={json.dumps(v).strip(chr(34))}`" for k, v in chosen.items()),
        ]
    return lines


def profile_lines(out: Path) -> list[str]:
    """One line per step profile of the bench part (the whole of each in profile.md)."""
    try:
        entries = json.loads((out / "profile.json").read_text())["entries"]
    except (OSError, ValueError, KeyError):
        return []
    lines = [
        "",
        "Step profiles (profile.md has each one's regions and top kernels):",
        "",
        "| model | setting | step ms | device busy | kernels/step | host syncs/step |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for e in entries:
        syncs = "n/a" if e.get("syncs_per_step") is None else f"{e['syncs_per_step']:g}"
        lines.append(
            f"| {e.get('model')} | {e.get('setting')} | {e['step_ms']:.1f} | "
            f"{e['busy_share']:.0%} | {e['kernels_per_step']:g} | {syncs} |"
        )
    return lines


def write_summary(out: Path, args, parts: list, scratch: Path) -> bool:
    """Write summary.md and summary.json into ``out``, print the summary; True if every part
    passed."""
    ok = all(p.status == "pass" for p in parts)
    mode = ("dry run, " if args.dry_run else "") + f"device {args.device}"
    env = next((p.figures for p in parts if p.name == "env"), {})
    lines = [
        f"# GPU proof: {'PASS' if ok else 'FAIL'}",
        "",
        f"{mode}; budget {args.budget:.0f} s; "
        f"{sum(p.seconds for p in parts):.0f} s in all; scratch {scratch}",
        "",
    ]
    lines += machine_lines(env)
    lines += part_lines(parts)
    lines += bench_lines(next((p for p in parts if p.name == "bench"), None))
    lines += profile_lines(out)
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    summary = {
        "ok": ok,
        "dry_run": args.dry_run,
        "device": args.device,
        "budget_s": args.budget,
        "parts": [asdict(p) for p in parts],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print("\n" + text, flush=True)
    return ok
