"""Fine-tuning benchmark (not a test), on one process, CPU, fp32. Four measurements, each a
ratio against a baseline measured in the same run:

(a) step time of LoRA against full fine-tuning of the same pretrained model (target: LoRA at
    most full's). The two train in lockstep, alternating which goes first, so that both see the
    same machine load; median step time per repeat, then the median and spread over repeats.
(b) the routed experts' LoRA path, forward + backward, grouped (two grouped GEMMs per
    projection, as LoRAGroupedExperts runs it) against a per-expert Python loop over the same
    expert-sorted rows, at 64 experts (target: grouped at least 5x faster); interleaved rounds.
(c) quality: the held-out masked loss after the same steps on the same batches, LoRA (the
    settings of configs/finetune-lora.yaml: at most 2% of the parameters train) against full
    fine-tuning (configs/finetune-full.yaml's settings) (target: LoRA within 0.05 nats).
    Every other method (--methods: qlora, esft, adapter, prompt, prefix, with their shipped
    configs) trains in the same lockstep and is reported against full alike.
(d) peak memory: each method in a process of its own, the peak resident memory over a few
    training steps after its base is loaded and dropped (Linux high-water mark, reset after
    set-up), against full's; methods interleaved over repeats.

The base is one of our checkpoints (default: runs/default, what ``moe-launch
configs/default.yaml`` trains). The fine-tuning data is instruction-style and built here from
the installed standard library: "User: What does json.dumps(obj, ...) do?" answered with the
first paragraph of its docstring, in the default instruction template, tokenized with the
base's tokenizer; the loss counts the answer tokens only (data_pipeline/instruction.py). One in
ten functions (by a hash of the name) is held out for validation. The training step is the
trainer's without the engine: the loss with the auxiliary loss, gradient clipping, AdamW over
the trainable parameters in the trainer's groups, the trainer's LR schedule.

    python benchmarks/finetune_bench.py [--base runs/default] [--steps 30] [--repeats 3]
        [--methods full,lora,...] [--skip experts|finetune|memory]
"""

from __future__ import annotations

import argparse
import copy
import gc
import hashlib
import importlib
import inspect
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.finetune_expert_path import expert_lora_path  # noqa: E402
from data_pipeline.config import TemplateConfig  # noqa: E402
from data_pipeline.instruction import canonical, encode  # noqa: E402
from data_pipeline.tokenizer import Tokenizer  # noqa: E402
from moe.checkpoint.files import resolve_checkpoint  # noqa: E402
from moe.config.run import load_config  # noqa: E402
from moe.model.adapters.esft import select_experts  # noqa: E402
from moe.model.adapters.qlora import nf4_bytes, quantize_base, torchao_missing  # noqa: E402
from moe.parallel.deepspeed_adapter import optimizer_param_groups  # noqa: E402
from moe.training.esft import install_selection, score_experts  # noqa: E402
from moe.training.finetune import parameter_counts, prepare_finetune  # noqa: E402
from moe.training.trainer import lr_lambda  # noqa: E402
from moe.weights.load import load_model  # noqa: E402

IGNORE = -100
MODULES = (
    "abc",
    "argparse",
    "ast",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "colorsys",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email.utils",
    "enum",
    "filecmp",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "getopt",
    "gettext",
    "glob",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "html",
    "http.client",
    "http.cookies",
    "imaplib",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "locale",
    "logging",
    "mailbox",
    "mimetypes",
    "netrc",
    "numbers",
    "operator",
    "optparse",
    "os",
    "os.path",
    "pathlib",
    "pickle",
    "pkgutil",
    "platform",
    "plistlib",
    "poplib",
    "pprint",
    "queue",
    "quopri",
    "random",
    "re",
    "reprlib",
    "sched",
    "secrets",
    "selectors",
    "shlex",
    "shutil",
    "smtplib",
    "socket",
    "socketserver",
    "sqlite3",
    "ssl",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "traceback",
    "turtle",
    "typing",
    "unittest",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "xml.dom.minidom",
    "zipfile",
    "zoneinfo",
)


# -- (c) and (a): the instruction-style data and the lockstep runs ----------------------------


def stdlib_pairs() -> list[tuple[str, str, str]]:
    """(qualified name, prompt, response) for every documented public function, class and
    method of MODULES, in a fixed order."""
    out, seen = [], set()
    for mod_name in MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            members = [(name, obj)]
            if inspect.isclass(obj):
                members += [
                    (f"{name}.{m}", f)
                    for m, f in sorted(vars(obj).items())
                    if not m.startswith("_") and inspect.isfunction(f)
                ]
            for qual, f in members:
                if not (inspect.isfunction(f) or inspect.isclass(f)):
                    continue
                doc = (inspect.getdoc(f) or "").split("\n\n")[0].strip()
                key = f"{mod_name}.{qual}"
                if len(doc) < 20 or key in seen:
                    continue
                seen.add(key)
                try:  # default values' reprs without their addresses: the same text every run
                    sig = re.sub(r" at 0x[0-9a-fA-F]+", "", str(inspect.signature(f)))
                except (TypeError, ValueError):
                    sig = "(...)"
                out.append((key, f"What does {key}{sig[:80]} do?", " ".join(doc.split())[:400]))
    return out


