"""The evaluation report: a JSON file with every number, a Markdown page with PNG plots (expert
load per layer, loss curves from the run's TensorBoard events), and a console summary table.

Everything is written to a staging directory first and then moved into place file by file, so
an interrupted evaluation never leaves a half-written file behind.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

REPORT_JSON = "eval.json"
REPORT_MD = "report.md"
LOSS_PLOT = "loss_curves.png"
TENSORBOARD_DIR = "tensorboard"


def read_scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series under a TensorBoard log directory, read with TensorBoard's own
    reader. Steps written twice (a run resumed from an earlier checkpoint) keep the last value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not tb_dir.is_dir():
        return {}
    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags().get("scalars", []):
        by_step = {e.step: e.value for e in acc.Scalars(tag)}
        out[tag] = sorted(by_step.items())
    return out


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_expert_load(layers: list[dict], path: Path, title: str) -> None:
    """Heatmap of layers x experts: each expert's share of its layer's kept token copies,
    relative to the balanced share (1.0 = balanced)."""
    plt = _pyplot()
    rel = [[f * len(layer["load_fraction"]) for f in layer["load_fraction"]] for layer in layers]
    E = len(rel[0])
    fig, ax = plt.subplots(figsize=(1.6 + 0.7 * E, 1.4 + 0.6 * len(rel)), dpi=110)
    im = ax.imshow(rel, cmap="viridis", aspect="auto", vmin=0)
    for i, row in enumerate(rel):
        for e, v in enumerate(row):
            ax.text(
                e,
                i,
                f"{v:.2f}",
                ha="center",
                va="center",
                fontsize=8,
                color="white" if v < 0.6 * max(max(r) for r in rel) else "black",
            )
    ax.set_xticks(range(E))
    ax.set_yticks(range(len(rel)), [f"block {layer['block']}" for layer in layers])
    ax.set_xlabel("expert")
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, label="load / balanced load")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_loss_curves(
    runs: dict[str, dict[str, list]], eval_points: dict[str, list], path: Path
) -> bool:
    """Training losses per run (left), auxiliary losses (right), and the evaluated checkpoints'
    losses as points. Returns False (and writes nothing) if there is nothing to plot."""
    main_tags = [t for t in ("train/loss", "train/lm_loss") if any(t in s for s in runs.values())]
    extra = sorted(
        {
            t
            for s in runs.values()
            for t in s
            if "loss" in t and t.split("/")[0] in ("valid", "val", "eval")
        }
    )
    aux_tags = sorted(
        {
            t
            for s in runs.values()
            for t in s
            if t.startswith("train/") and ("aux" in t or "z_loss" in t)
        }
    )
    if not (main_tags or extra or any(eval_points.values())):
        return False
    plt = _pyplot()
    fig, axes = plt.subplots(
        1, 2 if aux_tags else 1, figsize=(11 if aux_tags else 6.5, 4), dpi=110, squeeze=False
    )
    ax = axes[0][0]
    many = len(runs) > 1
    for run, series in runs.items():
        label = f"{Path(run).name}: " if many else ""
        for tag in main_tags + extra:
            if tag in series:
                steps, values = zip(*series[tag])
                ax.plot(steps, values, label=label + tag, lw=1.2)
    for run, points in eval_points.items():
        if points:
            steps, values = zip(*points)
            ax.plot(
                steps,
                values,
                "o",
                color="black",
                ms=5,
                label=(f"{Path(run).name}: " if many else "") + "moe-eval loss",
            )
    ax.set_xlabel("step")
    ax.set_ylabel("nats / token")
    ax.set_title("loss", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if aux_tags:
        ax2 = axes[0][1]
        for run, series in runs.items():
            for tag in aux_tags:
                if tag in series:
                    steps, values = zip(*series[tag])
                    ax2.plot(
                        steps, values, label=(f"{Path(run).name}: " if many else "") + tag, lw=1.2
                    )
        ax2.set_xlabel("step")
        ax2.set_title("router losses (weighted)", fontsize=10)
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _task_columns(checkpoints: list[dict]) -> list[tuple[str, str, str]]:
    """(task, metric, filter) of every downstream result, in first-seen order."""
    cols = {}
    for c in checkpoints:
        for r in c.get("downstream") or []:
            cols.setdefault((r["task"], r["metric"], r["filter"]), None)
    return list(cols)


def _task_cell(c: dict, col: tuple[str, str, str]) -> str:
    for r in c.get("downstream") or []:
        if (r["task"], r["metric"], r["filter"]) == col:
            err = f" ± {r['stderr']:.4f}" if r["stderr"] is not None else ""
            return f"{r['value']:.4f}{err}"
    return "-"


def _task_header(col: tuple[str, str, str]) -> str:
    task, metric, filt = col
    return f"{task} {metric}" + ("" if filt == "none" else f" ({filt})")


def tasks_table(checkpoints: list[dict]) -> list[list[str]]:
    """Rows (header first) of the downstream results: one per checkpoint, one column per task
    and metric, each value with the harness's standard error."""
    cols = _task_columns(checkpoints)
    rows = [["checkpoint", "step"] + [_task_header(c) for c in cols]]
    for c in checkpoints:
        rows.append(
            [c.get("label", c["tag"]), "-" if c["step"] is None else str(c["step"])]
            + [_task_cell(c, col) for col in cols]
        )
    return rows


