"""The report of a scaling sweep's analysis (``moe/tools/scaling_report.py``): the console
summary, the prediction for a budget as text, and report.md with one PNG
(``moe/tools/scaling_plot.py``). A number the runs do not support is printed with what is wrong
with it (a constant on the optimiser's bound, a minimum outside its ladder, a multiplier that is
only a lower bound); losses also in bits per byte where the bytes per token are known."""

from __future__ import annotations

import math
from pathlib import Path

from moe.core.fileio import write_atomic
from moe.tools import scaling_envelope, scaling_fit


def prediction_text(p: dict) -> str:
    lo, hi = p["n_interval"]
    dlo, dhi = p["d_interval"]
    llo, lhi = p["loss_interval"]
    lines = [
        f"{p['family']} at {p['budget']:.3g} FLOPs:",
        f"  active parameters N  {p['n_opt']:.4g}  (95%: {lo:.4g} to {hi:.4g})",
        f"  tokens D             {p['d_opt']:.4g}  (95%: {dlo:.4g} to {dhi:.4g})",
        f"  tokens per parameter {p['d_opt'] / p['n_opt'] if p['n_opt'] else math.inf:.1f}"
        + (
            f"  (95%: {p['ratio_interval'][0]:.1f} to {p['ratio_interval'][1]:.1f})"
            if "ratio_interval" in p and math.isfinite(p["ratio_interval"][0])
            else ""
        ),
        f"  predicted loss       {p['loss']:.4f}  (95%: {llo:.4f} to {lhi:.4f})",
    ]
    bpt = p.get("bytes_per_token")
    if bpt:
        lines.append(
            f"  in bits per byte     {bits_per_byte(p['loss'], bpt):.4f}  (95%: "
            f"{bits_per_byte(llo, bpt):.4f} to {bits_per_byte(lhi, bpt):.4f})"
        )
    if p.get("on_bounds"):
        lines.append(
            "  degenerate law       "
            + ", ".join(
                f"{name} on its {side} bound {bound:.4g}" for name, side, bound in p["on_bounds"]
            )
            + ": the runs do not determine the law, so neither these numbers nor their "
            "intervals (see the warnings)"
        )
    iso = p.get("isoflop")
    if iso:
        left = (
            f"; left out: {', '.join(f'{b:.3g}' for b in iso['left_out'])}, whose minima "
            "lie outside their ladders"
            if iso["left_out"]
            else ""
        )
        lines.append(
            f"  IsoFLOP route        N {iso['n_opt']:.4g}, {iso['n_opt'] / p['n_opt']:.2f}x the "
            f"law's (the power law through the minima of {iso['budgets']} budgets{left})"
        )
        if "exponent_interval" in iso:
            (lo, hi), (rlo, rhi) = iso["exponent_interval"], iso["ratio_interval"]
            lines.append(
                f"                       exponent of N_opt 95%: {lo:.3f} to {hi:.3f}; "
                f"tokens per parameter {iso['ratio']:.1f} (95%: {rlo:.1f} to {rhi:.1f})"
            )
        else:
            lines.append(f"                       tokens per parameter {iso['ratio']:.1f}")
    else:
        lines.append(
            "  IsoFLOP route        none: fewer than 2 budgets have a minimum inside their ladder"
        )
    bt = p.get("backtest")
    if bt:
        lines.append(
            f"  backtest             the law fitted below {bt['budget']:.3g} misses that "
            f"budget's runs by {bt['median_abs']:.1%} (median; {min(bt['errors']):+.1%} "
            f"to {max(bt['errors']):+.1%})"
        )
    if "width" in p:
        lines.append(f"  best ladder width    {p['width']}")
    if p.get("experts"):
        lines.append(f"  experts              {p['experts']}")
    return "\n".join(lines)


def _minimum_line(m, mult, bound: bool, bpt: float | None = None) -> str:
    lo, hi = m.n_range
    if m.bracketed:
        text = (
            f"  C {m.budget:.3g}: N_opt {m.n_opt:.4g}, loss {m.loss_opt:.4f}"
            f"{_bits(m.loss_opt, bpt)}"
        )
    else:
        text = (
            f"  C {m.budget:.3g}: no minimum inside the ladder (N {lo:.4g} to {hi:.4g}): "
            f"{m.problem()}; lowest run N {m.lowest_n:.4g}, loss {m.lowest_loss:.4f}"
            f"{_bits(m.lowest_loss, bpt)}; left out of the power laws"
        )
    if mult is not None:
        text += f", compute multiplier vs dense {'at least ' if bound else ''}{mult:.2f}x"
    return text


