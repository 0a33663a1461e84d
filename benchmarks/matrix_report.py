"""The settings matrix's summary (benchmarks/gpu_speed_matrix.py): per model and setting, the
median tokens/s and MFU of its runs and the median and spread of its per-round ratios to that
round's default run; written as matrix.md and matrix.json, whole, after every run. Standard
library only."""

from __future__ import annotations

import json
from statistics import median

from profile_summary import replace_text


def spread(values: list[float]) -> dict:
    return (
        {"median": median(values), "min": min(values), "max": max(values)}
        if values
        else {"median": None, "min": None, "max": None}
    )


def summary_rows(matrix) -> list[dict]:
    """One row per model and setting that ran or was meant to (see the module docstring)."""
    device = (getattr(matrix.runner, "hello", None) or {}).get("device")
    rows = []
    for m in matrix.models:
        default = {
            r.round: r.row["tokens_per_s"]
            for r in matrix.runs
            if (r.setting, r.model) == ("default", m) and r.status == "ok"
        }
        for s in matrix.settings:
            runs = [r for r in matrix.runs if (r.setting, r.model) == (s.name, m)]
            if not runs and (s.name, m) not in matrix.skipped and s.name not in matrix.not_admitted:
                continue
            ok = [r for r in runs if r.status == "ok"]
            tok = spread([r.row["tokens_per_s"] for r in ok])
            ratios = spread(
                [r.row["tokens_per_s"] / default[r.round] for r in ok if default.get(r.round)]
            )
            mfus = [r.row["mfu"] for r in ok if r.row.get("mfu") is not None]
            peaks = [r.row["peak_mem"] for r in ok if r.row.get("peak_mem")]
            reserved = [r.row["peak_reserved"] for r in ok if r.row.get("peak_reserved")]
            plans = [r.row["planned_mem"] for r in ok if r.row.get("planned_mem")]
            note = matrix.skipped.get((s.name, m)) or (
                "not admitted: no time for its rounds" if s.name in matrix.not_admitted else ""
            )
            failed = [
                f"round {r.round}: {r.status} {r.reason}".strip() for r in runs if r.status != "ok"
            ]
            rows.append(
                {
                    "device": device,
                    "model": m,
                    "setting": s.name,
                    "overrides": list(s.overrides),
                    # a combination's overrides for some models only, as applied on this one
                    "applied": sorted({o for r in ok for o in r.row.get("applied", [])}),
                    "runs": len(ok),
                    "tokens_per_s": tok["median"],
                    "tokens_per_s_min": tok["min"],
                    "tokens_per_s_max": tok["max"],
                    "mfu": median(mfus) if mfus else None,
                    "ratio": ratios["median"],
                    "ratio_min": ratios["min"],
                    "ratio_max": ratios["max"],
                    "peak_mem": max(peaks) if peaks else None,
                    "peak_reserved": max(reserved) if reserved else None,  # graph pools too
                    "planned_mem": max(plans) if plans else None,  # moe-plan's total
                    "graphs_in_timed_steps": max(
                        (r.row.get("graphs_in_timed_steps", 0) for r in ok), default=None
                    ),
                    "note": "; ".join([note, *failed]).strip("; "),
                    "by_round": [
                        {
                            "round": r.round,
                            "status": r.status,
                            "tokens_per_s": r.row.get("tokens_per_s"),
                            "mfu": r.row.get("mfu"),
                            "wall_s": round(r.wall_s, 1),
                            # where the rest of the wall time went: engine set-up, warm-up
                            # steps (compiling, recording graphs)
                            **{
                                k: round(r.row[k], 2)
                                for k in ("build_s", "warmup_s")
                                if r.row.get(k) is not None
                            },
                        }
                        for r in runs
                    ],
                }
            )
    return rows


def fmt_rate(row: dict) -> str:
    if row["tokens_per_s"] is None:
        return "-"
    return (
        f"{row['tokens_per_s']:,.0f} ({row['tokens_per_s_min']:,.0f}-"
        f"{row['tokens_per_s_max']:,.0f})"
    )


