"""The GPU proof (benchmarks/gpu_proof.sh) in its CPU dry run, and the wheel list of
benchmarks/gpu_wheels.sh against what DeepSpeed and this project require."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from plain_settings import EAGER  # noqa: E402

PROOF = ROOT / "benchmarks" / "gpu_proof.sh"
WHEELS_SCRIPT = ROOT / "benchmarks" / "gpu_wheels.sh"
# What the GPU machine has besides Python 3.12 (docs/gpu.md): a CUDA torch, pyarrow,
# sentencepiece, tensorboard, mpi4py, transformers; numpy comes with them.
GPU_MACHINE_HAS = {
    "torch",
    "pyarrow",
    "sentencepiece",
    "tensorboard",
    "mpi4py",
    "transformers",
    "numpy",
}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def make_wheel(folder: Path, name: str, version: str, module: str | None = None) -> Path:
    """A minimal pure-Python wheel: one module and one script (``NAME.data/scripts``)."""
    module = module or norm(name)
    dist = f"{norm(name)}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    files = {
        f"{module}/__init__.py": f"__version__ = {version!r}\n",
        f"{dist}.data/scripts/{module}-hello": "#!/bin/sh\necho hello\n",
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = "".join(f"{f},,\n" for f in files) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for f, text in files.items():
            info = zipfile.ZipInfo(f)
            info.external_attr = (0o100755 if "/scripts/" in f else 0o100644) << 16
            z.writestr(info, text)
        z.writestr(f"{dist}.dist-info/RECORD", record)
    return path


def run_proof(out: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(PROOF), str(out), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.integration
def test_dry_run_on_the_cpu_runs_every_part(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "gpu-proof-probe", "1.0")  # missing here: installed into the target
    make_wheel(wheels, "PyYAML", "0.0.1", module="yaml")  # present: must not shadow the real one
    make_wheel(wheels, "torch", "0.0.1")  # never installed, whatever the folder holds
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    proc = run_proof(
        out, "--dry-run", "--device", "cpu", "--wheels", str(wheels), "--scratch", str(scratch)
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]

    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(
        [
            "summary.md",
            "summary.json",
            "install.log",
            "env.log",
            "pytest.log",
            "bench.log",
            "train.log",
            "eval.log",
            "profile.md",
            "profile.json",
        ]
    )
    summary = json.loads((out / "summary.json").read_text())
    parts = {p["name"]: p for p in summary["parts"]}
    assert summary["ok"] and list(parts) == ["install", "env", "pytest", "bench", "train", "eval"]
    assert all(p["status"] == "pass" for p in parts.values()), parts

    # install: only the missing wheel, into the target with its script; torch refused.
    assert parts["install"]["figures"]["installed"] == ["gpu_proof_probe"]
    assert (scratch / "site" / "gpu_proof_probe" / "__init__.py").exists()
    assert os.access(scratch / "site" / "bin" / "gpu_proof_probe-hello", os.X_OK)
    assert not (scratch / "site" / "torch").exists() and not (scratch / "site" / "yaml").exists()
    assert "refused" in (out / "install.log").read_text()

    env = parts["env"]["figures"]
    assert env["cuda_available"] is False and env["deepspeed_accelerator"] == "cpu"
    assert env["torch"] == parts["install"]["figures"]["torch"]

    # pytest -m gpu collected the GPU tests, and each skipped without CUDA.
    assert parts["pytest"]["figures"]["skipped"] >= 9 and "passed" not in parts["pytest"]["figures"]

    rows = parts["bench"]["figures"]["rows"]
    assert [r["model"] for r in rows] == ["tiny-dense", "tiny-moe"]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    # Then the same models with the plain settings: their own rows, and the default's ratio to
    # each (on the CPU the device chooses the plain settings but foreach AdamW: two runs alike).
    eager = parts["bench"]["figures"]["eager_rows"]
    assert [r["model"] for r in eager] == ["tiny-dense", "tiny-moe"]
    ratios = parts["bench"]["figures"]["default_over_eager"]
    for e, r in zip(eager, rows):
        assert ratios[e["model"]] == pytest.approx(r["tokens_per_s"] / e["tokens_per_s"], rel=1e-2)
    assert " ".join(f"--set {o}" for o in EAGER) in (out / "bench.log").read_text()
    assert "default / eager" in (out / "summary.md").read_text()
    # A step profile of each model, default and eager, and a line of each in the summary.
    entries = json.loads((out / "profile.json").read_text())["entries"]
    assert [(e["model"], e["setting"]) for e in entries] == [
        (m, s) for s in ("default", "eager") for m in ("tiny-dense", "tiny-moe")
    ]
    assert "| tiny-moe | eager |" in (out / "summary.md").read_text()

    train = parts["train"]["figures"]
    assert train["steps"] == 4 and train["checkpoint"].endswith("step_0000004")
    assert math.isfinite(train["last_loss"])
    assert "bf16" in (scratch / "runs" / "gpu-proof" / "config.yaml").read_text()

    ev = parts["eval"]["figures"]
    assert ev["tokens"] == 512 and math.isfinite(ev["loss"]) and ev["loss"] < math.log(512) + 0.5
    assert "# GPU proof: PASS" in (out / "summary.md").read_text()


def test_a_part_that_cannot_run_fails_the_proof_and_the_summary_is_still_written(tmp_path):
    """With no time at all every part is skipped: exit status 1, all files written."""
    out = tmp_path / "out"
    proc = run_proof(
        out,
        "--dry-run",
        "--device",
        "cpu",
        "--budget",
        "1",
        "--scratch",
        str(tmp_path / "scratch"),
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert not summary["ok"] and {p["status"] for p in summary["parts"]} == {"skipped"}
    assert len(list(out.iterdir())) == 8
    assert "# GPU proof: FAIL" in (out / "summary.md").read_text()


def test_the_output_directory_must_hold_nothing_else(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    proc = run_proof(out, "--dry-run", "--device", "cpu", timeout=120)
    assert proc.returncode == 2 and "notes.txt" in proc.stderr


def wheel_pins() -> dict[str, str]:
    text = WHEELS_SCRIPT.read_text()
    block = re.search(r"^WHEELS=\((.*?)^\)", text, flags=re.S | re.M).group(1)
    pins = dict(re.findall(r"^\s+([A-Za-z0-9_.-]+)==(\S+)", block, flags=re.M))
    pins.update(dict(re.findall(r"^DEEPSPEED=(\S+)==(\S+)", text, flags=re.M)))
    return {norm(k): v for k, v in pins.items()}


def requirements(dist: str) -> set[str]:
    """The distributions ``dist`` requires on Linux with Python 3.12 (no extras)."""
    from packaging.requirements import Requirement

    where = {
        "python_version": "3.12",
        "python_full_version": "3.12.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "extra": "",
    }
    out = set()
    for text in metadata.requires(dist) or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate(where):
            out.add(norm(req.name))
    return out


def install_requires() -> list[str]:
    """setup.py's install_requires (the extras are not installed on the GPU machine)."""
    import ast

    for node in ast.walk(ast.parse((ROOT / "setup.py").read_text())):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            return [ast.literal_eval(e) for e in node.value.elts]
    raise AssertionError("setup.py has no install_requires list")