def _aligned(rows: list) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths)))
        for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary_table(checkpoints: list[dict]) -> str:
    """The console table: one row per checkpoint (downstream results: one column per task and
    metric)."""
    if not any("loss" in c for c in checkpoints):
        return _aligned(tasks_table(checkpoints))
    rows = [
        (
            "checkpoint",
            "step",
            "tokens",
            "loss",
            "perplexity",
            "max/mean load",
            "dropped",
            "router entropy",
        )
    ]
    for c in checkpoints:
        layers = c.get("experts") or []
        worst = max((layer["max_over_mean_load"] for layer in layers), default=float("nan"))
        dropped = sum(layer["dropped_fraction"] for layer in layers) / max(len(layers), 1)
        entropy = sum(layer["router_entropy"] for layer in layers) / max(len(layers), 1)
        rows.append(
            (
                c.get("label", c["tag"]),
                "-" if c["step"] is None else str(c["step"]),
                f"{c['tokens']:,}",
                f"{c['loss']:.4f}",
                f"{c['perplexity']:.2f}",
                f"{worst:.2f}" if layers else "-",
                f"{dropped:.2%}" if layers else "-",
                f"{entropy:.3f}" if layers else "-",
            )
        )
    return _aligned(rows)


def _md_table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += [
        "| " + " | ".join(str(v).replace("|", "\\|").replace("\n", " ") for v in r) + " |"
        for r in rows
    ]
    return out


def _piece(text: str) -> str:
    """Inline code; newlines and control characters (an untrained model's byte pieces) escaped.
    SentencePiece's word-start mark U+2581 stays visible."""
    shown = "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)
    return "`" + shown.replace("`", "'") + "`"


def downstream_report(cps: list[dict]) -> list[str]:
    """The Markdown section of moe-eval --tasks: every checkpoint's results and settings."""
    settings = cps[-1]["settings"]
    md = [
        "# Downstream evaluation",
        "",
        "lm-evaluation-harness tasks; each value with the harness's standard error. "
        f"Few-shot examples: {settings['num_fewshot'] if settings['num_fewshot'] is not None else 'task default'}; "
        f"examples per task: {settings['limit'] or 'all'}; batch size {settings['batch_size']}; "
        f"weights in {settings['dtype']}.",
        "",
    ]
    rows = tasks_table(cps)
    md += _md_table(rows[0], rows[1:])
    md += ["", "| checkpoint | seconds |", "|---|---|"]
    md += [f"| `{c['checkpoint']}` | {c['seconds']} |" for c in cps]
    return md + [""]