def held_out(name: str) -> bool:
    return hashlib.sha256(name.encode()).digest()[0] % 10 == 0


def pack(pairs, tokenizer: Tokenizer, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Conversations in the default template, packed into rows of seq_len + 1 tokens: (inputs
    (R, S), targets (R, S)) with the prompt tokens' targets ignored."""
    texts = [canonical([("user", p), ("assistant", r)]) for _, p, r in pairs]
    ids, masks = encode(texts, TemplateConfig(), tokenizer)
    ids_T, mask_T = np.concatenate(ids), np.concatenate(masks)
    rows = len(ids_T) // (seq_len + 1)
    ids_RL = torch.from_numpy(ids_T[: rows * (seq_len + 1)].astype(np.int64)).view(rows, -1)
    mask_RL = torch.from_numpy(mask_T[: rows * (seq_len + 1)].astype(bool)).view(rows, -1)
    targets = ids_RL[:, 1:].masked_fill(~mask_RL[:, 1:], IGNORE)
    return ids_RL[:, :-1], targets


METHODS = {
    "full": "finetune-full.yaml",
    "lora": "finetune-lora.yaml",
    "qlora": "finetune-qlora.yaml",
    "esft": "finetune-esft.yaml",
    "adapter": "finetune-adapter.yaml",
    "prompt": "finetune-prompt.yaml",
    "prefix": "finetune-prefix.yaml",
}
"""Each method with the settings of its shipped config (configs/finetune-*.yaml)."""


class Tuner:
    """One fine-tuning run of a method from the base, stepped from outside. ``score_rows``: the
    input rows ESFT scores the experts on before step 1 (the run's first micro-batches, as the
    trainer scores them); qlora's base is quantised after the adapters are added, as the
    trainer does."""

    def __init__(
        self,
        base,
        method: str,
        steps: int,
        overrides: list[str],  # KEY=VALUE
        score_rows: list[torch.Tensor] = (),
    ):
        cfg = load_config(
            str(ROOT / "configs" / METHODS[method]),
            ["model.init_from=base", f"train.max_steps={steps}", *overrides],
        )
        self.cfg = cfg
        self.model = copy.deepcopy(base)
        prepare_finetune(self.model, cfg.finetune)
        if cfg.finetune.method == "qlora":
            quantize_base(self.model)
        self.model.train()
        t = cfg.train
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(
            optimizer_param_groups(self.model, t.weight_decay),
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            eps=1e-8,
        )
        if cfg.finetune.method == "esft":
            esft = cfg.finetune.esft
            scores = score_experts(self.model, [(x, None) for x in score_rows[: esft.max_batches]])
            chosen = select_experts(scores[esft.score], esft.p)
            install_selection(
                self.model, self.opt, {"layers": [{"selected": c} for c in chosen]}, ep_rank=0
            )
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(cfg))
        self.times: list[float] = []

    def step(self, inputs_BS, targets_BS) -> float:
        t0 = time.perf_counter()
        loss = self.model(inputs_BS, targets_BS).loss
        loss.backward()
        if self.cfg.train.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.train.grad_clip)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.times.append(time.perf_counter() - t0)
        return loss.item()


@torch.no_grad()
def masked_loss(model, inputs, targets, batch: int) -> float:
    model.eval()
    total = count = 0.0
    for i in range(0, len(inputs), batch):
        logits = model(inputs[i : i + batch]).logits.double()
        t = targets[i : i + batch]
        total += F.cross_entropy(
            logits.flatten(0, 1), t.flatten(), ignore_index=IGNORE, reduction="sum"
        ).item()
        count += int((t != IGNORE).sum())
    model.train()
    return total / count


def bench_data(args):
    """(base model, its run config, train (inputs, targets), held-out (inputs, targets))."""
    tag = resolve_checkpoint(args.base)
    base, run_cfg, _ = load_model(tag)
    tokenizer = Tokenizer(tag / "tokenizer.model")
    pairs = stdlib_pairs()
    train = [p for p in pairs if not held_out(p[0])]
    valid = [p for p in pairs if held_out(p[0])]
    train_xy, valid_xy = pack(train, tokenizer, args.seq_len), pack(valid, tokenizer, args.seq_len)
    print(
        f"data: {len(train)} train / {len(valid)} held-out conversations from the stdlib; "
        f"{len(train_xy[0])} / {len(valid_xy[0])} rows of {args.seq_len} tokens; trained "
        f"targets {int((train_xy[1] != IGNORE).sum())} / {int((valid_xy[1] != IGNORE).sum())}",
        file=sys.stderr,
        flush=True,
    )
    return base, run_cfg, train_xy, valid_xy


