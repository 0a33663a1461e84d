"""The settings matrix in one call: every speed lever on and off, eager and compiled, for
dense-125m and moe-125m on one GPU, in interleaved rounds, inside a time budget it enforces.
Run it through ``benchmarks/gpu_speed_matrix.sh``:

    bash benchmarks/gpu_speed_matrix.sh OUTDIR                 # on the GPU machine, <= 7 minutes
    bash benchmarks/gpu_speed_matrix.sh OUTDIR --scratch DIR   # reuse the proof's installed wheels
    bash benchmarks/gpu_speed_matrix.sh OUTDIR --device cpu --tiny --budget 120   # CPU rehearsal

Settings: the default (no override: on CUDA the CUDA defaults, RunConfig.device_choices), each
lever of ``LEVERS`` alone (``eager``, the plain settings the CUDA defaults are measured against,
and ``compile``, then the named combinations of ``COMBINATIONS``, then the CUDA defaults undone
one by one, ``ABLATIONS``, then the others), then each lever marked ``compiled`` together with
``train.compile=true``, in that order, which is also their priority. A setting that trains as
the default does on the device (``compile`` on CUDA, ``eager`` on the CPU) is skipped, by name.
``--levers a,b`` picks levers (in that order); ``--levers a+b+c`` measures levers together.
Each setting runs on each model once per round; round 1 goes in priority order, rounds 2 and 3
in rotated orders (each setting at a different place in each round), and every round has its own default run, against which that round's
ratio is taken: a row's ratio is the median (and spread) of its rounds' ratios.

The budget (``--budget`` seconds, 420 by default) counts from the start, wheel install and
worker start included. A setting is admitted in round 1 only if all its rounds fit in what is
left after the rounds already promised to earlier settings, estimated from the measured runs
(the default's run for a new setting, plus ``--compile-estimate`` for a compiled one until a
compile is measured); a run whose estimate no longer fits is not started, and a run still
going at the deadline is ended. Time the admitted settings leave goes to the others, in
priority order: rounds of one setting and a default run each, as many as fit (a row says how
many runs it has). Then, within ``--profile-reserve`` seconds kept back for it, each model's
fastest setting is run once more under the profiler (benchmarks/profile_summary.py).

All runs happen in one worker process (``gpu_train_bench.py --serve``: imports, CUDA context
and compiled blocks kept from run to run), restarted when it dies. OUTDIR gets matrix.md,
matrix.json (rows with device, model, setting, tokens_per_s, mfu, ratio and every run),
profile.md and profile.json (the fastest settings) and worker.log. The summary files are
rewritten after every run, so a run killed at any point leaves the last complete one; an
interrupted or timed-out matrix says so in them. Standard library only.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from matrix_report import best_settings, summary_rows, write_summary
from matrix_worker import Worker, ensure_packages
from plain_settings import EAGER
from profile_summary import write_profiles

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Lever:
    """One speed lever: config overrides (``bench.*`` ones are the bench's knobs,
    benchmarks/bench_steps.py) and what it needs to apply (benchmarks/bench_worker.py
    ``unmet``: cuda, moe, bf16, flex, liger, unaligned-experts); ``compiled``: also measured with
    ``train.compile=true``."""

    name: str
    overrides: tuple[str, ...]
    needs: tuple[str, ...] = ()
    compiled: bool = False
    note: str = ""
    where: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = ()
    """Overrides applied only on a model that meets their needs (see ``combine``)."""


MODEL_NEEDS = ("moe", "unaligned-experts")
"""Preconditions on the model rather than the machine or the precision: a combination applies
a lever that has one of them only on the models that meet it, instead of skipping the whole
combination on the others."""


def combine(name: str, levers, note: str = "") -> Lever:
    """One setting with the overrides of every lever of ``levers``: their machine and precision
    needs are the combination's; a lever with a model need (MODEL_NEEDS) goes into ``where``,
    applied only on the models that meet it. A key set to two values is refused."""
    overrides: list[str] = []
    needs: list[str] = []
    where: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
    for lv in levers:
        model = tuple(n for n in lv.needs if n in MODEL_NEEDS)
        needs += [n for n in lv.needs if n not in MODEL_NEEDS]
        where += list(lv.where)
        if model:
            where.append((lv.overrides, model))
        else:
            overrides += lv.overrides
    values: dict[str, str] = {}
    for o in [*overrides, *(o for part, _ in where for o in part)]:
        key, _, value = o.partition("=")
        key, value = key.strip(), value.strip()
        if values.setdefault(key, value) != value:
            raise ValueError(
                f"{name}: {key} is set to both {values[key]!r} and {value!r} by its levers"
            )
    return Lever(
        name,
        tuple(dict.fromkeys(overrides)),
        tuple(dict.fromkeys(needs)),
        note=note,
        where=tuple(where),
    )


SINGLE_LEVERS = (
    Lever(
        "eager",
        EAGER,
        note="the plain settings (the CPU's, and CUDA's before its defaults): the baseline of "
        "the CUDA defaults",
    ),
    Lever("compile", ("train.compile=true",), note="each block compiled (inductor)"),
    Lever(
        "cuda-graphs",
        (
            "train.compile=true",
            "train.cuda_graphs=true",
            "train.immediate_grad_update=true",
            "parallel.zero_stage=1",
            "parallel.world_size=1",
            "parallel.expert_parallel_size=1",
        ),
        ("cuda", "bf16"),
        note="compiled blocks replayed as CUDA graph trees, gradients folded as produced",
    ),
    Lever(
        "ce-chunked",
        ("model.cross_entropy=chunked",),
        compiled=True,
        note="the head and loss in blocks of 1024 tokens, no (T, V) logits",
    ),
    Lever(
        "ce-liger",
        ("model.cross_entropy=liger",),
        ("cuda", "liger"),
        compiled=True,
        note="Liger-Kernel's fused linear cross-entropy",
    ),
    Lever(
        "ce-chunk-4096",
        ("model.cross_entropy=chunked", "model.cross_entropy_chunk_tokens=4096"),
        compiled=True,
        note="the chunked loss in blocks of 4096 tokens: a quarter of the fp32 weight-gradient "
        "additions and of the block loop, (4096, V) fp32 per block",
    ),
    Lever("adamw-fused", ("train.optimizer_impl=fused",), note="torch's fused AdamW kernel"),
    Lever(
        "qkv-fused",
        ("model.qkv_projection=fused",),
        compiled=True,
        note="the query, key and value projections as one product (weights concatenated)",
    ),
    Lever(
        "flat-grads",
        ("train.flat_grad_ops=true",),
        note="the ZeRO optimizer's gradient norm, clipping, adds and reduction per group, "
        "not per parameter",
    ),
    Lever(
        "permute-gather",
        ("model.moe.permute=gather",),
        ("moe",),
        compiled=True,
        note="token copies moved by gathers only, no scatter-add (atomics) either way",
    ),
    Lever(
        "immediate-grads",
        ("train.immediate_grad_update=true", "parallel.zero_stage=1"),
        ("bf16",),
        note="each bf16 gradient folded into the fp32 buffer as it is produced, none kept",
    ),
    Lever(
        "expert-loop",
        ("bench.expert_kernel=loop",),
        ("moe",),
        note="per-expert loop instead of the grouped GEMM",
    ),
    Lever(
        "flex",
        ("model.attention_backend=flex",),
        ("cuda", "flex"),
        compiled=True,
        note="FlexAttention instead of SDPA's causal kernel",
    ),
    Lever(
        "docs-sdpa",
        ("model.document_masking=true", "model.attention_backend=sdpa"),
        compiled=True,
        note="packed documents (mean 512 tokens), one SDPA call per document",
    ),
    Lever(
        "docs-flex",
        ("model.document_masking=true", "model.attention_backend=flex"),
        ("cuda", "flex"),
        compiled=True,
        note="packed documents, FlexAttention block mask",
    ),
    Lever("recompute-selective", ("train.recompute=selective",), compiled=True),
    Lever("recompute-full", ("train.recompute=full",)),
    Lever(
        "grad-bf16",
        ("train.grad_reduce_dtype=bf16",),
        ("bf16",),
        note="gradients accumulated and reduced in bf16",
    ),
    Lever("zero-2", ("parallel.zero_stage=2",)),
    Lever(
        "micro-batch-16",
        ("train.micro_batch_size=16",),
        compiled=True,
        note="twice the tokens per step (skipped where moe-plan does not fit it)",
    ),
    Lever(
        "accum-8",
        ("train.grad_accum_steps=8",),
        note="an optimizer step of 8 micro-batches, as the presets train (tokens/s counts "
        "every micro-batch): the optimizer's cost shared by 8",
    ),
    Lever(
        "lora",
        ("bench.finetune=lora",),
        compiled=True,
        note="LoRA fine-tuning of the preset (factors on its weights, the rest frozen) as "
        "adapter runs train by default (eager blocks); also compiled: what compiling gains it",
    ),
    Lever(
        "qlora",
        ("bench.finetune=qlora",),
        compiled=True,
        note="QLoRA: LoRA on the NF4-quantised base (dequantised per product)",
    ),
    Lever(
        "experts-448",
        ("model.moe.expert_hidden=448",),
        ("unaligned-experts",),
        compiled=True,
        note="expert width a multiple of 64 (432 -> 448: 3.7% more expert FLOPs, see MFU)",
    ),
)
ABLATIONS = (
    Lever("no-compile", ("train.compile=false",), note="the CUDA default with eager blocks"),
    Lever("ce-full", ("model.cross_entropy=full",), note="the CUDA default with the full loss"),
    Lever(
        "permute-index-add",
        ("model.moe.permute=index_add",),
        ("moe",),
        note="the CUDA default with the scatter-add permutation",
    ),
    Lever(
        "adamw-foreach",
        ("train.optimizer_impl=foreach",),
        note="the CUDA default with torch's foreach AdamW",
    ),
    Lever(
        "qkv-separate",
        ("model.qkv_projection=separate",),
        note="the CUDA default with three query, key and value products",
    ),
    Lever(
        "no-flat-grads",
        ("train.flat_grad_ops=false",),
        note="the CUDA default with DeepSpeed's own gradient handling",
    ),
    Lever(
        "no-immediate-grads",
        ("train.immediate_grad_update=false",),
        ("bf16",),
        note="the CUDA default with the bf16 gradients folded after the backward",
    ),
)
"""The CUDA defaults (RunConfig.device_choices) one at a time undone: what each one is worth
on its own where the others stay. Where a setting is the device's default already (every one
of these on the CPU) the worker skips it."""
"""A new lever is one line here."""
COMBINATIONS = {
    "stack": (
        ("cuda-graphs", "ce-chunked", "adamw-fused", "qkv-fused", "flat-grads", "permute-gather"),
        "the CUDA defaults with CUDA graphs",
    ),
    "stack-no-graphs": (
        (
            "compile",
            "immediate-grads",
            "ce-chunked",
            "adamw-fused",
            "qkv-fused",
            "flat-grads",
            "permute-gather",
        ),
        "the CUDA defaults named lever by lever (the default itself on CUDA: skipped there)",
    ),
}
"""Named combinations of levers (``--levers`` also takes ``a+b+c``)."""


def lever_table() -> tuple[Lever, ...]:
    """Every lever and named combination, in priority order: ``eager`` and ``compile``, then
    the combinations, then the CUDA defaults undone one by one (ABLATIONS), then the other
    levers."""
    single = {lv.name: lv for lv in SINGLE_LEVERS}
    combos = [
        combine(name, [single[p] for p in parts], note)
        for name, (parts, note) in COMBINATIONS.items()
    ]
    return (*SINGLE_LEVERS[:2], *combos, *ABLATIONS, *SINGLE_LEVERS[2:])


LEVERS = lever_table()
"""The order is the priority."""
COMPILE = "train.compile=true"
MODELS = ("dense-125m", "moe-125m")
TINY_MODELS = ("tiny-dense", "tiny-moe")


@dataclass(frozen=True)
class Setting:
    name: str
    overrides: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    where: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = ()

    @property
    def compiled(self) -> bool:
        return COMPILE in self.overrides


def settings_of(levers) -> list[Setting]:
    """The default, each lever alone, then each ``compiled`` lever with compile."""
    out = [Setting("default")]
    out += [Setting(lv.name, lv.overrides, lv.needs, lv.where) for lv in levers]
    names = {s.name for s in out}
    out += [
        Setting(f"{lv.name}+compile", (*lv.overrides, COMPILE), lv.needs, lv.where)
        for lv in levers
        if lv.compiled and COMPILE not in lv.overrides and f"{lv.name}+compile" not in names
    ]
    return out


@dataclass
class Run:
    setting: str
    model: str
    round: int
    status: str  # ok | error | timeout | skipped | not run
    reason: str = ""
    row: dict = field(default_factory=dict)
    wall_s: float = 0.0


class Matrix:
    """Plans, admits and runs the settings (see the module docstring). ``runner.run(task,
    timeout)`` returns the worker's result, or None when it ran out of time;
    ``clock`` is a monotonic clock in seconds."""

    def __init__(
        self,
        settings: list[Setting],
        models,
        runner,
        *,
        clock,
        deadline: float,
        run_deadline: float,
        rounds: int = 3,
        steps: int = 10,
        warmup: int = 3,
        run_estimate: float = 20.0,
        compile_estimate: float = 60.0,
        on_update=lambda matrix: None,
    ):
        self.settings, self.models, self.runner, self.clock = settings, list(models), runner, clock
        self.deadline, self.run_deadline, self.rounds = deadline, run_deadline, rounds
        self.steps, self.warmup = steps, warmup
        self.run_estimate, self.compile_estimate = run_estimate, compile_estimate
        self.on_update = on_update
        self.runs: list[Run] = []
        self.applies: dict[str, list[str]] = {}
        self.skipped: dict[tuple[str, str], str] = {}
        self.not_admitted: list[str] = []
        self.admitted: list[Setting] = []
        self.profiles: list[dict] = []
        self.status = "running"
        self.next_id = 0

    def task(self, setting: Setting, model: str, **extra) -> dict:
        self.next_id += 1
        return {
            "id": self.next_id,
            "model": model,
            "overrides": list(setting.overrides),
            "needs": list(setting.needs),
            "where": [[list(o), list(n)] for o, n in setting.where],
            "steps": self.steps,
            "warmup": self.warmup,
            "label": setting.name,
            **extra,
        }

    def check(self) -> None:
        """Which models each setting applies to (no engine is built)."""
        for s in self.settings:
            self.applies[s.name] = []
            for m in self.models:
                res = self.runner.run(self.task(s, m, check=True), self.deadline - self.clock())
                if res is not None and res.get("status") == "ok":
                    self.applies[s.name].append(m)
                else:
                    self.skipped[(s.name, m)] = (res or {}).get("reason", "no answer to the check")
        self.on_update(self)

    # ---- estimates ---------------------------------------------------------------------

    def _ok(self, setting: str, model: str) -> list[Run]:
        return [
            r for r in self.runs if (r.setting, r.model) == (setting, model) and r.status == "ok"
        ]

    def base(self, model: str) -> float:
        ok = self._ok("default", model)
        return ok[-1].wall_s if ok else self.run_estimate

    def compile_cost(self, model: str) -> float:
        """What compiling added to a warm-up of ``model``, as measured so far."""
        default = self._ok("default", model)
        seen = [
            r.row.get("warmup_s", 0) - (default[0].row.get("warmup_s", 0) if default else 0)
            for s in self.settings
            if s.compiled
            for r in self._ok(s.name, model)[:1]
        ]
        return max(seen) if seen else self.compile_estimate

    def estimate(self, s: Setting, model: str, first: bool) -> float:
        ok = self._ok(s.name, model)
        if not ok:
            return self.base(model) + (self.compile_cost(model) if s.compiled and first else 0)
        last = ok[-1]
        if len(ok) == 1 and s.compiled:  # round 1 compiled; later rounds reuse the graphs
            default = self._ok("default", model)
            return last.wall_s - max(
                0.0,
                last.row.get("warmup_s", 0) - (default[0].row.get("warmup_s", 0) if default else 0),
            )
        return last.wall_s

    def admit(self, s: Setting) -> bool:
        """Round 1 of ``s`` and its later rounds fit after the later rounds already promised."""
        later = self.rounds - 1
        promised = sum(
            later * self.estimate(a, m, False) for a in self.admitted for m in self.applies[a.name]
        )  # the default's included
        cost = sum(
            self.estimate(s, m, True) + later * self.estimate(s, m, False)
            for m in self.applies[s.name]
        )
        return self.clock() + promised + cost <= self.run_deadline

    # ---- running -----------------------------------------------------------------------

    def run_one(self, s: Setting, model: str, round_: int) -> Run:
        est = self.estimate(s, model, round_ == 1)
        left = self.run_deadline - self.clock()
        if est > left:
            run = Run(
                s.name,
                model,
                round_,
                "not run",
                f"out of time ({est:.0f} s needed, {max(left, 0):.0f} s left)",
            )
        else:
            t0 = self.clock()
            res = self.runner.run(
                self.task(s, model), min(self.deadline - t0, max(3 * est, est + 60))
            )
            wall = self.clock() - t0
            if res is None:
                run = Run(s.name, model, round_, "timeout", "ended at its time limit", wall_s=wall)
            else:
                run = Run(
                    s.name,
                    model,
                    round_,
                    res.get("status", "error"),
                    res.get("reason", ""),
                    res.get("row") or {},
                    wall,
                )
        self.runs.append(run)
        self.on_update(self)
        return run

    def run(self) -> None:
        self.check()
        settings = [s for s in self.settings if self.applies[s.name]]
        if settings and settings[0].name == "default":
            next_round = self.run_rounds(settings[0], settings[1:])
            for s in settings[1:]:
                if s not in self.admitted:
                    next_round = self.spare_rounds(settings[0], s, next_round)
        self.not_admitted = [s.name for s in settings if s not in self.admitted]
        self.profile_best()
        cut = any(r.status in ("not run", "timeout") for r in self.runs)
        self.status = "out of time" if cut else "complete"
        self.on_update(self)

    def run_rounds(self, default: Setting, others: list[Setting]) -> int:
        """Round 1: the default, then each setting that admit() takes, in priority order; the
        other rounds in rotated orders. Returns the next round's number."""
        self.admitted = [default]
        for m in self.applies[default.name]:
            self.run_one(default, m, 1)
        for s in others:
            if self.admit(s):
                self.admitted.append(s)
                for m in self.applies[s.name]:
                    self.run_one(s, m, 1)
            else:
                self.not_admitted.append(s.name)
        for round_ in range(2, self.rounds + 1):
            k = (round_ - 1) % len(self.admitted)
            for s in self.admitted[k:] + self.admitted[:k]:
                for m in self.applies[s.name]:
                    if self._ok(s.name, m):  # a setting that failed in round 1 is not retried
                        self.run_one(s, m, round_)
        return self.rounds + 1

    def spare_rounds(self, default: Setting, s: Setting, first: int) -> int:
        """Time the admitted settings left: rounds of ``s`` and a default run each (alternating
        which goes first), as many as fit, up to ``rounds``. Returns the next round's number."""
        done = 0
        while done < self.rounds:
            cost = sum(self.estimate(default, m, False) for m in self.applies[default.name])
            cost += sum(self.estimate(s, m, done == 0) for m in self.applies[s.name])
            if self.clock() + cost > self.run_deadline:
                break
            for x in (default, s) if done % 2 == 0 else (s, default):
                for m in self.applies[x.name]:
                    self.run_one(x, m, first + done)
            done += 1
        if done:
            self.admitted.append(s)
            self.not_admitted.remove(s.name)
        return first + done

    def profile_best(self) -> None:
        """Each model's fastest setting, once more, under the profiler."""
        for m, row in best_settings(summary_rows(self)).items():
            best = next(s for s in self.settings if s.name == row["setting"])
            est = self.estimate(best, m, False) + 15  # + profiled steps and the trace
            if self.clock() + est > self.deadline:
                continue
            res = self.runner.run(
                self.task(best, m, profile_steps=2, sync_steps=1), self.deadline - self.clock()
            )
            if res and res.get("profile"):
                self.profiles.append(res["profile"])
                self.on_update(self)