def fmt_ratio(row: dict) -> str:
    if row["ratio"] is None:
        return "-"
    return f"{row['ratio']:.3f}x ({row['ratio_min']:.3f}-{row['ratio_max']:.3f})"


def render(matrix, args, hello: dict, elapsed: float, rows: list[dict], levers) -> str:
    lines = [
        f"# Settings matrix: {matrix.status}",
        "",
        f"device {hello.get('device', '?')}, torch {hello.get('torch', '?')}; "
        f"{elapsed:.0f} s of a {args.budget:.0f} s budget; {args.rounds} interleaved rounds "
        f"of {args.steps} timed steps after {args.warmup} warm-up; ratios: each round's run "
        "over that round's default run, median (min-max)",
        "",
        "| model | setting | runs | tokens/s, median (min-max) | MFU | vs default | "
        "peak GiB | reserved GiB | peak / moe-plan | note |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        peak = "-" if r["peak_mem"] is None else f"{r['peak_mem'] / 2**30:.1f}"
        held = "-" if r.get("peak_reserved") is None else f"{r['peak_reserved'] / 2**30:.1f}"
        vs_plan = (
            f"{r['peak_mem'] / r['planned_mem']:.2f}x"
            if r["peak_mem"] and r["planned_mem"]
            else "-"
        )
        flag = " **compiled in timed steps**" if r["graphs_in_timed_steps"] else ""
        note = " ".join(r["note"].split()).replace("|", "/")  # one table cell
        note = note if len(note) <= 160 else note[:159] + "…"
        lines.append(
            f"| {r['model']} | {r['setting']} | {r['runs']} | {fmt_rate(r)} | {mfu} | "
            f"{fmt_ratio(r)} | {peak} | {held} | {vs_plan} | {note}{flag} |"
        )
    best = best_settings(rows)
    if best:
        lines += [
            "",
            "Fastest per model: "
            + "; ".join(f"{m}: {r['setting']} ({fmt_ratio(r)})" for m, r in best.items())
            + (" (profiles in profile.md)" if matrix.profiles else ""),
        ]
    lines += ["", "Levers (benchmarks/gpu_speed_matrix.py, LEVERS):", ""]
    lines += [
        f"- {lv.name}: {' '.join(lv.overrides)}"
        + "".join(f"; on {', '.join(n)} models: {' '.join(o)}" for o, n in lv.where)
        + (f" (needs {', '.join(lv.needs)})" if lv.needs else "")
        + ("; also compiled" if lv.compiled else "")
        + (f"; {lv.note}" if lv.note else "")
        for lv in levers
    ]
    return "\n".join(lines) + "\n"


def best_settings(rows: list[dict]) -> dict[str, dict]:
    """Each model's fastest setting: the highest median ratio to the default (ratios are
    taken within a round, so they hold where the machine's speed drifts), then tokens/s."""
    best = {}
    for r in rows:
        if r["tokens_per_s"] is None:
            continue
        key = (r["ratio"] if r["ratio"] is not None else 0.0, r["tokens_per_s"])
        if r["model"] not in best or key > best[r["model"]][0]:
            best[r["model"]] = (key, r)
    return {m: r for m, (_, r) in best.items()}


def write_summary(out, matrix, args, hello: dict, elapsed: float, levers) -> None:
    rows = summary_rows(matrix)
    replace_text(out / "matrix.md", render(matrix, args, hello, elapsed, rows, levers))
    head = json.dumps(
        {
            "status": matrix.status,
            "device": hello.get("device"),
            "torch": hello.get("torch"),
            "budget_s": args.budget,
            "elapsed_s": round(elapsed, 1),
            "rounds": args.rounds,
            "steps": args.steps,
            "warmup": args.warmup,
            "models": matrix.models,
            "not_admitted": matrix.not_admitted,
        },
        default=str,
    )
    body = ",\n".join(json.dumps(r, default=str) for r in rows)  # one row per line
    replace_text(out / "matrix.json", f'{head[:-1]},\n"rows": [\n{body}\n]}}\n')