def overrides(args, method: str, run_cfg) -> list[str]:
    extra = args.lora if method in ("lora", "qlora") else []
    return [f"model.vocab_size={run_cfg.model.vocab_size}", *extra]


def batch_rows(order: torch.Tensor, step: int, micro_batch: int) -> torch.Tensor:
    return order[(step * micro_batch + torch.arange(micro_batch)) % len(order)]


def finetune_runs(args) -> dict:
    base, run_cfg, (train_x, train_y), (valid_x, valid_y) = bench_data(args)
    base_loss = masked_loss(base, valid_x, valid_y, args.micro_batch)
    print(f"base: held-out masked loss {base_loss:.4f}", flush=True)
    methods = args.methods
    shares, results = {}, []
    for r in range(args.repeats):
        order = torch.randperm(len(train_x), generator=torch.Generator().manual_seed(r))
        first = [train_x[batch_rows(order, s, args.micro_batch)] for s in range(args.steps)]
        torch.manual_seed(r)
        tuners = {
            m: Tuner(base, m, args.steps, overrides(args, m, run_cfg), first) for m in methods
        }
        shares = {m: parameter_counts(t.model)["trainable_share"] for m, t in tuners.items()}
        for s in range(args.steps):
            rows = batch_rows(order, s, args.micro_batch)
            x, y = train_x[rows], train_y[rows]
            k = s % len(methods)  # rotating which goes first: all see the same load
            for name in methods[k:] + methods[:k]:
                tuners[name].step(x, y)
        res = {"repeat": r}
        for name, t in tuners.items():
            res[f"{name}_loss"] = masked_loss(t.model, valid_x, valid_y, args.micro_batch)
            res[f"{name}_step_s"] = statistics.median(t.times[2:])  # first steps: warm-up
        for name in methods:
            res[f"{name}_step_ratio"] = res[f"{name}_step_s"] / res["full_step_s"]
            res[f"{name}_gap"] = res[f"{name}_loss"] - res["full_loss"]
        results.append(res)
        print(
            f"repeat {r}: "
            + "; ".join(
                f"{m} loss {res[f'{m}_loss']:.4f} step {res[f'{m}_step_s']:.3f} s" for m in methods
            ),
            flush=True,
        )
        del tuners
    return {"base_loss": base_loss, "shares": shares, "repeats": results}


def _malloc_trim() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def training_peak(args, method: str) -> dict:
    """In this process: the method's run set up from the base, the base dropped, then the peak
    resident memory over ``args.memory_steps`` steps (Linux: /proc/self/clear_refs resets the
    high-water mark, so the loading of the fp32 base does not count)."""
    base, run_cfg, (train_x, train_y), _ = bench_data(args)
    order = torch.randperm(len(train_x), generator=torch.Generator().manual_seed(0))
    first = [train_x[batch_rows(order, s, args.micro_batch)] for s in range(args.memory_steps)]
    tuner = Tuner(base, method, args.memory_steps, overrides(args, method, run_cfg), first)
    del base
    gc.collect()
    _malloc_trim()
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    for s in range(args.memory_steps):
        rows = batch_rows(order, s, args.micro_batch)
        tuner.step(train_x[rows], train_y[rows])
    return {
        "method": method,
        "before_mib": before / 1024,
        "peak_mib": _status_kib("VmHWM") / 1024,
        "nf4_mib": nf4_bytes(tuner.model) / 2**20,
    }


def memory_runs(args) -> dict:
    """Each method's training peak in a process of its own, methods interleaved over repeats."""
    peaks: dict[str, list[dict]] = {m: [] for m in args.methods}
    for r in range(args.repeats):
        k = r % len(args.methods)
        for m in args.methods[k:] + args.methods[:k]:
            cmd = [
                sys.executable,
                __file__,
                "--memory-of",
                m,
                "--base",
                args.base,
                "--micro-batch",
                str(args.micro_batch),
                "--seq-len",
                str(args.seq_len),
                "--memory-steps",
                str(args.memory_steps),
            ]
            cmd += [f"--lora={o}" for o in args.lora]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            peaks[m].append(json.loads(out.strip().splitlines()[-1]))
    return peaks