def test_the_wheel_folder_covers_what_the_gpu_machine_lacks():
    """Every requirement of this project, of DeepSpeed and of what the folder brings is either
    on the GPU machine (its packages and what they require) or pinned in gpu_wheels.sh (mpich
    is left out on purpose: the machine's mpi4py brings its own MPI)."""
    pins = wheel_pins()
    assert pins["deepspeed"] == "0.19.8"
    ours = {norm(r) for r in install_requires()}
    assert {"torch", "deepspeed", "zstandard", "matplotlib"} <= ours
    there = {norm(n) for n in GPU_MACHINE_HAS}
    there |= set().union(*(requirements(n) for n in GPU_MACHINE_HAS))
    needed, todo = set(), (ours - {"mpich"}) | {"pytest", "pytest_timeout", "pytest_xdist"}
    while todo:  # what the folder must bring, and what that requires in turn
        name = todo.pop()
        needed.add(name)
        if name not in there:
            todo |= requirements(name) - needed
    uncovered = needed - set(pins) - there
    assert not uncovered, f"add to benchmarks/gpu_wheels.sh: {sorted(uncovered)}"
    assert not {"torch", "triton"} & set(pins)
    assert not [n for n in pins if n.startswith("nvidia_")]


def test_the_wheel_folder_is_ignored_by_git_and_found_by_the_proof():
    assert "/gpu-wheels/" in (ROOT / ".gitignore").read_text().splitlines()
    assert "$ROOT/gpu-wheels" in WHEELS_SCRIPT.read_text()
    assert 'ROOT / "gpu-wheels"' in (ROOT / "benchmarks" / "gpu_proof.py").read_text()


