"""The adapter's changes to DeepSpeed's internals happen in ``install()`` alone: importing the
adapter changes nothing, install() replaces each listed attribute with ours, a second call
changes nothing more, and a DeepSpeed release other than the pinned one is refused before
anything is replaced."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

# Runs in a fresh interpreter: in this one, other tests may have built engines (installed).
PROBE = r"""
import json, types
import deepspeed
import deepspeed.comm.comm as ds_comm
import torch.distributed as dist
from deepspeed.comm.torch import TorchBackend
from deepspeed.runtime import bf16_optimizer
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

TARGETS = [(DeepSpeedEngine, "_get_expert_ckpt_name"),
           (DeepSpeedZeroOptimizer, "_configure_moe_settings"),
           (DeepSpeedEngine, "load_module_state_dict"),
           (TorchBackend, "get_all_gather_function"),
           (bf16_optimizer, "see_memory_usage"),
           (bf16_optimizer.BF16_Optimizer, "_configure_moe_settings"),
           (bf16_optimizer.BF16_Optimizer, "get_grads_for_norm")]

def current():
    return [owner.__dict__[name] for owner, name in TARGETS]

def function(attr):  # the function under a staticmethod or classmethod
    return getattr(attr, "__func__", attr)

originals = current()
from moe.parallel import deepspeed_adapter as adapter
out = {"import_changes_nothing": current() == originals}

real_version = deepspeed.__version__
deepspeed.__version__ = "0.18.0"
try:
    adapter.install()
    out["refused"] = None
except adapter.DeepSpeedVersionError as e:
    out["refused"] = str(e)
out["refusal_changes_nothing"] = current() == originals
deepspeed.__version__ = real_version

ours = [adapter._expert_ckpt_name, adapter._moe_settings, adapter._load_module_state_dict,
        adapter._all_gather_function, adapter._memory_report, adapter._bf16_moe_settings,
        adapter._bf16_grads_for_norm]
out["native_all_gather"] = TorchBackend.get_all_gather_function() is dist.all_gather_into_tensor
# torch 2.13's name for it; torch 2.11 has none, and DeepSpeed's choice stays
current_name = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
adapter.install()
once = current()
out["installed_ours"] = [function(a) is f for a, f in zip(once, ours)]
out["new_backend_all_gather"] = TorchBackend.get_all_gather_function() is current_name
# A communication back end made before install (the launcher starts DeepSpeed's first).
ds_comm.cdb = types.SimpleNamespace(all_gather_function=dist.all_gather_into_tensor)
adapter.install()
out["twice_same_as_once"] = current() == once
out["live_backend_all_gather"] = ds_comm.cdb.all_gather_function is current_name
adapter.install()
out["live_backend_stays"] = ds_comm.cdb.all_gather_function is current_name
out["wraps_deepspeed"] = (adapter._ORIGINALS["DeepSpeedEngine._get_expert_ckpt_name"]
                          is function(originals[0]))
print("RESULT " + json.dumps(out))
"""


def test_install_replaces_deepspeed_internals_once_and_only_when_called():
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line.removeprefix("RESULT "))
    assert out["import_changes_nothing"]
    assert out["refused"] is not None and "DeepSpeed 0.18.0 is installed" in out["refused"]
    assert "supports DeepSpeed 0.19.8 only" in out["refused"]
    assert out["refusal_changes_nothing"]
    assert out["native_all_gather"]  # DeepSpeed's own choice, the name torch 2.13 deprecates
    assert out["installed_ours"] == [True] * 7
    assert out["new_backend_all_gather"]
    assert out["twice_same_as_once"]
    assert out["live_backend_all_gather"] and out["live_backend_stays"]
    assert out["wraps_deepspeed"]


def _bf16_engine_set_up(rank, world, out_file) -> None:
    import contextlib
    import gc
    import io
    from unittest import mock

    import torch

    from moe.config.run import RunConfig
    from moe.core.config_schema import from_dict
    from moe.training.trainer import DistEnv, build_engine
    from tests.helpers.engine_configs import tiny_engine_dict

    d = tiny_engine_dict(64, 16, train={"precision": "bf16"})
    cfg = from_dict(RunConfig, d)
    stdout = io.StringIO()
    with mock.patch.object(gc, "collect", wraps=gc.collect) as collect:
        with contextlib.redirect_stdout(stdout):
            engine, _ = build_engine(cfg, DistEnv(rank, world, rank, world))
    kind = type(engine.optimizer).__name__
    torch.save(
        {"collects": collect.call_count, "stdout": stdout.getvalue(), "kind": kind}, out_file
    )


def test_the_bf16_optimizer_is_set_up_without_collecting_garbage_per_group(tmp_path):
    """DeepSpeed's BF16 optimizer forces a memory report before and after each parameter group:
    a gc.collect() each (seconds per engine in a process with a large heap), and four lines on
    stdout. Built by the trainer: neither."""
    import torch

    from tests.helpers.distributed import run_distributed

    run_distributed(_bf16_engine_set_up, 1, str(tmp_path / "out.pt"))
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert out["kind"] == "BF16_Optimizer"  # the optimizer whose reports these are
    assert out["collects"] == 0
    assert "bf16_optimizer" not in out["stdout"] and "MA " not in out["stdout"], out["stdout"]


@pytest.mark.parametrize("version", ["0.18.0", "0.19.7", "0.19.80", "0.20.0", "1.0.0"])
def test_other_deepspeed_releases_are_refused_by_name(monkeypatch, version):
    import deepspeed

    from moe.core.errors import MoEError
    from moe.parallel import deepspeed_adapter

    monkeypatch.setattr(deepspeed, "__version__", version)
    with pytest.raises(
        MoEError,
        match=rf"DeepSpeed {re.escape(version)} is installed, but "
        r"this project supports DeepSpeed 0\.19\.8 only",
    ):
        deepspeed_adapter.install()


def test_a_local_build_of_the_pinned_release_is_accepted(monkeypatch):
    """A wheel built from a source checkout carries a local suffix (``+<git hash>``)."""
    import deepspeed

    from moe.parallel import deepspeed_adapter

    monkeypatch.setattr(deepspeed, "__version__", "0.19.8+7d3b2a1")
    deepspeed_adapter.check_deepspeed_version()


def test_the_supported_release_is_the_one_pinned_for_cpu_and_gpu_machines():
    from moe.parallel.deepspeed_adapter import SUPPORTED_DEEPSPEED

    constraints = (ROOT / "constraints.txt").read_text()
    assert re.search(r"^deepspeed==(\S+)$", constraints, re.M).group(1) == SUPPORTED_DEEPSPEED
    wheels = (ROOT / "benchmarks" / "gpu_wheels.sh").read_text()
    assert re.search(r"^DEEPSPEED=deepspeed==(\S+)$", wheels, re.M).group(1) == SUPPORTED_DEEPSPEED