def markdown_report(results: dict, plots: dict[str, str], loss_plot: str | None) -> str:
    cps = results["checkpoints"]
    if not any("loss" in c for c in cps):
        return "\n".join(downstream_report(cps))
    md = [
        "# Evaluation report",
        "",
        f"Data: {results['data']}. Loss is the token-weighted mean next-token cross-entropy "
        "in nats; perplexity is its exponential.",
        "",
    ]
    md += _md_table(
        ["checkpoint", "step", "tokens", "loss", "perplexity", "seconds"],
        [
            [
                c["label"],
                c["step"],
                f"{c['tokens']:,}",
                f"{c['loss']:.4f}",
                f"{c['perplexity']:.2f}",
                c["seconds"],
            ]
            for c in cps
        ],
    )
    md += [
        "",
        f"A uniform guess over the vocabulary of {cps[-1]['vocab_size']:,} would score "
        f"{cps[-1]['uniform_loss']:.4f} nats/token.",
        "",
    ]
    if loss_plot:
        md += [
            "## Loss curves",
            "",
            "From the run's TensorBoard events; black points are the losses measured here.",
            "",
            f"![loss curves]({loss_plot})",
            "",
        ]
    else:
        md += ["## Loss curves", "", "No TensorBoard scalars found under the run directory.", ""]
    for c in cps:
        md += _checkpoint_section(c, plots.get(c["label"]))
    return "\n".join(md) + "\n"


def _checkpoint_section(c: dict, plot: str | None) -> list[str]:
    md = [
        f"## {c['label']}",
        "",
        f"`{c['checkpoint']}`: evaluated in batches of {c['batch_size']} "
        f"sequences of {c['seq_len']} tokens; capacity factor "
        f"{c['capacity_factor'] if c['capacity_factor'] is not None else 'none (dropless)'}.",
        "",
    ]
    layers = c.get("experts") or []
    if layers:
        md += _experts_section(layers, plot)
    if layers and "over_represented" in layers[0]:
        md += _specialisation_section(layers)
    md += _generations_section(c.get("generations") or [])
    return md


def _experts_section(layers: list[dict], plot: str | None) -> list[str]:
    """Per block load balance and router entropy, then each expert's preferred tokens."""
    md = [
        "### Experts",
        "",
        "Load = token copies an expert computed (after the capacity limit); max/mean and the "
        "coefficient of variation measure imbalance (1.0 and 0 are perfectly balanced). "
        "Router entropy is the mean entropy of the routing distribution over experts "
        "(uniform: ln E).",
        "",
    ]
    md += _md_table(
        ["block", "max/mean load", "load CV", "dropped", "router entropy", "uniform entropy"],
        [
            [
                layer["block"],
                f"{layer['max_over_mean_load']:.3f}",
                f"{layer['load_cv']:.3f}",
                f"{layer['dropped_fraction']:.2%}",
                f"{layer['router_entropy']:.3f}",
                f"{layer['router_entropy_uniform']:.3f}",
            ]
            for layer in layers
        ],
    )
    if plot:
        md += ["", f"![expert load]({plot})"]
    md += [
        "",
        "### Tokens each expert prefers",
        "",
        "Per expert, the input tokens that chose it most often, as the share of the token's "
        "occurrences routed to it (indifference would be K/E = "
        f"{layers[0]['routed_copies'] / layers[0]['tokens'] / len(layers[0]['load_fraction']):.3f}); "
        "shown as `piece` share (occurrences).",
        "",
    ]
    for layer in layers:
        md += [f"Block {layer['block']}:", ""]
        md += _md_table(
            ["expert", "preferred tokens"],
            [
                [
                    e,
                    ", ".join(f"{_piece(t['piece'])} {t['share']:.2f} ({t['count']})" for t in toks)
                    or "-",
                ]
                for e, toks in enumerate(layer["top_tokens"])
            ],
        )
        md.append("")
    return md