def load_proof_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_proof", ROOT / "benchmarks" / "gpu_proof.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def proof_args(gp, tmp_path, scratch=None):
    """The arguments of a CPU proof that writes into ``tmp_path``."""
    return gp.argparse.Namespace(
        outdir=str(tmp_path / "out"),
        scratch=str(scratch or tmp_path / "s"),
        budget=60.0,
        device="cpu",
        dry_run=False,
        wheels=None,
    )


def run_part(gp, proof, name: str, runner):
    """Part ``name`` of ``proof`` with ``runner`` in place of its commands: (status, part)."""
    proof.run = runner
    part = gp.Part(name, log=f"{name}.log")
    proof.out.mkdir(parents=True, exist_ok=True)
    with open(proof.out / part.log, "w") as log:
        return getattr(proof, name)(part, log, 60.0), part


def test_a_second_proof_in_the_same_scratch_trains_a_run_of_its_own(tmp_path):
    """On a warm machine the scratch folder still holds the last proof's finished run; resuming
    it would train nothing and the train part would pass on no evidence."""
    gp = load_proof_module()
    scratch = tmp_path / "scratch"
    args = proof_args(gp, tmp_path, scratch)
    assert gp.Proof(args).run_name() == "gpu-proof"
    (scratch / "runs" / "gpu-proof").mkdir(parents=True)
    (scratch / "runs" / "gpu-proof-2").mkdir()
    proof = gp.Proof(args)
    assert "name=gpu-proof-3" in proof.train_overrides()


def test_the_gpu_tests_run_on_several_workers_where_xdist_imports(tmp_path, monkeypatch):
    """pytest -m gpu on PYTEST_WORKERS workers, a file's tests on one, when the proof's Python
    (with the installed wheels) imports pytest-xdist, serially when it does not or when every
    test skips (on the CPU); the log says each test's time either way."""
    gp = load_proof_module()
    args = proof_args(gp, tmp_path)
    cmd = gp.Proof(args).pytest_command()
    assert "-n" not in cmd and "--durations=0" in cmd
    args.device = "cuda"  # what the command is on a GPU (nothing runs here)
    proof = gp.Proof(args)
    cmd = proof.pytest_command()  # this Python has pytest-xdist (the test extra)
    assert cmd[cmd.index("-n") + 1] == str(gp.PYTEST_WORKERS) and "loadgroup" in cmd
    assert "--durations=0" in cmd and "-m" in cmd and "gpu" in cmd
    (tmp_path / "s" / "site").mkdir(parents=True)  # a wheel folder without xdist, shadowing it
    (tmp_path / "s" / "site" / "xdist.py").write_text("raise ImportError('no xdist here')\n")
    cmd = proof.pytest_command()
    assert "-n" not in cmd and "--durations=0" in cmd


def test_the_train_part_fails_when_the_run_logged_no_step(tmp_path):
    """A run that exits 0 with a checkpoint but no logged step (it resumed a finished run) is
    not a pass."""
    gp = load_proof_module()
    args = proof_args(gp, tmp_path)
    proof = gp.Proof(args)

    def finished_run(part, cmd, log, limit, env=None):
        run_dir = proof.scratch / "runs" / proof.train_name
        run_dir.mkdir(parents=True)
        (run_dir / "train_summary.json").write_text(
            json.dumps(
                {
                    "steps": 100,
                    "checkpoint": str(run_dir / "checkpoints" / "step_0000100"),
                    "history": [],
                }
            )
        )
        return 0

    status, part = run_part(gp, proof, "train", finished_run)
    assert status == "fail"
    assert part.note == "the run logged no training step"


