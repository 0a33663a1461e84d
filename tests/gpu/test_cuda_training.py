"""On one CUDA GPU (skipped elsewhere): bf16 training through the real trainer, grouped-GEMM
parity in bf16, host syncs under torch's sync debug mode, and a GPU checkpoint evaluated on the
CPU. Run with ``python3 -m pytest -m gpu -q tests/gpu``."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_run_dict
from tests.helpers.distributed import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from plain_settings import EAGER as PLAIN  # noqa: E402  (the plain settings, as on the CPU)

COUNTS = [37, 0, 128, 5, 0, 90, 1, 250]  # experts 1 and 4 get no tokens


def bf16_run(tiny_data, runs: Path, **train) -> dict:
    d = tiny_run_dict(tiny_data, runs, precision="bf16", **train)
    d["parallel"] = {"world_size": 1, "expert_parallel_size": 1, "zero_stage": 2}
    d["checkpoint"] = {"every_n_steps": 0}
    return d


def _train(rank, world, cfg_dict):
    from moe.config.run import RunConfig
    from moe.core.config_schema import from_dict
    from moe.training.trainer import DistEnv, resolve_vocab, train

    train(resolve_vocab(from_dict(RunConfig, cfg_dict)), DistEnv(0, 1, 0, 1), resume="none")


@pytest.fixture(scope="module")
def bf16_trained(tiny_data, tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("gpu") / "runs"
    d = bf16_run(tiny_data, runs, max_steps=20, micro_batch_size=8, lr=3e-3)
    run_distributed(_train, 1, d, backend="nccl")
    return runs / d["name"]


def test_bf16_training_for_20_steps_lowers_the_loss(bf16_trained):
    history = json.loads((bf16_trained / "train_summary.json").read_text())["history"]
    losses = [h["loss"] for h in history]
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05, losses
    record = (bf16_trained / "logs" / "steps_rank0.jsonl").read_text().splitlines()
    assert not any(json.loads(line)["skipped"] for line in record)


def test_gpu_checkpoint_evaluates_on_the_cpu(bf16_trained, tmp_path):
    # ROOT first, what the caller's PYTHONPATH holds after it (a machine may have DeepSpeed only
    # there: the GPU proof installs its wheels with --target and reaches them this way)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}
    checkpoint = json.loads((bf16_trained / "train_summary.json").read_text())["checkpoint"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.evaluate",
            checkpoint,
            "--max-tokens",
            "2000",
            "--output",
            str(tmp_path / "eval"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())["checkpoints"][0]
    assert math.isfinite(result["loss"]) and result["loss"] < math.log(512) + 0.5


def test_grouped_gemm_matches_the_loop_in_bf16():
    from moe.model import experts as experts_mod
    from moe.model.experts import grouped_mm, grouped_mm_supported

    device = torch.device("cuda")
    if torch.cuda.get_device_capability(device)[0] == 9:
        assert grouped_mm_supported(torch.bfloat16, device)  # Hopper must get the kernel
    torch.manual_seed(0)
    x = torch.randn(sum(COUNTS), 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(len(COUNTS), 256, 512, device=device) / 16).to(torch.bfloat16)
    w.requires_grad_(True)
    counts_E = torch.tensor(COUNTS, device=device)
    y = grouped_mm(x, w, counts_E)
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, [x, w], g)
    # Reference: fp64 products of the same bf16 inputs, one expert at a time.
    xd, wd, gd = x.detach().double(), w.detach().double(), g.double()
    ref, bound, start = [], [], 0
    for e, n in enumerate(COUNTS):
        ref.append(xd[start : start + n] @ wd[e])
        bound.append(xd[start : start + n].abs() @ wd[e].abs())
        start += n
    ref, bound = torch.cat(ref), torch.cat(bound)
    # bf16 keeps 8 significant bits: rounding the output costs at most 2^-9 of it, fp32
    # accumulation far less; 2^-8 of the sum of |terms| bounds both.
    assert ((y.double() - ref).abs() <= 2**-8 * bound + 1e-6).all()
    with torch.no_grad():
        loop_y = experts_mod._loop_mm(x, w, COUNTS)
    assert ((y.double() - loop_y.double()).abs() <= 2**-7 * bound + 1e-6).all()
    gw_ref = torch.stack(
        [
            xd[s : s + n].T @ gd[s : s + n]
            for s, n in zip([sum(COUNTS[:e]) for e in range(len(COUNTS))], COUNTS)
        ]
    )
    gw_bound = torch.stack(
        [
            xd[s : s + n].abs().T @ gd[s : s + n].abs()
            for s, n in zip([sum(COUNTS[:e]) for e in range(len(COUNTS))], COUNTS)
        ]
    )
    assert ((gw.double() - gw_ref).abs() <= 2**-8 * gw_bound + 1e-6).all()
    assert gw[1].abs().max() == 0 and gw[4].abs().max() == 0
    assert torch.isfinite(gx).all()


def _sync_warnings(fn) -> list[str]:
    """``file:line`` of each synchronizing CUDA call ``fn`` makes from our code (moe/)."""
    ours = str(ROOT / "moe") + "/"
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [
        f"{w.filename[len(ours) :]}:{w.lineno}"
        for w in caught
        if "synchroniz" in str(w.message).lower() and w.filename.startswith(ours)
    ]


@pytest.mark.parametrize("loop_fallback", [False, True], ids=["grouped", "loop"])
def test_model_forward_backward_syncs(loop_fallback, monkeypatch):
    """bf16 tiny MoE model: no sync in forward and backward with the grouped kernel; one per MoE
    layer (the loop's count read) without it."""
    from moe.core.config_schema import from_dict
    from moe.model import experts as experts_mod
    from moe.model.transformer import ModelConfig, MoETransformer

    if loop_fallback:
        monkeypatch.setattr(experts_mod, "grouped_mm_supported", lambda dtype, device: False)
    elif not experts_mod.grouped_mm_supported(torch.bfloat16, torch.device("cuda")):
        pytest.skip("torch._grouped_mm is not available for bf16 on this GPU")
    cfg = from_dict(
        ModelConfig,
        {
            "vocab_size": 512,
            "d_model": 64,
            "n_layers": 2,
            "n_heads": 4,
            "max_seq_len": 64,
            "moe": {"num_experts": 4, "expert_hidden": 64},
        },
    )
    model = MoETransformer(cfg).cuda().to(torch.bfloat16)
    ids = torch.randint(0, 512, (4, 33), device="cuda")
    model(ids[:, :-1], ids[:, 1:]).loss.backward()  # warm-up (the kernel probe syncs once)

    def step():
        model(ids[:, :-1], ids[:, 1:]).loss.backward()

    found = _sync_warnings(step)
    assert len(found) == (len(model.moe_layers()) if loop_fallback else 0), found


def _train_step_syncs(rank, world, cfg_dict, out_path):
    from moe.config.run import RunConfig
    from moe.core.config_schema import from_dict
    from moe.training import prefetch
    from moe.training.trainer import DistEnv, resolve_vocab, train

    ours = str(ROOT / "moe") + "/"
    per_step: list[list[str]] = []  # sites that synced, from one hand-out of batches to the next
    real_next = prefetch.PrefetchingReader.next_step

    def marked(self):
        torch.cuda.set_sync_debug_mode("default")
        batches = real_next(self)
        per_step.append([])
        if len(per_step) in (2, 3):  # the non-logging steps
            torch.cuda.set_sync_debug_mode("warn")
        return batches

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message).lower() and filename.startswith(ours) and per_step:
            per_step[-1].append(f"{filename[len(ours) :]}:{lineno}")

    prefetch.PrefetchingReader.next_step = marked
    warnings.showwarning = show
    warnings.simplefilter("always")
    train(resolve_vocab(from_dict(RunConfig, cfg_dict)), DistEnv(0, 1, 0, 1), resume="none")
    Path(out_path).write_text(json.dumps(per_step))