def _specialisation_section(layers: list[dict]) -> list[str]:
    """Per expert, the tokens over-represented among its routed tokens and its token diversity."""
    md = [
        "### Expert specialisation",
        "",
        "Per expert, the tokens most over-represented among its routed tokens: lift = the "
        "token's share of the expert's tokens / its share of the data (1.0: no preference), "
        "shown as `piece` lift; and the effective number of distinct tokens it sees, "
        "exp(entropy), against the data's own (smaller: a more concentrated expert).",
        "",
    ]
    for layer in layers:
        md += [
            f"Block {layer['block']} (data: {layer['data_effective_tokens']:.1f} effective "
            "tokens):",
            "",
        ]
        md += _md_table(
            ["expert", "effective tokens", "over-represented tokens"],
            [
                [
                    e,
                    f"{eff:.1f}",
                    ", ".join(f"{_piece(t['piece'])} {t['lift']:.1f}" for t in toks) or "-",
                ]
                for e, (eff, toks) in enumerate(
                    zip(layer["effective_tokens"], layer["over_represented"])
                )
            ],
        )
        md.append("")
    return md


def _generations_section(gens: list[dict]) -> list[str]:
    """The sampled continuations of each generation strategy (none: no section)."""
    if not gens:
        return []
    md = ["### Generations", ""]
    for g in gens:
        md += [f"**{g['strategy']}** ({g['settings']}), prompt: {_piece(g['prompt_text'])}", ""]
        for o in g["outputs"]:
            md += [f"- {_piece(o['text'])} (log-prob {o['logprob']:.2f})"]
        if g.get("reference_text") is not None:
            md += [f"- reference continuation: {_piece(g['reference_text'])}"]
        md.append("")
    return md


def _finite(obj):
    """JSON has no NaN or infinity: write them as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_report(results: dict, out_dir: str | Path) -> dict[str, str]:
    """Write eval.json, report.md and the plots into ``out_dir``; returns their paths."""
    out_dir = Path(out_dir)
    staging = out_dir.parent / f".{out_dir.name}.staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        runs = {
            run: read_scalars(Path(run) / TENSORBOARD_DIR)
            for run in dict.fromkeys(c["run_dir"] for c in results["checkpoints"])
        }
        plots = {}
        for c in results["checkpoints"]:
            # Checkpoints of several runs may share a tag: name them by run too.
            c["label"] = c["tag"] if len(runs) == 1 else f"{Path(c['run_dir']).name}-{c['tag']}"
            if c.get("experts"):
                name = f"expert_load_{c['label']}.png"
                plot_expert_load(
                    c["experts"], staging / name, f"{c['label']}: expert load / balanced load"
                )
                plots[c["label"]] = name
        eval_points = {
            run: [
                (c["step"], c["loss"])
                for c in results["checkpoints"]
                if c["run_dir"] == run and c["step"] is not None and "loss" in c
            ]
            for run in runs
        }
        loss_plot = (
            LOSS_PLOT
            if any("loss" in c for c in results["checkpoints"])
            and plot_loss_curves(runs, eval_points, staging / LOSS_PLOT)
            else None
        )
        results["loss_curves"] = {
            run: {
                tag: series
                for tag, series in scalars.items()
                if tag.startswith(("train/", "valid/", "val/", "eval/"))
            }
            for run, scalars in runs.items()
        }
        files = {
            "json": str(out_dir / REPORT_JSON),
            "report": str(out_dir / REPORT_MD),
            "plots": [str(out_dir / p) for p in [*plots.values(), loss_plot] if p],
        }
        results["files"] = files
        (staging / REPORT_MD).write_text(
            markdown_report(results, plots, loss_plot), encoding="utf-8"
        )
        (staging / REPORT_JSON).write_text(json.dumps(_finite(results), indent=2), encoding="utf-8")
        out_dir.mkdir(parents=True, exist_ok=True)
        # The JSON goes last: its presence means the report next to it is complete.
        names = sorted(p.name for p in staging.iterdir() if p.name != REPORT_JSON) + [REPORT_JSON]
        for name in names:
            os.replace(staging / name, out_dir / name)
        # The plots of the report just replaced that this one does not have.
        for old in [*out_dir.glob("expert_load_*.png"), out_dir / LOSS_PLOT]:
            if old.name not in names:
                old.unlink(missing_ok=True)
    except OSError as e:
        if e.filename is None:  # a buffered write (a plot's) names no file
            e.filename = str(out_dir)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return files