def spread(values, fmt="{:.3f}") -> str:
    return (
        f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-"
        f"{fmt.format(max(values))})"
    )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="runs/default", help="the pretrained checkpoint")
    p.add_argument("--steps", type=int, default=30, help="fine-tuning steps per run")
    p.add_argument("--micro-batch", type=int, default=4, help="rows per step")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per row")
    p.add_argument("--repeats", type=int, default=3, help="full/LoRA pairs (seeds)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a setting of configs/finetune-lora.yaml (repeatable), e.g. "
        "finetune.lora.rank=16",
    )
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[4096, 512],
        help="(b): tokens per pass (each routed to top-k experts)",
    )
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--expert-hidden", type=int, default=128)
    p.add_argument("--expert-rank", type=int, default=8)
    p.add_argument("--device", default="cpu", help="(b): where the expert path runs")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="(b): the rows' and factors' dtype (CUDA's grouped kernel takes bf16)",
    )
    p.add_argument("--rounds", type=int, default=5, help="(b): interleaved rounds")
    p.add_argument("--iters", type=int, default=2, help="(b): passes per round (fastest kept)")
    p.add_argument("--skip", choices=["experts", "finetune", "memory"], action="append", default=[])
    p.add_argument(
        "--methods",
        default=",".join(METHODS),
        help="comma-separated methods compared with full (full is always run)",
    )
    p.add_argument("--memory-steps", type=int, default=4, help="steps per memory measurement")
    p.add_argument("--memory-of", choices=list(METHODS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        p.error(f"--methods: unknown {', '.join(unknown)} (known: {', '.join(METHODS)})")
    args.methods = methods
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_of:  # a child of memory_runs: one line of JSON
        print(json.dumps(training_peak(args, args.memory_of)))
        return
    if "qlora" in args.methods and (missing := torchao_missing()):
        print(f"qlora left out: {missing}", flush=True)
        args.methods.remove("qlora")
    args.methods = ["full"] + [m for m in args.methods if m != "full"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    for tokens in [] if "experts" in args.skip else args.tokens:
        report_expert_path(args, tokens)
    if "finetune" not in args.skip:
        report_finetune(args)
    if "memory" not in args.skip:
        report_memory(args)


def report_expert_path(args, tokens: int) -> None:
    b = expert_lora_path(args, tokens)
    print(
        f"(b) expert LoRA path, forward + backward, {args.experts} experts, top-{args.top_k}"
        f", {tokens} tokens ({b['rows']} routed rows), D {args.d_model}, H "
        f"{args.expert_hidden}, rank {args.expert_rank}, {args.dtype} on {args.device}; "
        f"{args.rounds} interleaved rounds (fastest of {args.iters} each):"
    )
    for name in ("grouped", "loop"):
        print(f"    {name:8s} {spread([1e3 * t for t in b['times'][name]], '{:.2f}')} ms")
    print(f"    loop / grouped: {spread(b['ratios'], '{:.2f}')}x (target >= 5x)", flush=True)


def report_finetune(args) -> None:
    c = finetune_runs(args)
    reps = c["repeats"]
    print(
        f"after {args.steps} steps, {len(reps)} repeats (median (min-max)); base held-out "
        f"masked loss {c['base_loss']:.4f}:"
    )
    print(
        "| method | trainable | held-out masked loss | minus full (nats) | step time (s) "
        "| step time / full |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for m in args.methods:
        print(
            f"| {m} | {100 * c['shares'][m]:.3g}% "
            f"| {spread([r[f'{m}_loss'] for r in reps], '{:.4f}')} "
            f"| {spread([r[f'{m}_gap'] for r in reps], '{:+.4f}')} "
            f"| {spread([r[f'{m}_step_s'] for r in reps])} "
            f"| {spread([r[f'{m}_step_ratio'] for r in reps], '{:.2f}')} |"
        )
    if "lora" in args.methods:
        gaps = spread([r["lora_gap"] for r in reps], "{:+.4f}")
        print(
            f"(a) lora / full step time {spread([r['lora_step_ratio'] for r in reps])} "
            f"(target <= 1); (c) lora - full {gaps} nats (target <= 0.05) with "
            f"{100 * c['shares']['lora']:.3f}% trainable (target <= 2%)",
            flush=True,
        )


def report_memory(args) -> None:
    peaks = memory_runs(args)
    full = statistics.median(p["peak_mib"] for p in peaks["full"])
    print(
        f"peak resident memory over {args.memory_steps} training steps, each method in a "
        f"process of its own after its base is loaded, {args.repeats} interleaved repeats:"
    )
    print("| method | resident before the steps (MiB) | peak (MiB) | peak / full's |")
    print("| --- | --- | --- | --- |")
    for m, ps in peaks.items():
        print(
            f"| {m} | {spread([p['before_mib'] for p in ps], '{:.0f}')} "
            f"| {spread([p['peak_mib'] for p in ps], '{:.0f}')} "
            f"| {spread([p['peak_mib'] / full for p in ps], '{:.2f}')} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