def _interval_text(fit: scaling_fit.ParametricFit, name: str) -> str:
    """``lo-hi`` of a constant over the bootstrap fits, each end that sits on the optimiser's
    bound marked."""
    i = scaling_fit.PARAMS.index(name)
    lo, hi = fit.interval(lambda b: getattr(b, name))
    bounds = scaling_fit.BOUNDS[i]
    ends = []
    for value, bound in ((lo, bounds[0]), (hi, bounds[1])):
        v = math.log(value) if name in "ABE" and value > 0 else value
        mark = " (its bound)" if abs(v - bound) <= scaling_fit.BOUND_TOLERANCE else ""
        ends.append(f"{value:.3f}{mark}")
    return "-".join(ends)


def _route_lines(fam: dict, inside: int) -> list[str]:
    """The IsoFLOP route's power laws, with the 95% intervals of their exponents and of the
    tokens per parameter at the sweep's largest bracketed budget when bootstrapped."""
    (a, b), (ad, bd) = fam["n_law"], fam["d_law"]
    boot = fam.get("route_boot")
    top = max(m.budget for m in fam["minima"] if m.bracketed)
    ratio = top / (fam["k"] * (a * top**b) ** 2)
    if boot is None:
        return [
            f"  N_opt = {a:.3g} C^{b:.3f}, D_opt = {ad:.3g} C^{bd:.3f}  (through the minima "
            f"of {inside} budgets); at C {top:.3g}: N_opt {a * top**b:.4g}, D/N {ratio:.1f}"
        ]
    lo, hi = boot.exponent_interval()
    rlo, rhi = boot.ratio_interval(top)
    nlo, nhi = boot.n_interval(top)
    left = (
        f"; {boot.failed} of {boot.resamples} resamples placed fewer than 2 minima inside "
        "their ladders and are left out"
        if boot.failed
        else ""
    )
    return [
        f"  N_opt = {a:.3g} C^{b:.3f} (95%: {lo:.3f} to {hi:.3f}), D_opt = {ad:.3g} "
        f"C^{bd:.3f} (95%: {1 - hi:.3f} to {1 - lo:.3f})  (through the minima of {inside} "
        "budgets)",
        f"  at C {top:.3g}: N_opt {a * top**b:.4g} (95%: {nlo:.4g} to {nhi:.4g}), D/N "
        f"{ratio:.1f} (95%: {rlo:.1f} to {rhi:.1f})  (bootstrap of the parabolas' "
        f"residuals{left})",
    ]


def _envelope_line(env: scaling_envelope.Envelope, outside: tuple | None = None) -> str:
    """Chinchilla's first approach: the power laws through the envelope's points off the edge,
    or why there are none; ``outside``: the IsoFLOP route's interval its N_opt lies outside."""
    edge = int(env.edge.sum())
    where = f"; {scaling_envelope.edge_text(env)}, left out" if edge else ""
    if env.n_law is None:
        return f"  envelope of the training curves: no power law ({env.problem})"
    (a, b), (ad, bd) = env.n_law, env.d_law
    top = float(env.c[env.inside].max())  # the largest C the laws were fitted through
    n_top = a * top**b
    return (
        f"  envelope of the training curves: N_opt = {a:.3g} C^{b:.3f}, D_opt = {ad:.3g} "
        f"C^{bd:.3f}; at C {top:.3g}: N {n_top:.4g}, D/N {ad * top**bd / n_top:.1f} "
        f"(through {len(env.c) - edge} points, {len(set(env.n[env.inside]))} sizes{where})"
        + (
            f"; outside the IsoFLOP route's 95% interval ({outside[0]:.4g} to "
            f"{outside[1]:.4g}): take the route's (see the warnings)"
            if outside
            else ""
        )
    )


def bits_per_byte(loss: float, bytes_per_token: float | None) -> float | None:
    """A loss in nats per token as bits per byte of the text: comparable across tokenizers."""
    return loss / LN2 / bytes_per_token if bytes_per_token else None


LN2 = math.log(2)


def _bits(loss: float, bytes_per_token: float | None) -> str:
    bits = bits_per_byte(loss, bytes_per_token)
    return f" ({bits:.4f} bits/byte)" if bits is not None else ""


def _bits_cell(loss: float, bytes_per_token: float | None) -> str:
    bits = bits_per_byte(loss, bytes_per_token)
    return "-" if bits is None else f"{bits:.4f}"