class CutShort(Exception):
    """A signal asked the matrix to stop."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("outdir", help="where the summary, profiles and worker log go")
    p.add_argument("--budget", type=float, default=420.0, help="seconds for everything")
    p.add_argument(
        "--profile-reserve",
        type=float,
        default=75.0,  # an H200's 440 s matrix left 33 s: too few for one profile of two
        help="seconds kept for profiling the fastest settings",
    )
    p.add_argument("--levers", help="comma-separated levers, in priority order (default: all)")
    p.add_argument("--models", help="comma-separated models (default: dense-125m,moe-125m)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per run")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="the tiny models (CPU rehearsal)")
    p.add_argument("--peak-flops", type=float, help="peak FLOP/s for MFU (default: the GPU's)")
    p.add_argument(
        "--run-estimate",
        type=float,
        default=20.0,
        help="seconds one run is assumed to take until one is measured",
    )
    p.add_argument(
        "--compile-estimate",
        type=float,
        default=60.0,
        help="seconds a compile is assumed to add until one is measured",
    )
    p.add_argument("--wheels", help="the wheel folder (default: $GPU_WHEELS or gpu-wheels/)")
    p.add_argument(
        "--scratch",
        help="holds site/ (installed wheels; the proof's scratch "
        "folder has one); default: a new temporary folder",
    )
    p.add_argument("--worker-cmd", help=argparse.SUPPRESS)  # tests: a stand-in worker
    args = p.parse_args(argv)
    names = {lv.name: lv for lv in LEVERS}
    wanted = args.levers.split(",") if args.levers else list(names)
    unknown = [n for w in wanted for n in w.split("+") if n not in names]
    if unknown:
        p.error(f"--levers: unknown {', '.join(unknown)} (levers: {', '.join(names)})")
    try:
        args.lever_list = [
            names[w] if w in names else combine(w, [names[n] for n in w.split("+")]) for w in wanted
        ]
    except ValueError as e:
        p.error(f"--levers: {e}")
    args.model_list = (
        args.models.split(",") if args.models else list(TINY_MODELS if args.tiny else MODELS)
    )
    if args.rounds < 1 or args.steps < 1 or args.budget <= 0:
        p.error("--rounds and --steps must be >= 1 and --budget > 0")
    return args


def main(argv=None) -> int:
    start = time.monotonic()
    args = parse_args(argv)
    out = Path(args.outdir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    deadline = start + args.budget - 3  # the last summary is written after it

    def stop(signum, frame):
        raise CutShort(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    matrix = Matrix(
        settings_of(args.lever_list),
        args.model_list,
        None,
        clock=time.monotonic,
        deadline=deadline,
        run_deadline=deadline - args.profile_reserve,
        rounds=args.rounds,
        steps=args.steps,
        warmup=args.warmup,
        run_estimate=args.run_estimate,
        compile_estimate=args.compile_estimate,
        on_update=lambda m: report(out, m, args, start),
    )
    try:
        env = (
            dict(os.environ)
            if args.worker_cmd
            # a stand-in needs no packages
            else ensure_packages(args.scratch, args.wheels, out / "worker.log", deadline)
        )
        matrix.runner = Worker(args, env, out / "worker.log", args.worker_cmd)
        matrix.run()
    except CutShort as e:
        matrix.status = f"cut short ({e})"
    except Exception as e:  # the summary says why, whatever happened
        matrix.status = f"failed ({type(e).__name__}: {e})"
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the summary below is not interrupted
        if matrix.runner is not None:
            matrix.runner.close()
        report(out, matrix, args, start)
    print((out / "matrix.md").read_text())
    return 0 if matrix.status == "complete" else 1


def report(out: Path, matrix: Matrix, args, start: float) -> None:
    hello = getattr(matrix.runner, "hello", None) or {}
    write_summary(out, matrix, args, hello, time.monotonic() - start, args.lever_list)
    if matrix.profiles:
        write_profiles(out, matrix.profiles)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
