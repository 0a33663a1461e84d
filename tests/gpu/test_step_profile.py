"""On one CUDA GPU (skipped elsewhere): the step profile of benchmarks/gpu_train_bench.py
(``--profile-out``) read from a real CUDA trace: kernels linked to the operators and ranges
that launched them, device-busy time, host syncs counted. The summariser's rules are tested on
synthetic traces on the CPU (tests/benchmarks/test_profile_summary.py); this checks that a
real CUDA trace has the events they read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from plain_settings import EAGER as PLAIN  # noqa: E402  (the plain settings, as on the CPU)


def test_a_cuda_step_profile_attributes_its_kernels(tmp_path):
    out = tmp_path / "prof"
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/gpu_train_bench.py",
            "--device",
            "cuda",
            "--tiny",
            "--models",
            "tiny-moe",
            "--steps",
            "3",
            "--warmup",
            "2",
            "--profile-steps",
            "2",
            "--profile-out",
            str(out),
            *(a for o in PLAIN for a in ("--set", o)),  # eager, as the attribution rules read
        ],
        cwd=ROOT,
        # The checkout first, then what the caller's path holds (the proof's installed wheels).
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        },
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (entry,) = json.loads((out / "profile.json").read_text())["entries"]
    assert entry["device_kind"] == "gpu" and entry["model"] == "tiny-moe"
    assert entry["kernels_per_step"] > 50 and entry["copies_per_step"] >= 1  # the batch's copy
    assert 0 < entry["busy_ms"] and 0 < entry["busy_share"] <= 1
    assert isinstance(entry["syncs_per_step"], (int, float))  # counted under the debug mode
    by = entry["attributed_by"]
    # Eager: the model's ranges and the backward's sequence numbers place most kernel time.
    assert by.get("range", 0) + by.get("backward", 0) > 0.6, by
    assert by.get("none", 0) < 0.2, by
    regions = {r for r, *_ in entry["regions"]}
    assert {"attention", "expert GEMMs", "router", "head & loss", "optimizer"} <= regions
    assert len(entry["top_kernels"]) >= 10
