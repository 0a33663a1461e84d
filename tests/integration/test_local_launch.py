"""The real launcher end to end: moe-launch -> deepspeed launcher -> 2 ranks, EP 2 -> eval."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def shm_buffers() -> set[Path]:
    return set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))


def test_two_ranks_expert_parallel_train_checkpoint_tensorboard_eval(tiny_config_file, tmp_path):
    shm_before = shm_buffers()
    proc = subprocess.run([sys.executable, "-m", "launch.launch", str(tiny_config_file),
                           "eval.every_n_steps=2", "eval.max_tokens=2000",
                           "logging.peak_flops_per_device=6.0e10"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "tiny"

    # DeepSpeed's CPU communication op made one shared-memory file per rank; none is left.
    assert shm_buffers() - shm_before == set()

    # Both ranks ran and logged their own story (device, each checkpoint, the end), and warned
    # about nothing: Python warnings reach the rank logs too, and DeepSpeed's ZeRO all-gather
    # no longer calls the name torch 2.13 deprecates.
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert "Warning" not in log, log
        assert f"[rank {rank}] device: cpu (no CUDA device visible) (rank {rank})" in log, log
        assert f"saved checkpoint {run_dir / 'checkpoints' / 'step_0000004'}" in log, log
        assert f"[rank {rank}] finished: step 4 of 4" in log, log
    assert "FutureWarning" not in proc.stdout + proc.stderr, proc.stderr[-3000:]

    # DeepSpeed checkpoint with one file per expert (global ids) for each MoE layer.
    ckpt = run_dir / "checkpoints" / "step_0000004"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_0000004"
    names = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*")}
    for layer in range(2):
        for expert in range(4):
            assert f"experts/layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt" in names
    assert "mp_rank_00_model_states.pt" in names

    # TensorBoard events, read back with TensorBoard's own reader.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"histograms": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/tokens_per_s"} <= tags
    losses = acc.Scalars("train/loss")
    assert [e.step for e in losses] == [1, 2, 3, 4]
    assert all(math.isfinite(e.value) for e in losses)
    assert abs(losses[0].value - math.log(512)) < 0.5
    assert all(e.value > 0 for e in acc.Scalars("train/tokens_per_s"))

    # MoE monitoring: per-layer expert load summed over the step and both ranks. Each step is
    # 2 ranks x 2 sequences x 32 tokens, routed top-2 and dropless: 256 copies per layer.
    for layer in range(2):
        hists = acc.Histograms(f"moe/layer{layer}/expert_load")
        assert [h.step for h in hists] == [1, 2, 3, 4]
        for h in hists:
            assert len(h.histogram_value.bucket) == 4
            assert sum(h.histogram_value.bucket) == 256
        for name in ("dropped_fraction", "router_entropy", "aux_loss", "z_loss", "load_cv",
                     "max_over_mean_load"):
            values = [e.value for e in acc.Scalars(f"moe/layer{layer}/{name}")]
            assert len(values) == 4 and all(math.isfinite(v) for v in values), name
        assert all(e.value == 0 for e in acc.Scalars(f"moe/layer{layer}/dropped_fraction"))
        assert all(0 < e.value <= math.log(4) + 1e-6
                   for e in acc.Scalars(f"moe/layer{layer}/router_entropy"))
    assert all(e.value > 0.1 for e in acc.Scalars("system/process_memory_gib"))
    assert [e.value for e in acc.Scalars("train/skipped_steps")] == [0, 0, 0, 0]
    mfu = [e.value for e in acc.Scalars("train/mfu")]
    tflops = [e.value for e in acc.Scalars("train/model_tflops_per_s")]
    assert len(mfu) == 4 and all(0 < m for m in mfu)
    for m, t in zip(mfu, tflops):  # MFU = achieved model FLOP/s over 2 ranks x the peak
        assert math.isclose(m, t * 1e12 / (2 * 6.0e10), rel_tol=1e-6)
    valid = acc.Scalars("valid/loss")
    assert [e.step for e in valid] == [2, 4] and all(math.isfinite(e.value) for e in valid)
    assert "config" in acc.Tags()["tensors"] or acc.Tags().get("tensors")

    # The evaluation script read the checkpoint and reported a finite perplexity.
    result = json.loads((ckpt / "eval" / "eval.json").read_text())["checkpoints"][0]
    assert math.isfinite(result["perplexity"]) and result["tokens"] > 0
    assert math.isclose(result["perplexity"], math.exp(result["loss"]), rel_tol=1e-9)
    assert "perplexity" in proc.stdout and str(run_dir) in proc.stdout
