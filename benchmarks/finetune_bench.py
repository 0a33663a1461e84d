"""Fine-tuning benchmark (not a test), on one process, CPU, fp32. Three measurements, each a
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

The base is one of our checkpoints (default: runs/default, what ``moe-launch
configs/default.yaml`` trains). The fine-tuning data is instruction-style and built here from
the installed standard library: "User: What does json.dumps(obj, ...) do?" answered with the
first paragraph of its docstring, in the default instruction template, tokenized with the
base's tokenizer; the loss counts the answer tokens only (data_pipeline/instruction.py). One in
ten functions (by a hash of the name) is held out for validation. The training step is the
trainer's without the engine: the loss with the auxiliary loss, gradient clipping, AdamW over
the trainable parameters in the trainer's groups, the trainer's LR schedule.

    python benchmarks/finetune_bench.py [--base runs/default] [--steps 30] [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib
import inspect
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from data_pipeline.config import TemplateConfig  # noqa: E402
from data_pipeline.instruction import canonical, encode  # noqa: E402
from data_pipeline.tokenizer import Tokenizer  # noqa: E402
from moe.checkpoint.files import resolve_checkpoint  # noqa: E402
from moe.config.run import load_config  # noqa: E402
from moe.load import load_model  # noqa: E402
from moe.model.experts import grouped_mm, uses_grouped_kernel  # noqa: E402
from moe.parallel.deepspeed_adapter import optimizer_param_groups  # noqa: E402
from moe.training.finetune import parameter_counts, prepare_finetune  # noqa: E402
from moe.training.trainer import lr_lambda  # noqa: E402

IGNORE = -100
MODULES = ("abc", "argparse", "ast", "base64", "bisect", "calendar", "collections", "colorsys",
           "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal",
           "difflib", "email.utils", "enum", "filecmp", "fnmatch", "fractions", "ftplib",
           "functools", "getopt", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac",
           "html", "http.client", "http.cookies", "imaplib", "inspect", "io", "ipaddress",
           "itertools", "json", "locale", "logging", "mailbox", "mimetypes", "netrc",
           "numbers", "operator", "optparse", "os", "os.path", "pathlib", "pickle", "pkgutil",
           "platform", "plistlib", "poplib", "pprint", "queue", "quopri", "random", "re",
           "reprlib", "sched", "secrets", "selectors", "shlex", "shutil", "smtplib", "socket",
           "socketserver", "sqlite3", "ssl", "statistics", "string", "struct", "subprocess",
           "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "traceback",
           "turtle", "typing", "unittest", "urllib.parse", "urllib.request", "uuid", "warnings",
           "wave", "weakref", "xml.dom.minidom", "zipfile", "zoneinfo")


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
                members += [(f"{name}.{m}", f) for m, f in sorted(vars(obj).items())
                            if not m.startswith("_") and inspect.isfunction(f)]
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
    ids_RL = torch.from_numpy(ids_T[:rows * (seq_len + 1)].astype(np.int64)).view(rows, -1)
    mask_RL = torch.from_numpy(mask_T[:rows * (seq_len + 1)].astype(bool)).view(rows, -1)
    targets = ids_RL[:, 1:].masked_fill(~mask_RL[:, 1:], IGNORE)
    return ids_RL[:, :-1], targets


class Tuner:
    """One fine-tuning run of a method from the base, stepped from outside."""

    def __init__(self, base, config: str, steps: int, overrides: list[str]):  # KEY=VALUE
        cfg = load_config(str(ROOT / "configs" / config),
                          ["model.init_from=base", f"train.max_steps={steps}", *overrides])
        self.cfg = cfg
        self.model = copy.deepcopy(base)
        prepare_finetune(self.model, cfg.finetune)
        self.model.train()
        t = cfg.train
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(optimizer_param_groups(self.model, t.weight_decay),
                                     lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8)
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
        logits = model(inputs[i:i + batch]).logits.double()
        t = targets[i:i + batch]
        total += F.cross_entropy(logits.flatten(0, 1), t.flatten(), ignore_index=IGNORE,
                                 reduction="sum").item()
        count += int((t != IGNORE).sum())
    model.train()
    return total / count


def finetune_runs(args) -> dict:
    tag = resolve_checkpoint(args.base)
    base, run_cfg, _ = load_model(tag)
    tokenizer = Tokenizer(tag / "tokenizer.model")
    pairs = stdlib_pairs()
    train = [p for p in pairs if not held_out(p[0])]
    valid = [p for p in pairs if held_out(p[0])]
    seq = args.seq_len
    train_x, train_y = pack(train, tokenizer, seq)
    valid_x, valid_y = pack(valid, tokenizer, seq)
    print(f"data: {len(train)} train / {len(valid)} held-out conversations from the stdlib; "
          f"{len(train_x)} / {len(valid_x)} rows of {seq} tokens; trained targets "
          f"{int((train_y != IGNORE).sum())} / {int((valid_y != IGNORE).sum())}", flush=True)
    base_loss = masked_loss(base, valid_x, valid_y, args.micro_batch)
    print(f"base: held-out masked loss {base_loss:.4f}", flush=True)
    vocab = [f"model.vocab_size={run_cfg.model.vocab_size}"]
    shares, results = {}, []
    for r in range(args.repeats):
        tuners = {"full": Tuner(base, "finetune-full.yaml", args.steps, vocab),
                  "lora": Tuner(base, "finetune-lora.yaml", args.steps, vocab + args.lora)}
        shares = {m: parameter_counts(t.model)["trainable_share"] for m, t in tuners.items()}
        order = torch.randperm(len(train_x), generator=torch.Generator().manual_seed(r))
        torch.manual_seed(r)
        for s in range(args.steps):
            rows = order[(s * args.micro_batch + torch.arange(args.micro_batch)) % len(order)]
            x, y = train_x[rows], train_y[rows]
            names = list(tuners) if s % 2 == 0 else list(tuners)[::-1]
            for name in names:  # alternating which goes first: both see the same load
                tuners[name].step(x, y)
        res = {"repeat": r}
        for name, t in tuners.items():
            res[f"{name}_loss"] = masked_loss(t.model, valid_x, valid_y, args.micro_batch)
            res[f"{name}_step_s"] = statistics.median(t.times[2:])  # first steps: warm-up
        res["step_ratio"] = res["lora_step_s"] / res["full_step_s"]
        res["gap"] = res["lora_loss"] - res["full_loss"]
        results.append(res)
        print(f"repeat {r}: held-out loss full {res['full_loss']:.4f} lora {res['lora_loss']:.4f}"
              f" (gap {res['gap']:+.4f} nats); step full {res['full_step_s']:.3f} s lora "
              f"{res['lora_step_s']:.3f} s (lora/full {res['step_ratio']:.3f})", flush=True)
        del tuners
    return {"base_loss": base_loss, "shares": shares, "repeats": results}


# -- (b): the routed experts' LoRA path, grouped against a loop over experts -----------------

def expert_lora_path(args, T: int) -> dict:
    E, K, D, H, r = args.experts, args.top_k, args.d_model, args.expert_hidden, args.expert_rank
    gen = torch.Generator().manual_seed(0)
    # Routed copies sorted by expert, with the imbalance of a random top-k routing.
    counts = torch.bincount(torch.rand(T, E, generator=gen).topk(K, dim=1).indices.flatten(),
                            minlength=E)
    counts_host = counts.tolist()
    N = sum(counts_host)
    x_in = torch.randn(N, D, generator=gen)  # the experts' input rows
    x_out = torch.randn(N, H, generator=gen)  # the activations w_out reads
    factors = {"in": (torch.randn(E, D, r, generator=gen) * D ** -0.5,
                      torch.randn(E, r, 2 * H, generator=gen) * 0.01),
               "out": (torch.randn(E, H, r, generator=gen) * H ** -0.5,
                       torch.randn(E, r, D, generator=gen) * 0.01)}
    for a, b in factors.values():
        a.requires_grad_(True)
        b.requires_grad_(True)
    assert all(uses_grouped_kernel(x_in, t) for ab in factors.values() for t in ab)

    def grouped(x, a, b):
        return grouped_mm(grouped_mm(x, a, counts, counts_host), b, counts, counts_host)

    def loop(x, a, b):
        return torch.cat([(xe @ a[e]) @ b[e] for e, xe in enumerate(x.split(counts_host))])

    def run(fn):
        xs = {k: v.detach().requires_grad_(True) for k, v in (("in", x_in), ("out", x_out))}
        t0 = time.perf_counter()
        ys = [fn(xs[k], *factors[k]) for k in ("in", "out")]
        sum(y.square().mean() for y in ys).backward()
        return time.perf_counter() - t0, ys

    _, want = run(loop)
    _, got = run(grouped)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    times = {"grouped": [], "loop": []}
    for i in range(args.rounds):
        for name in (("grouped", "loop") if i % 2 == 0 else ("loop", "grouped")):
            times[name].append(min(run(grouped if name == "grouped" else loop)[0]
                                   for _ in range(args.iters)))
    ratios = [lo / g for lo, g in zip(times["loop"], times["grouped"])]
    return {"rows": N, "times": times, "ratios": ratios}


def spread(values, fmt="{:.3f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-" \
           f"{fmt.format(max(values))})"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="runs/default", help="the pretrained checkpoint")
    p.add_argument("--steps", type=int, default=30, help="fine-tuning steps per run")
    p.add_argument("--micro-batch", type=int, default=4, help="rows per step")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per row")
    p.add_argument("--repeats", type=int, default=3, help="full/LoRA pairs (seeds)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--lora", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting of configs/finetune-lora.yaml (repeatable), e.g. "
                        "finetune.lora.rank=16")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 512],
                   help="(b): tokens per pass (each routed to top-k experts)")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--expert-hidden", type=int, default=128)
    p.add_argument("--expert-rank", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5, help="(b): interleaved rounds")
    p.add_argument("--iters", type=int, default=2, help="(b): passes per round (fastest kept)")
    p.add_argument("--skip", choices=["experts", "finetune"], action="append", default=[])
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    for tokens in [] if "experts" in args.skip else args.tokens:
        b = expert_lora_path(args, tokens)
        print(f"(b) expert LoRA path, forward + backward, {args.experts} experts, top-{args.top_k}"
              f", {tokens} tokens ({b['rows']} routed rows), D {args.d_model}, H "
              f"{args.expert_hidden}, rank {args.expert_rank}, fp32; {args.rounds} interleaved "
              f"rounds (fastest of {args.iters} each):")
        for name in ("grouped", "loop"):
            print(f"    {name:8s} {spread([1e3 * t for t in b['times'][name]], '{:.2f}')} ms")
        print(f"    loop / grouped: {spread(b['ratios'], '{:.2f}')}x (target >= 5x)", flush=True)
    if "finetune" not in args.skip:
        c = finetune_runs(args)
        reps = c["repeats"]
        print(f"trainable share: full {100 * c['shares']['full']:.2f}%, lora "
              f"{100 * c['shares']['lora']:.3f}% (target <= 2%)")
        print(f"(a) step time lora / full: {spread([r['step_ratio'] for r in reps])} over "
              f"{len(reps)} repeats (target <= 1); full {spread([r['full_step_s'] for r in reps])}"
              f" s, lora {spread([r['lora_step_s'] for r in reps])} s")
        print(f"(c) held-out masked loss after {args.steps} steps: base {c['base_loss']:.4f}, "
              f"full {spread([r['full_loss'] for r in reps], '{:.4f}')}, lora "
              f"{spread([r['lora_loss'] for r in reps], '{:.4f}')}; lora - full "
              f"{spread([r['gap'] for r in reps], '{:+.4f}')} nats (target <= 0.05)")


if __name__ == "__main__":
    main()
