"""The GPU training benchmark's CPU smoke mode runs through the real engine and prints its
table (GPU figures come from running it on a GPU; see BENCHMARKS.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_tiny_mode_prints_the_table():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_train_bench.py", "--device", "cpu", "--tiny",
         "--steps", "2", "--warmup", "1", "--profile-steps", "1", "--peak-flops", "1e12"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("model"))
    columns = ["attention", "expert GEMMs", "dispatch", "dense FFN", "optimizer"]
    for c in ["tok/s", "MFU", "peak MiB", "plan MiB", *columns]:
        assert c in lines[head]
    rows = {}
    for line in lines[head + 2:head + 4]:
        f = line.split()
        rows[f[0]] = {"tok/s": float(f[2].replace(",", "")), "mfu": f[3], "peak": f[4],
                      "plan": float(f[5].replace(",", "")),
                      **{c: float(v.rstrip("%")) for c, v in zip(columns, f[6:])}}
    assert set(rows) == {"tiny-dense", "tiny-moe"}
    for r in rows.values():
        assert r["tok/s"] > 0 and r["mfu"].endswith("%") and r["peak"] == "n/a"  # no GPU
        assert 0 < sum(r[c] for c in columns) <= 100.5
    moe, dense = rows["tiny-moe"], rows["tiny-dense"]
    # Each model's own regions are found, and only those.
    assert moe["expert GEMMs"] > 0 and moe["dispatch"] > 0 and moe["dense FFN"] == 0
    assert dense["dense FFN"] > 0 and dense["expert GEMMs"] == 0 and dense["dispatch"] == 0
    assert moe["attention"] > 0 and dense["attention"] > 0


def test_the_largest_preset_is_chosen_by_planned_memory():
    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu_train_bench import largest_fitting, planned_bytes

    name, cfg = largest_fitting(0.9 * 80 * 2**30, micro_batch=None)  # an 80 GB GPU
    assert name == "moe-125m"  # deepseek-moe-16b and mixtral-8x7b need far more with ep 1
    assert planned_bytes(cfg) <= 0.9 * 80 * 2**30
    assert cfg.parallel.expert_parallel_size == 1 and cfg.train.precision == "bf16"
    name, _ = largest_fitting(2**40, micro_batch=1)  # 1 TiB: the biggest preset fits
    assert name == "mixtral-8x7b"
    assert largest_fitting(2**20, micro_batch=1) is None


def test_set_changes_every_model_and_models_keeps_the_named_rows(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    base = [sys.executable, "benchmarks/gpu_train_bench.py", "--device", "cpu", "--tiny",
            "--steps", "1", "--warmup", "1", "--profile-steps", "0"]
    out = tmp_path / "rows.json"
    proc = subprocess.run(base + ["--set", "train.micro_batch_size=3", "--set",
                                  "model.d_model=32", "--models", "tiny-moe", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["overrides"] == ["train.micro_batch_size=3", "model.d_model=32"]
    assert [r["model"] for r in report["rows"]] == ["tiny-moe"]
    assert report["rows"][0]["batch"] == "3x32"
    for bad, named in ((["--set", "train.compil=true"], "train.compil"),
                       (["--models", "tiny-mo"], "tiny-mo")):
        proc = subprocess.run(base + bad, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 2 and named in proc.stderr, proc.stderr[-2000:]