def _law_lines(fit: scaling_fit.ParametricFit, shared: bool, bpt: float | None) -> list[str]:
    law, flags = fit.law, fit.on_bounds()
    lines = [
        f"  L = {law.E:.3f} + {law.A:.4g}/N^{law.alpha:.3f} + {law.B:.4g}/D^{law.beta:.3f}"
        + (
            f"  (alpha 95%: {_interval_text(fit, 'alpha')}, beta: {_interval_text(fit, 'beta')})"
            if fit.boot
            else ""
        )
        + ("  (E shared by the families)" if shared else "")
        + (f"; E = {bits_per_byte(law.E, bpt):.4f} bits/byte" if bpt else "")
    ]
    if flags:
        lines.append(
            "  degenerate: "
            + ", ".join(f"{name} on its {side} bound ({bound:.4g})" for name, side, bound in flags)
            + " (see the warnings for what to add)"
        )
    return lines


def _family_lines(family: str, fam: dict, shared: bool, bpt: float | None) -> list[str]:
    inside = sum(m.bracketed for m in fam["minima"])
    lines = [
        f"{family}: {len(fam['runs'])} runs, {len(fam['minima'])} budgets with a "
        f"parabola, {inside} with a minimum inside the ladder"
    ]
    for m in fam["minima"]:
        lines.append(
            _minimum_line(
                m,
                fam.get("multiplier", {}).get(m.budget),
                m.budget in fam.get("multiplier_bound", ()),
                bpt,
            )
        )
    if "n_law" in fam:
        lines.extend(_route_lines(fam, inside))
    if fam.get("envelope") is not None:
        lines.append(_envelope_line(fam["envelope"], fam.get("envelope_outside")))
    if "fit" in fam:
        lines.extend(_law_lines(fam["fit"], shared, bpt))
    bt = fam.get("backtest")
    if bt:
        lines.append(
            f"  backtest: fitted below {bt['budget']:.3g} ({bt['fitted_runs']} runs), "
            f"the law's error on that budget's {len(bt['errors'])} runs (measured / "
            f"law - 1): median |e| {bt['median_abs']:.2%}, "
            + ", ".join(f"{n} {e:+.2%}" for n, e in zip(bt["runs"], bt["errors"]))
        )
    if "expert_law" in fam:
        e = fam["expert_law"]
        lines.append(
            f"  log L = {e['a']:.4f} log N + {e['b']:.4f} log E + {e['c']:.5f} "
            f"log N log E + {e['d']:.3f}  (Clark et al. 2022)"
        )
    return lines


def summary(analysis: dict) -> str:
    """The fits, family by family; losses in nats per token, and in bits per byte where the
    analysis knows the validation text's bytes per token."""
    bpt = analysis.get("bytes_per_token")
    lines = (
        [
            f"losses: nats per token of the validation text; bits per byte = nats / ln 2 / "
            f"{bpt:.4f} (its UTF-8 bytes per predicted token)"
        ]
        if bpt
        else []
    )
    shared = (
        analysis.get("floor") == "shared"
        and sum("fit" in fam for fam in analysis["families"].values()) >= 2
    )
    for family, fam in analysis["families"].items():
        lines.extend(_family_lines(family, fam, shared, bpt))
    return "\n".join(lines)


def write_report(analysis: dict, out_dir: Path) -> dict[str, Path]:
    """report.md (tables, fits, warnings) and scaling.png (``scaling_plot.draw``)."""
    from moe.tools import scaling_plot

    out_dir.mkdir(parents=True, exist_ok=True)
    plot = scaling_plot.draw(analysis, out_dir / "scaling.png")
    md = ["# Scaling sweep", "", "## Fits", "", "```", summary(analysis), "```", ""]
    if analysis["warnings"]:
        md += ["## Warnings", ""] + [f"- {w}" for w in analysis["warnings"]] + [""]
    bpt = analysis.get("bytes_per_token")
    md += [
        "## Runs",
        "",
        "| run | family | budget | N | tokens | loss (nats/token) | bits/byte |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    md += [
        f"| {r['name']} | {r['family']} | {r['budget']:.3g} | {r['active_params']:,} "
        f"| {r['tokens']:,} | {r['loss']:.4f} | {_bits_cell(r['loss'], bpt)} |"
        for r in analysis["results"]
    ]
    md += ["", "![scaling](scaling.png)", ""]
    markdown = out_dir / "report.md"
    write_atomic(markdown, "\n".join(md))
    return {"markdown": markdown, "plot": plot}