@pytest.mark.parametrize("eager_rc, status", [(0, "pass"), (None, "pass"), (1, "fail")])
def test_the_bench_part_runs_the_models_eager_and_only_a_failure_fails_it(
    tmp_path, eager_rc, status
):
    """The run with the plain settings after the device's defaults: the defaults' ratios to it
    are reported; running out of the part's time is noted (it takes what the tests and the
    first run left), an eager run that fails is a failure."""
    gp = load_proof_module()
    args = proof_args(gp, tmp_path)
    proof = gp.Proof(args)
    proof.scratch.mkdir(parents=True, exist_ok=True)
    commands = []

    def bench_run(part, cmd, log, limit, env=None):
        commands.append(cmd)
        eager = "train.compile=false" in cmd
        rows = [{"model": "m", "tokens_per_s": 100.0 if eager else 150.0}]
        if eager and eager_rc is None:
            return None  # out of time before writing its rows
        Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps({"rows": rows}))
        return eager_rc if eager else 0

    got, part = run_part(gp, proof, "bench", bench_run)
    assert got == status
    assert len(commands) == 2 and "--set" not in commands[0]
    second = commands[1]
    assert [second[i + 1] for i, a in enumerate(second) if a == "--set"] == list(EAGER)
    assert second[second.index("--label") + 1] == "eager"
    assert all(c[c.index("--profile-out") + 1] == str(proof.out) for c in commands)
    if eager_rc == 0:
        assert part.figures["default_over_eager"] == {"m": 1.5} and not part.note
    if eager_rc is None:
        assert part.note == "the eager run ran out of the part's time"
        assert "default_over_eager" not in part.figures


def test_a_failed_step_profile_fails_the_bench_part_and_keeps_its_rows(tmp_path):
    """Profiles are part of what the proof shows: a model whose profile failed fails the bench
    part, named with the error, and the timed rows stay in the figures."""
    gp = load_proof_module()
    proof = gp.Proof(proof_args(gp, tmp_path))
    proof.scratch.mkdir(parents=True, exist_ok=True)

    def bench_run(part, cmd, log, limit, env=None):
        eager = "train.compile=false" in cmd
        rows = [
            {"model": "a", "tokens_per_s": 100.0, "profile_error": None},
            {"model": "b", "tokens_per_s": 90.0, "profile_error": "E: x" if not eager else None},
        ]
        Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps({"rows": rows}))
        return 0

    status, part = run_part(gp, proof, "bench", bench_run)
    assert status == "fail"
    assert part.note == "step profile failed: b: E: x"
    assert [r["tokens_per_s"] for r in part.figures["rows"]] == [100.0, 90.0]
    assert part.figures["default_over_eager"] == {"a": 1.0, "b": 1.0}


@pytest.mark.parametrize("finished", [["m1"], []])
def test_a_first_bench_pass_cut_by_time_keeps_the_models_it_finished(tmp_path, finished):
    """The device's defaults compile each model's blocks on CUDA: a bench pass that runs out of
    the part's time after some models keeps and notes them (no eager pass is started then);
    one that finished none fails the part."""
    gp = load_proof_module()
    proof = gp.Proof(proof_args(gp, tmp_path))
    proof.scratch.mkdir(parents=True, exist_ok=True)
    commands = []

    def bench_run(part, cmd, log, limit, env=None):
        commands.append(cmd)
        if finished:
            rows = [{"model": m, "tokens_per_s": 100.0} for m in finished]
            Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps({"rows": rows}))
        return None  # out of time

    status, part = run_part(gp, proof, "bench", bench_run)
    assert len(commands) == 1
    if finished:
        assert status == "pass" and part.note == "the bench ran out of the part's time after m1"
    else:
        assert status != "pass" and not part.figures.get("rows")
