"""The whole GPU proof in one command, for a machine that has a CUDA torch but no DeepSpeed and
no package index (docs/gpu.md). Run it through ``benchmarks/gpu_proof.sh``:

    bash benchmarks/gpu_proof.sh OUTDIR                          # on the GPU machine
    bash benchmarks/gpu_proof.sh OUTDIR --dry-run --device cpu   # every part, tiny, on the CPU

Parts, in order, each with its own log in OUTDIR and a time limit inside ``--budget`` seconds
(540 by default: the whole proof ends within 9 minutes):

1. install  the wheels of ``gpu-wheels/`` (benchmarks/gpu_wheels.sh) that this Python lacks,
            with ``pip install --no-index --no-deps --target SCRATCH/site``; they reach every
            later part through PYTHONPATH, so the preinstalled torch is never touched (checked)
2. env      GPU, driver, Python, torch, CUDA, cuDNN, NCCL, DeepSpeed and its accelerator
3. pytest   ``pytest -m gpu`` (on the CPU every test skips: the command itself is the check),
            on PYTEST_WORKERS workers when pytest-xdist imports (one file's tests on one
            worker: the GPU is shared, the compiles and launches are host work), with each
            test's time in the log
4. bench    ``benchmarks/gpu_train_bench.py``: tokens/s, MFU, peak memory against moe-plan,
            where a step's time goes (a step profile per model: profile.md, profile.json),
            with the settings the device chooses (on CUDA its defaults: compiled blocks and
            the rest, RunConfig.device_choices); then the same models with the plain settings
            (benchmarks/plain_settings.py, as on the CPU; one run each: eager tokens/s,
            default / eager and their profiles; an eager run that runs out of the part's time
            is noted, not failed, and keeps the models it finished)
5. train    the default config (configs/default.yaml) on one rank for 100 steps in bf16
            through ``moe-launch`` (the real deepspeed launcher, started as
            ``python -m deepspeed.launcher.runner``: no ``deepspeed`` script on PATH needed)
6. eval     ``moe-eval`` of that checkpoint on the CPU (CUDA hidden)

OUTDIR gets at most 10 files: ``summary.md``, ``summary.json``, ``profile.md`` and
``profile.json`` (the bench part's step profiles) plus one log per part. The
exit status is 0 only if every part passed; a part that fails or runs out of time does not
stop the later ones. ``--dry-run`` runs every part at tiny sizes (a few steps of a tiny model on
a small corpus); ``--device cpu`` hides CUDA from every part. Imports only the standard library:
what it checks runs in subprocesses.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_install import (  # noqa: E402
    choose_wheels,
    import_check,
    install_wheels,
    probe_environment,
)
from gpu_proof_summary import write_summary  # noqa: E402
from plain_settings import EAGER  # noqa: E402

MAX_FILES = 10
PYTEST_WORKERS = 3
"""pytest -m gpu's workers: its two large files each on one, the small ones on the third."""
OUT_FILES = ("summary.md", "summary.json", "profile.md", "profile.json")
"""Besides one log per part (the profiles come from the bench part)."""
# Time limits (s) of each part, and the least each later part is left when an earlier one runs
# long. They add up to more than the budget on purpose: a part that finishes early leaves its
# time to the next.
CAPS = {"install": 90, "env": 60, "pytest": 300, "bench": 270, "train": 240, "eval": 120}
FLOORS = {"install": 20, "env": 15, "pytest": 60, "bench": 45, "train": 90, "eval": 30}
TRAIN_STEPS = 100
STDLIB_DOCS = [
    "argparse",
    "textwrap",
    "shlex",
    "string",
    "heapq",
    "bisect",
    "functools",
    "dataclasses",
    "enum",
    "fractions",
    "calendar",
    "difflib",
]


@dataclass
class Part:
    name: str
    status: str = "not run"  # pass | fail | timeout | skipped
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    """CPU time of the part's subprocesses (user + system): on a busy machine a steadier
    measure of its cost than the wall time."""
    log: str = ""
    figures: dict = field(default_factory=dict)
    note: str = ""


