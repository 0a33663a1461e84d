"""The real launcher end to end: moe-launch -> deepspeed launcher -> 2 ranks, EP 2 -> eval, on
configs/default.yaml with a tiny model and data."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import tiny_run_dict

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def shm_buffers() -> set[Path]:
    return set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))


def default_config_tiny(tiny_data, out_dir: Path) -> dict:
    """configs/default.yaml with the tiny model, data and micro-batch, for one step past its
    first validation; every other section (eval, logging, parallel, checkpoint) as it is."""
    run = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    tiny = tiny_run_dict(tiny_data, out_dir)
    run.update(name="tiny", output_dir=tiny["output_dir"], model=tiny["model"], data=tiny["data"])
    run["train"].update(max_steps=run["eval"]["every_n_steps"] + 1, micro_batch_size=2)
    return run


def test_two_ranks_expert_parallel_train_checkpoint_tensorboard_eval(tiny_data, tmp_path):
    shm_before = shm_buffers()
    run = default_config_tiny(tiny_data, tmp_path / "runs")
    every = run["eval"]["every_n_steps"]
    assert every > 0, "the default config validates during training"
    steps = list(range(1, every + 2))
    last = f"step_{steps[-1]:07d}"
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(run))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.launch",
            str(tmp_path / "tiny.yaml"),
            "logging.log_every=1",
            "eval.in_training_max_tokens=1000",
            "eval.max_tokens=2000",
            "logging.peak_flops_per_device=6.0e10",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
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
        assert f"saved checkpoint {run_dir / 'checkpoints' / last}" in log, log
        assert f"[rank {rank}] finished: step {steps[-1]} of {steps[-1]}" in log, log
    # Validation during training reads eval.in_training_max_tokens, the final one max_tokens.
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert f"step {every:>5} | validation loss" in log, log[-3000:]
    assert log.count("over 1,000 tokens") == 2, log[-3000:]
    # The evaluation after training runs with the ranks' threads, which the summary records.
    threads = json.loads((run_dir / "train_summary.json").read_text())["threads_per_rank"]
    assert f"{threads} thread(s) per rank" in log
    assert "FutureWarning" not in proc.stdout + proc.stderr, proc.stderr[-3000:]

    # DeepSpeed checkpoint with one file per expert (global ids) for each MoE layer.
    ckpt = run_dir / "checkpoints" / last
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == last
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
    assert [e.step for e in losses] == steps
    assert all(math.isfinite(e.value) for e in losses)
    assert abs(losses[0].value - math.log(512)) < 0.5
    assert all(e.value > 0 for e in acc.Scalars("train/tokens_per_s"))

    # MoE monitoring: per-layer expert load summed over the step and both ranks. Each step is
    # 2 ranks x 2 sequences x 32 tokens, routed top-2 and dropless: 256 copies per layer.
    for layer in range(2):
        hists = acc.Histograms(f"moe/layer{layer}/expert_load")
        assert [h.step for h in hists] == steps
        for h in hists:
            assert len(h.histogram_value.bucket) == 4
            assert sum(h.histogram_value.bucket) == 256
        for name in (
            "dropped_fraction",
            "router_entropy",
            "aux_loss",
            "z_loss",
            "load_cv",
            "max_over_mean_load",
        ):
            values = [e.value for e in acc.Scalars(f"moe/layer{layer}/{name}")]
            assert len(values) == len(steps) and all(math.isfinite(v) for v in values), name
        assert all(e.value == 0 for e in acc.Scalars(f"moe/layer{layer}/dropped_fraction"))
        assert all(
            0 < e.value <= math.log(4) + 1e-6
            for e in acc.Scalars(f"moe/layer{layer}/router_entropy")
        )
    assert all(e.value > 0.1 for e in acc.Scalars("system/process_memory_gib"))
    assert [e.value for e in acc.Scalars("train/skipped_steps")] == [0] * len(steps)
    mfu = [e.value for e in acc.Scalars("train/mfu")]
    tflops = [e.value for e in acc.Scalars("train/model_tflops_per_s")]
    assert len(mfu) == len(steps) and all(0 < m for m in mfu)
    for m, t in zip(mfu, tflops):  # MFU = achieved model FLOP/s over 2 ranks x the peak
        assert math.isclose(m, t * 1e12 / (2 * 6.0e10), rel_tol=1e-6)
    # What the README sends users to TensorBoard for: validation before the end of training.
    valid = acc.Scalars("valid/loss")
    assert [e.step for e in valid] == [every, every + 1]
    assert all(math.isfinite(e.value) for e in valid)
    assert "config" in acc.Tags()["tensors"] or acc.Tags().get("tensors")

    # The evaluation script read the checkpoint and reported a finite perplexity.
    result = json.loads((ckpt / "eval" / "eval.json").read_text())["checkpoints"][0]
    assert math.isfinite(result["perplexity"]) and result["tokens"] == 2000
    assert math.isclose(result["perplexity"], math.exp(result["loss"]), rel_tol=1e-9)
    assert "perplexity" in proc.stdout and str(run_dir) in proc.stdout
