"""A profile that travels: a few dozen lines per model and setting, read from a torch.profiler
Chrome trace of a few training steps (``benchmarks/gpu_train_bench.py --profile-out DIR``).

What one summary holds: the step time split into device-busy time (the union of every kernel,
copy and fill on any stream) and idle time (the timed step less the busy time: the device
waited for the host, i.e. the step is launch- or host-bound); kernels and copies launched per
step; host synchronisations per step (counted by the bench under
``torch.cuda.set_sync_debug_mode``, with the source lines that made them); time per region;
and the top kernels by device time, grouped by region.

How a kernel finds its region, first rule that applies:

1. communication: the kernel or an operator around its launch is a collective (NCCL, gloo);
   the launch is found by the kernel's correlation id (its runtime call, then the ranges open
   on that thread at that time), else by its External id (the operator that launched it);
2. a named range around its launch, innermost first (moe/model/regions.py, and the bench's
   ``optimizer`` and ``bench.backward``), see ``RANGE_REGIONS``;
3. a backward operator: the region of the forward operator with its autograd sequence number;
4. the kernel's name (compiled code has no ranges: inductor drops them), ``NAME_RULES``;
5. for a matrix product, the shapes of the operator that launched it against the model's
   widths (the vocabulary is the head, the experts' count the router, ...), ``gemm_region``;
6. otherwise ``other``.

The summary states how much kernel time each rule attributed. On the CPU there are no kernels:
each operator stands in for one with its self time (its time less the operators inside it),
and the busy time is the union of the outermost operators, as a share of the profiled step
(operator times carry the profiler's own cost): the rest is Python and framework overhead
between operators.

Only the standard library: the settings matrix renders summaries without importing torch.
"""

from __future__ import annotations

import json
import os
import re
from bisect import bisect_right
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

REGIONS = (
    "attention",
    "expert GEMMs",
    "dense FFN & shared",
    "permute & combine",
    "router",
    "norms & elementwise",
    "head & loss",
    "optimizer",
    "communication",
    "other",
)
RANGE_REGIONS = {
    "attention": "attention",
    "moe.experts": "expert GEMMs",
    "ffn": "dense FFN & shared",
    "moe.dispatch": "permute & combine",
    "moe.combine": "permute & combine",
    "moe.router": "router",
    "norm": "norms & elementwise",
    "block": "norms & elementwise",
    "head": "head & loss",
    "embedding": "other",
    "optimizer": "optimizer",
    "bench.backward": "optimizer",  # the bench's: step, grad hooks
    "bench.step_read": "other",  # the bench's: the trainer's read of the step's figures
}
"""Range name -> region: every range of moe/model/regions.py (tests check) and the bench's."""
COMMUNICATION = re.compile(
    r"nccl|c10d::|gloo|all_?reduce|all_?gather|reduce_?scatter|"
    r"all_?to_?all|broadcast",
    re.I,
)
GEMM = "gemm"
NAME_RULES = [
    ("expert GEMMs", r"grouped_?mm|GroupProblemShape|grouped_?gemm"),
    ("attention", r"flash|fmha|attention|attn|sdpa|flex"),
    ("head & loss", r"cross_?entropy|nll_?loss|log_?softmax|SoftMax(Forward|Backward)"),
    ("router", r"topk|top_k|bitonic|radixSelect|_softmax"),
    (
        "permute & combine",
        r"sort|radix|scatter|gather|index_put|index_add|index_?select|"
        r"IndexKernel|bincount|histc|cumsum|scan|embedding_?bag",  # bag: moe.permute gather
    ),
    ("optimizer", r"adam|multi_tensor|foreach|lamb"),
    ("other", r"embedding"),
    ("norms & elementwise", r"rsqrt|rms_?norm|layer_?norm"),
    (
        GEMM,
        r"gemm|gemv|xmma|nvjet|cutlass|cublas|sm\d\d_|aten::(mm|addmm|bmm|baddbmm|matmul|"
        r"linear)$",
    ),
    (
        "norms & elementwise",
        r"elementwise|vectorized|unrolled|reduce_kernel|triton_|copy|fill|"
        r"aten::",
    ),
]
_RULES = [(region, re.compile(pattern, re.I)) for region, pattern in NAME_RULES]
HOW = ("range", "backward", "name", "shape", "none")
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}
RANGE_CATS = {"cpu_op", "user_annotation"}
TOP_KERNELS = 25