def test_a_non_logging_training_step_syncs_only_where_documented(tiny_data, tmp_path):
    """With the settings CUDA chooses (compiled blocks, the chunked loss, the gather permutation,
    fused AdamW, the flat gradient work at ZeRO 2). Steps 2 and 3 of 4 (log_every large): our
    code syncs twice per step, the documented
    reads (step.py's one read of losses and gradient norm, preemption.py's flag), plus the
    loop's count read per MoE layer and micro-batch where the grouped kernel is unavailable.
    DeepSpeed's own optimizer-step syncs are not ours and not counted."""
    from moe.model.experts import grouped_mm_supported

    d = bf16_run(tiny_data, tmp_path / "runs", max_steps=4, grad_accum_steps=2)
    d["logging"] = {"log_every": 1000}
    out = tmp_path / "syncs.json"
    run_distributed(_train_step_syncs, 1, d, str(out), backend="nccl")
    per_step = json.loads(out.read_text())
    want = ["training/resilience/preemption.py", "training/step.py"]
    if not grouped_mm_supported(torch.bfloat16, torch.device("cuda")):
        want += ["model/experts.py"] * (
            2 * 2
        )  # the loop's count read: 2 MoE layers x 2 micro-batches
    for step in (2, 3):
        files = sorted(site.split(":")[0] for site in per_step[step - 1])
        assert files == sorted(want), per_step[step - 1]