class Proof:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.outdir).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.scratch = Path(args.scratch or tempfile.mkdtemp(prefix="gpu_proof_")).resolve()
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.site = self.scratch / "site"
        self.deadline = time.monotonic() + args.budget
        self.parts: list[Part] = []
        self.python = sys.executable
        self.cuda = args.device == "cuda"
        self.checkpoint: str | None = None
        self.train_name: str | None = None
        self.no_cuda = False
        """Set when the env part found no CUDA device under --device cuda: the GPU parts
        after it are skipped rather than left to fail slowly."""

    # ---- running commands -------------------------------------------------------------------

    def env(self, hide_cuda: bool = False) -> dict:
        env = dict(os.environ)
        paths = [str(self.site), str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(":") if p]
        env["PYTHONPATH"] = ":".join(paths)
        env["PATH"] = f"{self.site / 'bin'}:{env.get('PATH', '')}"
        env["PYTHONUNBUFFERED"] = "1"
        if hide_cuda or not self.cuda:
            env["CUDA_VISIBLE_DEVICES"] = ""
        return env

    def time_left(self, name: str) -> float:
        """This part's limit: its cap, less what the parts after it are owed."""
        names = list(CAPS)
        owed = sum(FLOORS[n] for n in names[names.index(name) + 1 :])
        return min(CAPS[name], self.deadline - time.monotonic() - owed)

    def run(
        self,
        part: Part,
        cmd: list[str],
        log,
        timeout: float,
        env: dict | None = None,
        cwd: Path = ROOT,
    ) -> int | None:
        """Run ``cmd`` with its output appended to ``log``; None when it ran out of time (its
        whole process group is then ended)."""
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        started = time.time()
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env or self.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            log.write(f"\n[gpu_proof] ended after {timeout:.0f} s: out of time\n")
            for lock in stale_build_locks(started):
                lock.unlink(missing_ok=True)
                log.write(f"[gpu_proof] removed {lock}: left by the ended build\n")
            return None
        log.write(f"[gpu_proof] exit status {rc}\n")
        log.flush()
        return rc

    def part(self, name: str, body) -> Part:
        part = Part(name, log=f"{name}.log")
        limit = self.time_left(name)
        t0, c0 = time.monotonic(), os.times()
        with open(self.out / part.log, "w") as log:
            if limit < 5 or (self.no_cuda and name in ("pytest", "bench", "train")):
                part.status = "skipped"
                part.note = "no time left in the budget" if limit < 5 else "no CUDA device"
                log.write(f"[gpu_proof] {name}: skipped, {part.note}\n")
            else:
                try:
                    part.status = body(part, log, limit)
                except Exception as e:  # a bug here must not hide the other parts' results
                    part.status, part.note = "fail", f"{type(e).__name__}: {e}"
                    log.write(f"\n[gpu_proof] {name}: {part.note}\n")
        part.seconds = time.monotonic() - t0
        c1 = os.times()
        part.cpu_seconds = (
            c1.children_user - c0.children_user + c1.children_system - c0.children_system
        )
        self.parts.append(part)
        print(
            f"[gpu_proof] {name:<8} {part.status:<8} {part.seconds:6.1f} s "
            f"({part.cpu_seconds:.1f} s CPU)" + (f"  ({part.note})" if part.note else ""),
            flush=True,
        )
        return part

    @staticmethod
    def status_of(rc: int | None) -> str:
        return "timeout" if rc is None else "pass" if rc == 0 else "fail"

    # ---- 1. install -------------------------------------------------------------------------

    def install(self, part: Part, log, limit: float) -> str:
        wheels_dir = Path(self.args.wheels or os.environ.get("GPU_WHEELS") or ROOT / "gpu-wheels")
        log.write(f"target: {self.site}\n")
        chosen = choose_wheels(wheels_dir, log)
        rc = install_wheels(
            self.python,
            self.site,
            chosen,
            log,
            lambda cmd, env: self.run(part, cmd, log, limit, env=env),
        )
        part.figures["installed"] = [w.name.split("-")[0] for w in chosen]
        if rc != 0:
            part.note = "pip install failed" if rc is not None else "out of time"
            return self.status_of(rc)
        # Every module the project needs imports, and torch is still the machine's own.
        found, output = import_check(self.python, self.env(), ROOT, max(limit, 30))
        log.write(output)
        if found is None:
            part.note = "the import check did not run"
            return "fail"
        log.write("\nmodule        version        from\n")
        for m, (version, where) in found.items():
            log.write(f"{m:<13} {str(version):<14} {where}\n")
        missing = [m for m, (v, _) in found.items() if v is None]
        shadowed = str(self.site) in str(found.get("torch", [None, ""])[1])
        part.figures.update(
            {"missing": missing, "deepspeed": found["deepspeed"][0], "torch": found["torch"][0]}
        )
        if shadowed:
            part.note = "torch would be imported from the wheel folder"
            return "fail"
        if missing:
            part.note = "cannot import " + ", ".join(missing)
            return "fail"
        return "pass"

    # ---- 2. env ------------------------------------------------------------------------------

    def environment(self, part: Part, log, limit: float) -> str:
        if shutil.which("nvidia-smi"):
            self.run(part, ["nvidia-smi"], log, 30)
            self.run(
                part,
                [
                    "nvidia-smi",
                    "--query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm",
                    "--format=csv",
                ],
                log,
                30,
            )
            try:
                driver = subprocess.run(
                    ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=30,
                ).stdout.split()
                part.figures["driver"] = driver[0] if driver else None
            except (OSError, subprocess.SubprocessError):
                part.figures["driver"] = None
        else:
            log.write("nvidia-smi: not found\n")
        info, output = probe_environment(self.python, self.env(), ROOT, max(limit - 5, 10))
        log.write(output)
        if info is None:
            part.note = "the environment probe failed"
            return "fail"
        part.figures.update(info)
        log.write("\n" + "\n".join(f"{k:<22} {v}" for k, v in info.items()) + "\n")
        if self.cuda and not info["cuda_available"]:
            part.note = "--device cuda, but torch sees no CUDA device"
            self.no_cuda = True
            return "fail"
        if self.cuda and info["deepspeed_accelerator"] != "cuda":
            part.note = f"DeepSpeed chose the {info['deepspeed_accelerator']} accelerator"
            return "fail"
        return "pass"

    # ---- 3. pytest ---------------------------------------------------------------------------

    def pytest_command(self) -> list[str]:
        """``pytest -m gpu``, verbose (a log cut at the part's limit still says what passed)
        with every test's time; on a GPU, on PYTEST_WORKERS workers where pytest-xdist
        imports (one file's tests on one worker, so a module fixture is built once); on the
        CPU, where every test skips, serially."""
        cmd = [self.python, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-v", "-rA"]
        cmd += ["--durations=0", "--durations-min=1"]
        if not self.cuda:
            return cmd
        probe = subprocess.run(
            [self.python, "-c", "import xdist"],
            env=self.env(),
            capture_output=True,
            timeout=60,
        )
        if probe.returncode == 0:
            cmd += ["-n", str(PYTEST_WORKERS), "--dist", "loadgroup"]
        return cmd

    def pytest(self, part: Part, log, limit: float) -> str:
        rc = self.run(part, self.pytest_command(), log, limit)
        log.flush()
        text = (self.out / part.log).read_text(errors="replace")
        summary = [
            ln
            for ln in text.splitlines()
            if re.search(r"\d+ (passed|failed|skipped|deselected|errors?)\b", ln)
        ]
        if summary:  # pytest's closing line, e.g. "9 passed, 1070 deselected in 80.1s"
            part.figures.update(
                {
                    k: int(n)
                    for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", summary[-1])
                }
            )
            part.figures["result"] = summary[-1].strip("= ")
        counts = part.figures
        status = self.status_of(rc)
        if status == "pass" and self.cuda and not counts.get("passed"):
            part.note = "no test ran on the GPU"
            return "fail"
        return status

    # ---- 4. bench ----------------------------------------------------------------------------

    def bench(self, part: Part, log, limit: float) -> str:
        """The bench's runs; a step profile that failed fails the part, the timed rows kept."""
        status = self.bench_runs(part, log, limit)
        failed = [
            f"{r['model']}{' eager' if eager else ''}: {r['profile_error']}"
            for eager, key in ((False, "rows"), (True, "eager_rows"))
            for r in part.figures.get(key, [])
            if r.get("profile_error")
        ]
        if failed:
            part.note = "; ".join(
                filter(None, [part.note, "step profile failed: " + "; ".join(failed)])
            )
            return "fail"
        return status

    def bench_runs(self, part: Part, log, limit: float) -> str:
        rows = self.scratch / "bench.json"
        cmd = [
            self.python,
            "benchmarks/gpu_train_bench.py",
            "--device",
            self.args.device,
            "--profile-out",
            str(self.out),
        ]  # profile.md and profile.json
        if self.args.dry_run:
            cmd += ["--tiny", "--steps", "2", "--warmup", "1", "--profile-steps", "1"]
        if not self.cuda:
            cmd += ["--peak-flops", "1e12"]  # a nominal peak: the MFU column is a smoke value
        t0 = time.monotonic()
        rc = self.run(part, cmd + ["--json", str(rows)], log, limit)
        if rows.exists():
            part.figures.update(json.loads(rows.read_text()))
        if rc is None and part.figures.get("rows"):
            # On CUDA each model compiles its blocks first: a short budget measures the first
            # models (the 125M pair) and notes the rest, as the eager pass below does.
            done = ", ".join(r["model"] for r in part.figures["rows"])
            part.note = f"the bench ran out of the part's time after {done}"
            return "pass"
        if rc != 0:
            return self.status_of(rc)
        # The same models with the plain settings (eager blocks and the rest, as on the CPU):
        # one run, so a ratio of the device's defaults to them to read, not a result.
        eager = self.scratch / "bench_eager.json"
        plain = [a for o in EAGER for a in ("--set", o)]
        rc = self.run(
            part,
            cmd + ["--json", str(eager), "--label", "eager", *plain],
            log,
            limit - (time.monotonic() - t0),
        )
        if eager.exists():
            default = {r["model"]: r["tokens_per_s"] for r in part.figures.get("rows", [])}
            erows = json.loads(eager.read_text())["rows"]
            part.figures["eager_rows"] = erows
            part.figures["default_over_eager"] = {
                r["model"]: round(default[r["model"]] / r["tokens_per_s"], 3)
                for r in erows
                if default.get(r["model"]) and r["tokens_per_s"]
            }
        if rc is None:
            # The second pass takes what the budget has left after the tests and the first:
            # running short of it is noted, not failed; an eager run that fails is a failure.
            part.note = "the eager run ran out of the part's time"
            return "pass"
        return self.status_of(rc)

    # ---- 5. train ----------------------------------------------------------------------------

    def run_name(self) -> str:
        """A run of its own for each proof: a scratch folder reused from an earlier proof on the
        same machine holds that proof's finished run, which the launcher would resume at its
        last step and so train nothing."""
        runs = self.scratch / "runs"
        name, n = "gpu-proof", 1
        while (runs / name).exists():
            n += 1
            name = f"gpu-proof-{n}"
        return name

    def train_overrides(self) -> list[str]:
        runs = self.scratch / "runs"
        self.train_name = self.train_name or self.run_name()
        over = [
            f"name={self.train_name}",
            f"output_dir={runs}",
            "parallel.world_size=1",
            "parallel.expert_parallel_size=1",
            "train.precision=bf16",
            "logging.peak_flops_per_device=null",  # the device's own peak (MFU)
            f"train.max_steps={TRAIN_STEPS}",
            f"checkpoint.every_n_steps={TRAIN_STEPS}",
        ]
        if self.args.dry_run:
            corpus = write_corpus(self.scratch / "corpus")
            over += [
                f"data.dir={self.scratch / 'data'}",
                "data.sources=[{name: docs, type: text, paths: [" + json.dumps(str(corpus)) + "]}]",
                "data.tokenizer.vocab_size=512",
                "data.valid_fraction=0.2",
                "data.shard_tokens=20000",
                "data.seq_len=32",
                "model.d_model=64",
                "model.n_layers=2",
                "model.n_heads=4",
                "model.max_seq_len=64",
                "model.moe.num_experts=4",
                "model.moe.expert_hidden=64",
                "model.moe.router.top_k=2",
                "train.max_steps=4",
                "train.micro_batch_size=2",
                "train.warmup_steps=1",
                "train.threads_per_rank=1",
                "logging.log_every=1",
                "checkpoint.every_n_steps=4",
                "eval.batch_size=2",
            ]
        return over

    def train(self, part: Part, log, limit: float) -> str:
        cmd = [
            self.python,
            "-m",
            "launch.launch",
            "configs/default.yaml",
            *self.train_overrides(),
            "--no-eval",
        ]
        rc = self.run(part, cmd, log, limit)
        summary_path = self.scratch / "runs" / self.train_name / "train_summary.json"
        if summary_path.exists():
            summary = json.loads(summary_path.read_text())
            history = summary["history"]
            self.checkpoint = summary.get("checkpoint")
            part.figures.update(
                steps=summary["steps"],
                checkpoint=self.checkpoint,
                first_loss=history[0]["loss"] if history else None,
                last_loss=history[-1]["loss"] if history else None,
            )
            rates = [h["tokens_per_s"] for h in history[1:]] or [h["tokens_per_s"] for h in history]
            if rates:
                part.figures["tokens_per_s_median"] = sorted(rates)[len(rates) // 2]
            log.flush()
            mfu = re.findall(r"\| MFU ([\d.]+)%", (self.out / part.log).read_text(errors="replace"))
            if mfu:  # the trainer's own figure on its last logged step (bf16 peak of the device)
                part.figures["mfu_last"] = float(mfu[-1]) / 100
            log.write(f"\ntrain_summary.json:\n{summary_path.read_text()}\n")
        status = self.status_of(rc)
        if status == "pass" and not self.checkpoint:
            part.note = "no checkpoint was written"
            return "fail"
        if status == "pass" and part.figures.get("last_loss") is None:
            part.note = "the run logged no training step"
            return "fail"
        return status

    # ---- 6. eval -----------------------------------------------------------------------------

    def evaluate(self, part: Part, log, limit: float) -> str:
        checkpoint = self.checkpoint
        if not checkpoint:
            part.note = "no checkpoint from the training part"
            return "skipped"
        out = self.scratch / "eval"
        cmd = [
            self.python,
            "-m",
            "launch.evaluate",
            checkpoint,
            "--device",
            "cpu",
            "--output",
            str(out),
        ]
        if self.args.dry_run:
            cmd += [
                "--max-tokens",
                "512",
                "--num-prompts",
                "1",
                "--max-new-tokens",
                "4",
                "--strategy",
                "greedy",
            ]
        rc = self.run(part, cmd, log, limit, env=self.env(hide_cuda=True))
        result = out / "eval.json"
        if result.exists():
            first = json.loads(result.read_text())["checkpoints"][0]
            part.figures.update({k: first.get(k) for k in ("loss", "perplexity", "tokens")})
            report = out / "report.md"
            if report.exists():
                log.write(f"\n{report.name}:\n{report.read_text()}\n")
        status = self.status_of(rc)
        loss = part.figures.get("loss")
        if status == "pass" and not (isinstance(loss, (int, float)) and loss == loss):
            part.note = "no finite validation loss"
            return "fail"
        return status


def write_corpus(root: Path) -> Path:
    """A small real corpus for the dry run: docstrings of a few standard-library modules."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    root.mkdir(parents=True, exist_ok=True)
    for name in STDLIB_DOCS:
        tree = ast.parse((stdlib / f"{name}.py").read_text(encoding="utf-8"))
        docs = [
            ast.get_docstring(n)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))
        ]
        (root / f"{name}.txt").write_text("\n\n".join(d for d in docs if d), encoding="utf-8")
    return root


def stale_build_locks(since: float) -> list[Path]:
    """The lock files of torch's just-in-time extension builds created since ``since``. On a CPU
    DeepSpeed compiles a small op the first time a torch version meets it; a part ended in the
    middle of that build leaves its lock behind, and every later build of the op would wait on
    it for ever."""
    root = Path(
        os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    )
    if not root.is_dir():
        return []
    return [lock for lock in root.glob("**/lock") if lock.stat().st_mtime >= since - 1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "outdir",
        nargs="?",
        default=os.environ.get("GPU_PROOF_OUT"),
        help="where the summary and logs go (or $GPU_PROOF_OUT)",
    )
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu hides CUDA from every part (default: cuda)",
    )
    p.add_argument("--dry-run", action="store_true", help="every part at tiny sizes")
    p.add_argument("--wheels", help="the wheel folder (default: $GPU_WHEELS or gpu-wheels/)")
    p.add_argument("--scratch", help="installed wheels, data, runs (default: a new temp dir)")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for all parts")
    args = p.parse_args(argv)
    if not args.outdir:
        p.error("give OUTDIR (or set GPU_PROOF_OUT)")
    proof = Proof(args)
    stray = [
        f for f in proof.out.iterdir() if f.name not in {*OUT_FILES, *(f"{n}.log" for n in CAPS)}
    ]
    if stray:
        p.error(
            f"{proof.out} holds other files ({', '.join(f.name for f in stray[:5])}): "
            f"give an empty or new directory"
        )
    proof.part("install", proof.install)
    proof.part("env", proof.environment)
    proof.part("pytest", proof.pytest)
    proof.part("bench", proof.bench)
    proof.part("train", proof.train)
    proof.part("eval", proof.evaluate)
    ok = write_summary(proof.out, args, proof.parts, proof.scratch)
    assert len(list(proof.out.iterdir())) <= MAX_FILES
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