@dataclass
class Node:
    """A host range (operator or named range) of the trace."""

    name: str
    ts: float
    end: float
    cat: str
    seq: int | None = None
    dims: list | None = None
    ext: int | None = None
    parent: Node | None = None
    child_op_us: float = 0.0
    """Time of the operators directly inside this one (its self time is the rest)."""

    def stack(self):
        node = self
        while node is not None:
            yield node
            node = node.parent


@dataclass
class Kernel:
    name: str
    ts: float
    dur: float
    copy: bool = False
    region: str = "other"
    how: str = "none"


@dataclass
class Dims:
    """The model's matrix widths, for the shape rule (gemm_region)."""

    tokens: int
    vocab: int
    d_model: int
    experts: int = 0
    attention: set[int] = field(default_factory=set)
    ffn: set[int] = field(default_factory=set)


def build_tree(events: list[dict]) -> dict[tuple, list[Node]]:
    """Host ranges per (pid, tid), each linked to its innermost enclosing range."""
    by_thread: dict[tuple, list[Node]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in RANGE_CATS:
            args = e.get("args") or {}
            seq = args.get("Sequence number")
            by_thread[(e.get("pid"), e.get("tid"))].append(
                Node(
                    e["name"],
                    float(e["ts"]),
                    float(e["ts"]) + float(e.get("dur", 0)),
                    e["cat"],
                    seq if isinstance(seq, int) and seq >= 0 else None,
                    args.get("Input Dims"),
                    args.get("External id"),
                )
            )
    for nodes in by_thread.values():
        nodes.sort(key=lambda n: (n.ts, -n.end))
        stack: list[Node] = []
        for node in nodes:
            while stack and stack[-1].end <= node.ts:
                stack.pop()
            if stack:
                node.parent = stack[-1]
                if node.cat == "cpu_op":
                    stack[-1].child_op_us += node.end - node.ts
            stack.append(node)
    return by_thread


def enclosing(nodes: list[Node], starts: list[float], ts: float) -> Node | None:
    """The innermost range of one thread (sorted by start) that holds time ``ts``."""
    i = bisect_right(starts, ts) - 1
    node = nodes[i] if i >= 0 else None
    while node is not None and node.end < ts:
        node = node.parent
    return node


def gemm_region(dims: list | None, model: Dims | None) -> str | None:
    """The region of a matrix product from its operands' shapes: the widths other than the
    token count name the layer (forward, input gradient and weight gradient alike)."""
    if not dims or model is None:
        return None
    sizes = {
        d for shape in dims if isinstance(shape, list) and len(shape) >= 2 for d in shape[-2:]
    } - {model.tokens}
    if not sizes:
        return None
    if model.vocab in sizes:
        return "head & loss"
    if model.experts and model.experts in sizes and sizes <= {model.d_model, model.experts}:
        return "router"
    if sizes & model.ffn:
        return "dense FFN & shared"
    if sizes <= {model.d_model} | model.attention:
        return "attention"
    return None


def by_name(name: str) -> str | None:
    for region, pattern in _RULES:
        if pattern.search(name):
            return region
    return None


def resolve(
    kernel: Kernel, launch: Node | None, forward: dict[int, str], model: Dims | None
) -> None:
    """Set ``kernel.region`` and ``kernel.how`` (the rules of the module docstring)."""
    stack = list(launch.stack()) if launch is not None else []
    if COMMUNICATION.search(kernel.name) or any(COMMUNICATION.search(n.name) for n in stack):
        kernel.region, kernel.how = "communication", "name"
        return
    for node in stack:
        if node.name in RANGE_REGIONS:
            kernel.region, kernel.how = RANGE_REGIONS[node.name], "range"
            return
        if node.name.startswith("autograd::engine::evaluate_function") and node.seq in forward:
            kernel.region, kernel.how = forward[node.seq], "backward"
            return
    region = by_name(kernel.name)
    if region is None and stack:
        region = by_name(stack[0].name)
    if region == GEMM:
        op = next((n for n in stack if n.dims), None)
        region = gemm_region(op.dims if op else None, model)
        kernel.how = "shape" if region else "none"
        kernel.region = region or "other"
        return
    kernel.region, kernel.how = (region, "name") if region else ("other", "none")


def forward_regions(threads: dict[tuple, list[Node]]) -> dict[int, str]:
    """Autograd sequence number of each forward operator -> the range region around it."""
    out = {}
    for nodes in threads.values():
        for node in nodes:
            if node.seq is None or node.cat != "cpu_op":
                continue
            names = [n.name for n in node.stack()]
            if any(n.startswith("autograd::engine::evaluate_function") for n in names):
                continue
            region = next((RANGE_REGIONS[n] for n in names if n in RANGE_REGIONS), None)
            if region is not None:
                out.setdefault(node.seq, region)
    return out


def attribute(trace: dict, model: Dims | None = None) -> tuple[list[Kernel], list, bool]:
    """Every kernel with its region, the busy intervals, and whether there were kernels.
    Without kernels (a CPU profile), every operator stands in for one with its self time (its
    time less the operators inside it), and the busy intervals are the outermost operators."""
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    threads = build_tree(events)
    forward = forward_regions(threads)
    starts = {k: [n.ts for n in nodes] for k, nodes in threads.items()}
    launches = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATS:
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launches[corr] = ((e.get("pid"), e.get("tid")), float(e["ts"]))
    # Without its launch record a kernel still names the operator around it (External id).
    by_ext = {n.ext: n for nodes in threads.values() for n in nodes if n.ext is not None}
    kernels = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in DEVICE_CATS:
            continue
        k = Kernel(e["name"], float(e["ts"]), float(e.get("dur", 0)), e["cat"] != "kernel")
        args = e.get("args") or {}
        where = launches.get(args.get("correlation"))
        launch = (
            enclosing(threads[where[0]], starts[where[0]], where[1])
            if where and where[0] in threads
            else by_ext.get(args.get("External id"))
        )
        resolve(k, launch, forward, model)
        kernels.append(k)
    if kernels:
        return kernels, [(k.ts, k.dur) for k in kernels], True
    busy = []
    for nodes in threads.values():
        for node in nodes:
            if node.cat != "cpu_op":
                continue
            if not any(n.cat == "cpu_op" for n in node.stack() if n is not node):
                busy.append((node.ts, node.end - node.ts))
            self_us = node.end - node.ts - node.child_op_us
            if self_us > 0:
                k = Kernel(node.name, node.ts, self_us)
                resolve(k, node, forward, model)
                kernels.append(k)
    return kernels, busy, False


def busy_time(intervals) -> float:
    """Length of the union of (start, duration) intervals."""
    total, end = 0.0, float("-inf")
    for start, dur in sorted(intervals):
        stop = start + dur
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def summarise(
    trace: dict,
    steps: int,
    step_s: float,
    *,
    dims: Dims | None = None,
    window_s: float | None = None,
    syncs: dict | None = None,
    **info,
) -> dict:
    """One compact summary (see the module docstring). ``step_s``: seconds per step timed
    without the profiler; ``window_s``: the profiled steps' wall time, all of them;
    ``syncs``: {"per_step": n, "sites": [[where, per_step], ...]} or None (not counted)."""
    kernels, busy, on_device = attribute(trace, dims)
    n = max(steps, 1)
    ms = lambda us: round(us / 1000 / n, 4)  # µs over all steps -> ms per step
    busy_ms = ms(busy_time(busy))
    total_us = sum(k.dur for k in kernels) or 1e-9
    per_region: dict[str, list] = defaultdict(lambda: [0.0, 0])
    groups: dict[tuple, list] = defaultdict(lambda: [0.0, 0, Counter()])
    how = Counter()
    for k in kernels:
        per_region[k.region][0] += k.dur
        per_region[k.region][1] += 1
        g = groups[(k.region, k.name)]
        g[0] += k.dur
        g[1] += 1
        g[2][k.how] += k.dur
        how[k.how] += k.dur
    top = sorted(groups.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    order = {r: i for i, r in enumerate(REGIONS)}
    top.sort(key=lambda kv: (order[kv[0][0]], -kv[1][0]))
    step_ms = round(step_s * 1000, 4)
    profiled_ms = round(window_s * 1000 / n, 4) if window_s else None
    # Kernel times are the device's own; operator times on the CPU carry the profiler's
    # overhead, so there the busy share is of the profiled step.
    base_ms = step_ms if on_device or not profiled_ms else profiled_ms
    return {
        **info,
        "device_kind": "gpu" if on_device else "cpu",
        "steps": steps,
        "step_ms": step_ms,
        "profiled_step_ms": profiled_ms,
        "busy_ms": busy_ms,
        "idle_ms": round(max(base_ms - busy_ms, 0.0), 4),
        "busy_share": round(min(busy_ms / base_ms, 1.0), 4) if base_ms else None,
        "kernels_per_step": round(sum(not k.copy for k in kernels) / n, 2),
        "copies_per_step": round(sum(k.copy for k in kernels) / n, 2),
        "kernel_ms_per_step": ms(total_us),
        "syncs_per_step": None if syncs is None else syncs["per_step"],
        "sync_sites": [] if syncs is None else syncs["sites"][:5],
        "attributed_by": {h: round(how[h] / total_us, 4) for h in HOW if how[h]},
        "regions": [
            [
                r,
                ms(per_region[r][0]),
                round(per_region[r][0] / total_us, 4),
                round(per_region[r][1] / n, 2),
            ]
            for r in REGIONS
            if r in per_region
        ],
        "top_kernels": [
            [
                region,
                name,
                round(calls / n, 2),
                ms(us),
                round(us / total_us, 4),
                hows.most_common(1)[0][0],
            ]
            for (region, name), (us, calls, hows) in top
        ],
    }


NOISE = re.compile(
    r"^void\s+|\b(at::native|at::cuda::detail|at::cuda|c10|std)::|"
    r"\(anonymous namespace\)::"
)


def short_name(name: str, width: int = 100) -> str:
    """A kernel name that fits a table cell: no ``void``, no common namespaces, no parameter
    list, template arguments collapsed from the innermost level out until it fits, then cut."""
    name = NOISE.sub("", name.strip())
    level = 0
    for i, ch in enumerate(name):  # the parameter list: the first "(" outside any template
        level += (ch == "<") - (ch == ">")
        if ch == "(" and level == 0 and i:
            name = name[:i]
            break
    depth = max(_levels(name), default=0)
    while len(name) > width and depth > 0:
        depth -= 1
        name = _keep_levels(name, depth)
    name = name.replace("|", "/")
    return name if len(name) <= width else name[: width - 1] + "…"


def _levels(name: str):
    level = 0
    for ch in name:
        level += (ch == "<") - (ch == ">")
        yield level


def _keep_levels(name: str, depth: int) -> str:
    """``name`` with everything inside template brackets deeper than ``depth`` as ``…``."""
    out, level = [], 0
    for ch in name:
        if ch == "<":
            level += 1
            out.append("<…" if level == depth + 1 else "<" if level <= depth else "")
        elif ch == ">":
            out.append(">" if level <= depth + 1 else "")
            level -= 1
        elif level <= depth:
            out.append(ch)
    return "".join(out)


def render(entries: list[dict]) -> str:
    """The markdown of a list of summaries (one section each)."""
    lines = [
        "# Step profiles",
        "",
        "Device-busy time is the union of every kernel, copy and fill on any stream; idle is "
        "the timed step (no profiler) less that. Regions and attribution: "
        "benchmarks/profile_summary.py.",
        "",
    ]
    for e in entries:
        lines += render_entry(e) + [""]
    return "\n".join(lines)


def render_entry(e: dict) -> list[str]:
    unit = "kernels" if e["device_kind"] == "gpu" else "operators (self time)"
    syncs = (
        "not counted"
        if e.get("syncs_per_step") is None
        else f"{e['syncs_per_step']:g} per step"
        + (
            " (" + "; ".join(f"{w} x{c:g}" for w, c in e["sync_sites"]) + ")"
            if e.get("sync_sites")
            else ""
        )
    )
    how = ", ".join(f"{h} {s:.0%}" for h, s in e["attributed_by"].items())
    head = [
        f"## {e.get('model', '?')} | {e.get('setting', '?')} | {e.get('device', '?')}",
        "",
        f"- step {e['step_ms']:.2f} ms timed"
        + (
            f" ({e['profiled_step_ms']:.2f} ms under the profiler)"
            if e.get("profiled_step_ms")
            else ""
        )
        + (f"; {e['tokens_per_s']:,.0f} tokens/s" if e.get("tokens_per_s") else "")
        + (f", MFU {e['mfu']:.1%}" if e.get("mfu") else ""),
        (
            f"- device busy {e['busy_ms']:.2f} ms ({e['busy_share']:.0%}), idle "
            if e["device_kind"] == "gpu"
            else f"- of the profiled step, in operators {e['busy_ms']:.2f} ms "
            f"({e['busy_share']:.0%}), outside them "
        )
        + f"{e['idle_ms']:.2f} ms; {e['kernels_per_step']:g} {unit} and "
        f"{e['copies_per_step']:g} copies per step ({e['kernel_ms_per_step']:.2f} ms of "
        f"{unit})",
        f"- host syncs: {syncs}",
        f"- attributed by {how}",
        "",
        "| region | ms/step | share | calls/step |",
        "| --- | ---: | ---: | ---: |",
    ]
    head += [f"| {r} | {t:.3f} | {s:.1%} | {c:g} |" for r, t, s, c in e["regions"]]
    head += [
        "",
        f"Top {len(e['top_kernels'])} {unit} by time, by region:",
        "",
        "| region | name | calls/step | ms/step | share | by |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    head += [
        f"| {r} | `{short_name(n)}` | {c:g} | {t:.3f} | {s:.1%} | {h} |"
        for r, n, c, t, s, h in e["top_kernels"]
    ]
    return head


def dumps(entries: list[dict]) -> str:
    """The JSON file: each entry's scalars on one line, its regions on one, one line per top
    kernel (about 30 lines per entry)."""
    blocks = []
    for e in entries:
        scalars = {k: v for k, v in e.items() if k not in ("regions", "top_kernels")}
        lines = [
            json.dumps(scalars, ensure_ascii=False)[:-1] + ",",
            f' "regions": {json.dumps(e["regions"])},',
            ' "top_kernels": [',
        ]
        lines += ["  " + json.dumps(k, ensure_ascii=False) + "," for k in e["top_kernels"]]
        lines[-1] = lines[-1].rstrip(",")
        blocks.append("\n".join(lines) + "]}")
    return (
        f'{{"regions": {json.dumps(list(REGIONS))},\n"entries": [\n' + ",\n".join(blocks) + "\n]}\n"
    )


def write_profiles(out_dir: str | Path, entries: list[dict]) -> None:
    """Add ``entries`` to OUT_DIR/profile.json (one per model and setting: a new one replaces
    the old) and write OUT_DIR/profile.md from all of them; each file is replaced whole."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "profile.json"
    kept = []
    if path.exists():
        try:
            kept = json.loads(path.read_text()).get("entries", [])
        except (ValueError, AttributeError):
            kept = []  # a file cut short by a killed writer: start again
    keys = {(e.get("model"), e.get("setting")) for e in entries}
    merged = [e for e in kept if (e.get("model"), e.get("setting")) not in keys] + entries
    replace_text(path, dumps(merged))
    replace_text(out / "profile.md", render(merged) + "\n")


def replace_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, so that a reader (or a kill) never
    sees half of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