def _engine_peak(rank, world, zero, reduce, out_path):
    from moe.config.run import load_config
    from moe.training.trainer import DistEnv, build_engine

    cfg = load_config(
        ROOT / "configs" / "moe-125m.yaml",
        [
            "model.n_layers=4",
            "parallel.world_size=1",
            "parallel.expert_parallel_size=1",
            f"parallel.zero_stage={zero}",
            "train.precision=bf16",
            f"train.grad_reduce_dtype={reduce}",
            "train.micro_batch_size=4",
            "train.grad_accum_steps=2",
            *PLAIN,  # the planner against DeepSpeed's engine as eager blocks keep activations
        ],
    )
    dev = torch.device("cuda", 0)
    base = torch.cuda.memory_allocated(dev)
    engine, _ = build_engine(cfg, DistEnv(0, 1, 0, 1))
    V, B, S = cfg.model.vocab_size, cfg.train.micro_batch_size, cfg.data.seq_len

    def micro_batch():
        ids = torch.randint(0, V, (B, S + 1), device=dev)
        engine.backward(engine(ids[:, :-1], ids[:, 1:]).loss)
        engine.step()

    for _ in range(4):  # two optimizer steps: Adam's moments and the engine's buffers exist
        micro_batch()
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    for _ in range(2):
        micro_batch()
    torch.cuda.synchronize(dev)
    Path(out_path).write_text(json.dumps(torch.cuda.max_memory_allocated(dev) - base))


@pytest.mark.parametrize("zero,reduce", [(1, "fp32"), (1, "bf16"), (2, "fp32"), (2, "bf16")])
def test_deepspeed_engine_peak_matches_the_planned_total(zero, reduce, tmp_path):
    """DeepSpeed's engine (the trainer's own build), 32k vocabulary, 4 x 2048 tokens: the peak of
    a step against moe-plan's total. benchmarks/engine_memory.py measured 1.03-1.15x on an H200
    for the 125M preset (BENCHMARKS.md, "Memory: the planner against DeepSpeed's engine")."""
    from moe.config.run import load_config
    from moe.tools.planning import memory_per_gpu

    out = tmp_path / "peak.json"
    run_distributed(_engine_peak, 1, zero, reduce, str(out), backend="nccl")
    cfg = load_config(ROOT / "configs" / "moe-125m.yaml", ["model.n_layers=4"])
    plan = memory_per_gpu(cfg.model, 1, 1, zero, "bf16", 4, cfg.data.seq_len)
    peak = json.loads(out.read_text())
    assert 0.9 < peak / plan.total_bytes < 1.2, (peak, plan.total_bytes)


def test_expert_lora_at_rank_4_runs_the_grouped_kernel_without_syncs(monkeypatch):
    """The shipped LoRA config's per-expert rank (8 / top_k 2 = 4) has 8-byte bf16 rows, which
    the grouped kernel cannot take: its factors are padded for the products, so no product
    loops over experts and forward and backward sync nothing."""
    from moe.core.config_schema import from_dict
    from moe.model import experts as experts_mod
    from moe.model.adapters.lora import LoRAConfig, LoRAGroupedExperts, apply_lora
    from moe.model.transformer import ModelConfig, MoETransformer

    if not experts_mod.grouped_mm_supported(torch.bfloat16, torch.device("cuda")):
        pytest.skip("torch._grouped_mm is not available for bf16 on this GPU")
    torch.manual_seed(0)
    cfg = from_dict(
        ModelConfig,
        {
            "vocab_size": 512,
            "d_model": 64,
            "n_layers": 2,
            "n_heads": 4,
            "max_seq_len": 64,
            "moe": {"num_experts": 8, "expert_hidden": 64, "router": {"top_k": 2}},
        },
    )
    model = MoETransformer(cfg)
    apply_lora(model, LoRAConfig(targets=["experts"], rank=8, expert_rank="per_top_k"))
    model = model.cuda().to(torch.bfloat16)
    layers = [m for m in model.modules() if isinstance(m, LoRAGroupedExperts)]
    assert layers and all(m.w_in_lora_A.shape[-1] == 4 for m in layers)
    for m in layers:
        with torch.no_grad():
            m.w_in_lora_B.normal_(std=0.1)  # B starts at zero; let the branch matter
    ids = torch.randint(0, 512, (4, 33), device="cuda")
    model(ids[:, :-1], ids[:, 1:]).loss.backward()  # warm-up (the kernel probe syncs once)
    monkeypatch.setattr(experts_mod, "_loop_mm", lambda *a: pytest.fail("looped over experts"))

    def step():
        model.zero_grad()
        model(ids[:, :-1], ids[:, 1:]).loss.backward()

    assert _sync_warnings(step) == []
    grads = [m.w_in_lora_A.grad for m in layers]
    assert all(
        g is not None and g.shape == m.w_in_lora_A.shape and g.abs().sum() > 0
        for g, m in zip(grads, layers)
    )


def _fine_tune(bf16_trained: Path, tiny_data, tmp_path: Path, method: str) -> tuple[str, Path]:
    """10 bf16 steps of ``method`` (LoRA on attention q/v and the routed experts, per-expert
    rank 8 // top_k 2 = 4) from the GPU checkpoint, through the trainer; asserts finite losses.
    Returns the base checkpoint and the run directory."""
    base_ckpt = json.loads((bf16_trained / "train_summary.json").read_text())["checkpoint"]
    d = bf16_run(
        tiny_data, tmp_path / "runs", max_steps=10, micro_batch_size=8, lr=1e-2, warmup_steps=1
    )
    d["name"] = method
    d["model"]["init_from"] = base_ckpt
    d["finetune"] = {
        "method": method,
        "lora": {
            "targets": ["attention.q", "attention.v", "experts"],
            "rank": 8,
            "expert_rank": "per_top_k",
        },
    }
    run_distributed(_train, 1, d, backend="nccl")
    run_dir = tmp_path / "runs" / method
    losses = [
        h["loss"] for h in json.loads((run_dir / "train_summary.json").read_text())["history"]
    ]
    assert len(losses) == 10 and all(math.isfinite(x) for x in losses), losses
    return base_ckpt, run_dir


def test_lora_fine_tuning_on_the_gpu_trains_only_its_factors(bf16_trained, tiny_data, tmp_path):
    """A LoRA run (attention q/v and the routed experts, per-expert rank 4) from the GPU
    checkpoint, on the GPU in bf16 through the trainer: finite losses, the base unchanged,
    every factor B moved from zero."""
    from moe.weights.load import load_consolidated

    base_ckpt, run_dir = _fine_tune(bf16_trained, tiny_data, tmp_path, "lora")
    base, _, _ = load_consolidated(Path(base_ckpt))
    tuned, _, _ = load_consolidated(run_dir)
    factors = {k for k in tuned if "lora_" in k}
    assert factors and tuned.keys() == base.keys() | factors
    # the base unchanged: as the bf16 run held it, rounded to bf16 (docs/finetuning.md)
    assert all(torch.equal(tuned[k], v.to(tuned[k].dtype)) for k, v in base.items())
    assert all(tuned[k].abs().sum() > 0 for k in factors if "lora_B" in k)
    assert {tuned[k].shape[-1] for k in factors if k.endswith("w_in_lora_A")} == {4}


def test_qlora_fine_tuning_on_the_gpu(bf16_trained, tiny_data, tmp_path):
    """QLoRA from the GPU checkpoint on the GPU in bf16: the base held in NF4 on the device,
    finite losses, every factor B moved from zero, and the checkpoint read back as a plain model
    (dequantised base plus the update) on the CPU."""
    from moe.model.adapters.qlora import torchao_missing
    from moe.weights.load import load_consolidated, load_model

    if (missing := torchao_missing()) is not None:
        pytest.skip(missing)
    _, run_dir = _fine_tune(bf16_trained, tiny_data, tmp_path, "qlora")
    tuned, _, _ = load_consolidated(run_dir)
    factors = {k for k in tuned if "lora_" in k}
    assert factors and all(tuned[k].abs().sum() > 0 for k in factors if "lora_B" in k)
    assert any("_nf4_" in k for k in tuned)  # the base saved as NF4
    model, _, _ = load_model(run_dir)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 16))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
