"""The speed levers on one CUDA GPU (skipped elsewhere; ``python3 -m pytest -m gpu -q
tests/gpu/test_levers.py``): no host synchronisation in a bf16 forward and backward (eager and
compiled, every loss back end, routers that count over the global batch, packed documents on
flex, the fused query/key/value product) under ``torch.cuda.set_sync_debug_mode("error")``;
compiled blocks without graph breaks or recompiles after warm-up, the fused product compiled
against three eager products, compiled LoRA blocks against eager ones; the chunked and Liger
losses against the full one in bf16, with the memory they save; fused AdamW and flat gradient
work under DeepSpeed; compiled blocks replayed as CUDA graphs under DeepSpeed; which SDPA kernel
runs at 2048 tokens.

The CPU counterparts: tests/moe/model/test_loss.py, tests/moe/model/test_compile_fullgraph.py,
tests/moe/model/test_fused_qkv.py, tests/moe/training/test_optimizer_impl.py,
tests/moe/parallel/test_flat_grads.py."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LIGER = pytest.param(
    "liger",
    marks=pytest.mark.skipif(
        importlib.util.find_spec("liger_kernel") is None,
        reason="liger-kernel is not installed (pip install liger-kernel)",
    ),
)


def tiny_model(cross_entropy="full", **extra):
    from moe.core.config_schema import from_dict
    from moe.model.transformer import ModelConfig, MoETransformer

    router = extra.pop("router", {})
    moe = extra.pop("moe", {})
    cfg = from_dict(
        ModelConfig,
        {
            "vocab_size": 1024,
            "d_model": 128,
            "n_layers": 3,
            "n_heads": 4,
            "max_seq_len": 256,
            "cross_entropy": cross_entropy,
            "cross_entropy_chunk_tokens": 256,
            "moe": {
                "num_experts": 8,
                "expert_hidden": 64,
                "num_shared_experts": 1,
                "first_dense_layers": 1,
                "router": {"top_k": 2, "z_loss_coef": 1e-3, **router},
                **moe,
            },
            **extra,
        },
    )
    torch.manual_seed(0)
    return MoETransformer(cfg).cuda().to(torch.bfloat16)


def _batch(seed: int, documents: bool = False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1024, (4, 257), generator=g).cuda()
    docs = None
    if documents:  # three packed documents per row, boundaries moving with the seed
        cuts = torch.randint(1, 256, (4, 2), generator=g)
        docs = (torch.arange(256)[None, None] >= cuts[:, :, None]).sum(1).cuda()
    return ids[:, :-1], ids[:, 1:], docs


def _step(model, seed: int, documents: bool = False, batch=None):
    x, t, docs = batch if batch is not None else _batch(seed, documents)
    out = model(x, t, doc_ids_BS=docs)
    out.loss.backward()
    return out.loss.detach()


def _needs_grouped_kernel():
    from moe.model.experts import grouped_mm_supported

    if not grouped_mm_supported(torch.bfloat16, torch.device("cuda")):
        pytest.skip("no bf16 torch._grouped_mm on this GPU and torch: the loop syncs by design")


VARIANTS = {
    "default": {},
    "global_batch_counts": {"router": {"aux_loss_scope": "global_batch"}},
    "documents_flex": {"document_masking": True, "attention_backend": "flex"},
    "sigmoid_bias": {"router": {"score_func": "sigmoid", "bias_update_rate": 1e-3}},
    "gather_permute": {"moe": {"permute": "gather"}},
    "fused_qkv": {"qkv_projection": "fused", "n_kv_heads": 2},
}


def _no_sync_steps(model, variant: str) -> None:
    """Two forward/backward passes on routings other than the warm-up's (and, for global-batch
    balancing, a counting pass) with any host synchronisation raising."""
    from moe.model.moe_layer import counting_routes

    documents = variant == "documents_flex"
    # The batches go to the device first: a copy from pageable host memory synchronises.
    counting = _batch(5)[0]
    batches = [_batch(seed, documents) for seed in range(2, 4)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        if variant == "global_batch_counts":
            with torch.no_grad(), counting_routes(model.moe_layers()):
                model(counting)
        for batch in batches:
            _step(model, 0, documents, batch=batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("cross_entropy", ["full", "chunked"])
def test_a_bf16_forward_and_backward_never_syncs(cross_entropy, variant):
    """Any host synchronisation (an .item(), a .tolist(), a bincount, a nonzero, a copy to the
    host) in the model's forward or backward raises under sync debug mode "error". Not liger:
    Liger-Kernel 0.8.5 reads the number of kept targets on the host once per call."""
    _needs_grouped_kernel()
    model = tiny_model(cross_entropy, **copy.deepcopy(VARIANTS[variant]))
    for seed in range(2):  # warm-up: the kernel probe, flex's block-mask compile
        _step(model, seed, variant == "documents_flex")
    _no_sync_steps(model, variant)


@pytest.mark.parametrize("cross_entropy", ["full", "chunked"])
def test_compiled_blocks_compile_nothing_after_warm_up_and_never_sync(cross_entropy):
    """Inductor, bf16, dropless: no graph break in any block; the first step compiles every
    graph (the chunked loss's block body: at most two shapes), later steps route other token
    counts and compile nothing; and the compiled steps synchronise nothing."""
    from torch._dynamo.utils import counters

    from moe.model.compile import compile_blocks

    _needs_grouped_kernel()
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model(cross_entropy)
    compile_blocks(model)
    graphs = []
    for seed in range(4):
        _step(model, seed + 10)
        graphs.append(counters["stats"]["unique_graphs"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert graphs[0] > 0 and graphs[-1] == graphs[0], graphs
    _no_sync_steps(model, "default")
    assert counters["stats"]["unique_graphs"] == graphs[0]


def test_compiled_blocks_with_packed_documents_on_flex_give_eager_losses():
    """What CUDA runs with ``model.document_masking`` take by default: FlexAttention (auto on
    CUDA) inside compiled blocks. No graph break, no compile after the first step, no sync,
    and the losses and gradients of the eager model from the same weights (bf16: 2e-2)."""
    from torch._dynamo.utils import counters

    from moe.model.compile import compile_blocks

    _needs_grouped_kernel()
    torch._dynamo.reset()
    counters.clear()
    variant = VARIANTS["documents_flex"]
    eager = tiny_model("chunked", **copy.deepcopy(variant))
    compiled = tiny_model("chunked", **copy.deepcopy(variant))
    compiled.load_state_dict(eager.state_dict())
    compile_blocks(compiled)
    _compare_compiled(eager, compiled, counters, seed=20, documents=True)
    _no_sync_steps(compiled, "documents_flex")


def _compare_compiled(eager, compiled, counters, seed: int, documents: bool = False) -> None:
    """Three steps of both models on the same batches: the compiled one's losses and gradients
    within bf16's 2e-2 of the eager one's, no graph break, nothing compiled after step 1."""
    graphs = []
    for i in range(3):
        batch = _batch(seed + i, documents=documents)
        want = _step(eager, 0, batch=batch)
        got = _step(compiled, 0, batch=batch)
        graphs.append(counters["stats"]["unique_graphs"])
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert graphs[0] > 0 and graphs[-1] == graphs[0], graphs
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is None:
            continue
        err = (a.grad.float() - b.grad.float()).norm() / a.grad.float().norm().clamp_min(1e-6)
        assert err < 5e-2, (name, err.item())


def test_fused_projections_in_compiled_blocks_give_the_separate_products_results():
    """``model.qkv_projection: fused`` (the CUDA default) inside compiled blocks, bf16, GQA:
    no graph break, nothing compiled after the first step, and the losses and gradients of
    eager blocks computing three products from the same weights (bf16: 2e-2)."""
    from torch._dynamo.utils import counters

    from moe.model.compile import compile_blocks

    _needs_grouped_kernel()
    torch._dynamo.reset()
    counters.clear()
    separate = tiny_model("chunked", n_kv_heads=2)
    fused = tiny_model("chunked", n_kv_heads=2, qkv_projection="fused")
    fused.load_state_dict(separate.state_dict())
    compile_blocks(fused)
    _compare_compiled(separate, fused, counters, seed=30)


def test_compiled_lora_blocks_give_eager_results():
    """``train.compile: true`` with LoRA (not among an adapter method's CUDA defaults): bf16,
    no graph break, nothing compiled after the first step, eager's losses and gradients (the
    CPU checks every method: tests/moe/model/adapters/test_compiled_adapters.py)."""
    from torch._dynamo.utils import counters

    from moe.config.run import FinetuneConfig
    from moe.core.config_schema import from_dict
    from moe.model.compile import compile_blocks
    from moe.training.finetune import prepare_finetune

    _needs_grouped_kernel()
    torch._dynamo.reset()
    counters.clear()
    models = []
    for _ in range(2):
        model = tiny_model("chunked")  # on the GPU in bf16: the factors follow the weights
        prepare_finetune(model, from_dict(FinetuneConfig, {"method": "lora"}))
        torch.manual_seed(2)
        for p in model.parameters():  # the B factors start at zero: make the adapters count
            if p.requires_grad and not p.any():
                torch.nn.init.normal_(p, std=0.05)
        models.append(model)
    eager, compiled = models
    compiled.load_state_dict(eager.state_dict())
    compile_blocks(compiled)
    _compare_compiled(eager, compiled, counters, seed=40)


def test_a_fused_adamw_step_never_syncs():
    params = [torch.randn(n, device="cuda", requires_grad=True) for n in (1000, 4096, 7)]
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # state is created
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _loss_and_grads(impl: str, h, w, t, chunk: int = 1024):
    from moe.model.loss import LMHeadLoss, full_cross_entropy

    h = h.detach().requires_grad_()
    w = w.detach().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    if impl == "full":
        loss = full_cross_entropy(h @ w.t(), t)
    else:
        loss = LMHeadLoss(impl, chunk)(h, w, t)
    (loss / t.numel()).backward()
    torch.cuda.synchronize()
    return loss.detach(), h.grad, w.grad, torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("impl", ["chunked", LIGER])
def test_the_fused_losses_match_full_in_bf16_and_save_memory(impl):
    """moe-125m's head: 16,384 tokens, d 768, vocabulary 32,000, bf16. Against an fp32
    reference of the same bf16 inputs: the loss and both gradients as close as the full
    loss's (2x its error, plus 2^-9), and at most half its peak memory."""
    g = torch.Generator(device="cuda").manual_seed(0)
    T, D, V = 16384, 768, 32000
    h = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    w = (torch.randn(V, D, device="cuda", generator=g) * 0.02).bfloat16()
    t = torch.randint(0, V, (T,), device="cuda", generator=g)
    t[:100] = -100
    ref = _loss_and_grads("full", h.float(), w.float(), t)
    full = _loss_and_grads("full", h, w, t)
    got = _loss_and_grads(impl, h, w, t)

    def err(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    for i in range(3):
        assert err(got[i], ref[i]) <= 2 * err(full[i], ref[i]) + 2**-9, (i, err(got[i], ref[i]))
    assert got[3] < 0.5 * full[3], (got[3], full[3])
    print(
        f"peak memory of head and loss: full {full[3] / 2**20:.0f} MiB, {impl} "
        f"{got[3] / 2**20:.0f} MiB"
    )


def _engine_dict(model: dict, train: dict, zero_stage: int = 1) -> dict:
    """A small bf16 model on one GPU through the trainer's engine (DeepSpeed, ZeRO 1 or 2), with
    the plain settings (benchmarks/plain_settings.py) wherever ``model`` and ``train`` do not
    say otherwise: each test turns on the levers it compares, not the CUDA defaults."""
    moe = {"num_experts": 8, "expert_hidden": 64, "permute": "index_add", **model.pop("moe", {})}
    return {
        "model": {
            "vocab_size": 1024,
            "d_model": 128,
            "n_layers": 2,
            "n_heads": 4,
            "max_seq_len": 128,
            "cross_entropy": "full",
            "moe": moe,
            **model,
        },
        "data": {"seq_len": 128},
        "train": {
            "micro_batch_size": 4,
            "precision": "bf16",
            "seed": 1,
            "lr": 3e-3,
            "warmup_steps": 0,
            "compile": False,
            "immediate_grad_update": False,
            "flat_grad_ops": False,
            "optimizer_impl": "foreach",
            **train,
        },
        "parallel": {"world_size": 1, "expert_parallel_size": 1, "zero_stage": zero_stage},
    }


def _fused_engine(rank, world, out_path):
    import torch.optim.adam as adam

    from moe.config.run import RunConfig
    from moe.core.config_schema import from_dict
    from moe.training.trainer import DistEnv, build_engine

    fused = []
    real = adam._fused_adam

    def counted(*args, **kwargs):
        fused.append(1)
        return real(*args, **kwargs)

    adam._fused_adam = counted
    losses, syncs = {}, {}
    for name, impl, loss, immediate, flat, stage in (
        ("foreach", "foreach", "full", False, False, 1),
        ("fused", "fused", "full", False, False, 1),
        ("fused_chunked", "fused", "chunked", False, False, 1),
        ("foreach_immediate", "foreach", "full", True, False, 1),
        ("foreach_flat", "foreach", "full", False, True, 1),
        ("foreach_zero2", "foreach", "full", False, False, 2),
        ("foreach_zero2_flat", "foreach", "full", False, True, 2),
    ):
        cfg = _engine_dict(
            {"cross_entropy": loss, "cross_entropy_chunk_tokens": 200},
            {"optimizer_impl": impl, "immediate_grad_update": immediate, "flat_grad_ops": flat},
            zero_stage=stage,
        )
        engine, _ = build_engine(from_dict(RunConfig, cfg), DistEnv(rank, world, rank, world))
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(0, 1024, (4, 129), generator=g).to(engine.device)
        run = []
        for i in range(5):  # one batch again and again: the loss must fall
            out = engine(ids[:, :-1], ids[:, 1:])
            engine.backward(out.loss)
            if i < 4:
                engine.step()
            else:  # the last optimizer step's host synchronisations
                torch.cuda.synchronize()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        engine.step()
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                syncs[name] = sum("synchroniz" in str(w.message).lower() for w in caught)
            run.append(out.loss.item())
        losses[name] = run
    Path(out_path).write_text(
        json.dumps({"losses": losses, "fused_calls": len(fused), "syncs": syncs})
    )


def test_fused_adamw_and_the_chunked_loss_under_deepspeed_bf16_zero1(tmp_path):
    """Through the trainer's engine: fused AdamW runs (its kernel is called) and trains as
    foreach does; the chunked loss's gradients reach DeepSpeed's bf16 optimizer as the full
    loss's do, and train.flat_grad_ops's flat norm, clipping, adds and reduction train as
    DeepSpeed's own do. Tolerance 2e-2: bf16 weights, five steps. train.immediate_grad_update
    gives foreach's losses exactly; at ZeRO 2, train.flat_grad_ops's multi-tensor norm gives
    them within 1e-3."""
    out = tmp_path / "fused.json"
    run_distributed(_fused_engine, 1, str(out), backend="nccl")
    r = json.loads(out.read_text())
    assert r["fused_calls"] > 0
    a = torch.tensor(r["losses"]["foreach"])
    for name in ("fused", "fused_chunked", "foreach_flat"):
        b = torch.tensor(r["losses"][name])
        assert torch.isfinite(b).all() and b[-1] < b[0]
        torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-2)
    # train.flat_grad_ops at bf16 ZeRO 1: DeepSpeed's norm read per group (this model's MoE
    # layers: the non-expert group and an expert group), its validity and combination, the
    # "invalid" tensor made per group; replaced by one read (is the norm finite?).
    assert r["syncs"]["foreach_flat"] == 1 and r["syncs"]["foreach"] >= 4, r["syncs"]
    # train.immediate_grad_update: the same additions into the fp32 buffer, as each gradient
    # is produced instead of after the backward.
    assert r["losses"]["foreach_immediate"] == r["losses"]["foreach"]
    # ZeRO 2's norm by one multi-tensor call in fp64: the same norms up to fp64 rounding.
    torch.testing.assert_close(
        torch.tensor(r["losses"]["foreach_zero2_flat"]),
        torch.tensor(r["losses"]["foreach_zero2"]),
        rtol=1e-3,
        atol=1e-3,
    )


def _cuda_graph_engine(rank, world, out_path):
    from torch._dynamo.utils import counters

    from moe.config.run import RunConfig
    from moe.core.config_schema import from_dict
    from moe.training.trainer import DistEnv, build_engine

    replays = []
    real_replay = torch.cuda.CUDAGraph.replay

    def counted(self):
        replays.append(1)
        return real_replay(self)

    torch.cuda.CUDAGraph.replay = counted
    results = {}
    for name, graphs in (("eager", False), ("graphs", True)):  # one compile: the proof's time
        torch._dynamo.reset()
        counters.clear()
        replays.clear()
        cfg = _engine_dict(
            {"moe": {"num_experts": 8, "expert_hidden": 64, "num_shared_experts": 1}},
            {
                "grad_accum_steps": 2,
                "compile": graphs,
                "cuda_graphs": graphs,
                "immediate_grad_update": True,
            },
        )
        engine, _ = build_engine(from_dict(RunConfig, cfg), DistEnv(rank, world, rank, world))
        g = torch.Generator().manual_seed(3)
        micro = [torch.randint(0, 1024, (4, 129), generator=g).to(engine.device) for _ in range(2)]
        run = []
        for _ in range(6):  # the same two micro-batches every step: the loss must fall
            for ids in micro:
                out = engine(ids[:, :-1], ids[:, 1:])
                engine.backward(out.loss)
                engine.step()
            run.append(out.loss.item())
        results[name] = {
            "losses": run,
            "skips": counters["inductor"]["cudagraph_skips"],
            "replays": len(replays),
        }
    Path(out_path).write_text(json.dumps(results))


def test_cuda_graphs_replay_the_compiled_blocks_and_train_as_compiled_blocks(tmp_path):
    """train.cuda_graphs through the trainer's engine, bf16, ZeRO 1 with
    train.immediate_grad_update (the matrix's setting), two micro-batches a step: no graph is
    skipped, recorded graphs are replayed, and the losses follow eager ones (2e-2: bf16, six
    steps). A gradient overwritten by the next replay would
    double or lose a micro-batch's share and part from them at once. (ZeRO 2, also accepted,
    is left out: each compile here costs the GPU proof's time.)"""
    out = tmp_path / "graphs.json"
    run_distributed(_cuda_graph_engine, 1, str(out), backend="nccl")
    r = json.loads(out.read_text())
    base = torch.tensor(r["eager"]["losses"])
    assert base[-1] < base[0] and r["eager"]["replays"] == 0
    graphs = r["graphs"]
    assert graphs["skips"] == 0 and graphs["replays"] > 0, graphs
    torch.testing.assert_close(torch.tensor(graphs["losses"]), base, rtol=2e-2, atol=2e-2)


def test_which_sdpa_kernel_runs_at_2048_tokens():
    """Plain causal attention (what sdpa and auto run without documents) takes a fused kernel at
    moe-125m's shape: flash, or cuDNN's (which torch 2.11 prefers on an H200): bitwise what one
    of them gives alone. Packed documents on auto/CUDA run flex, equal to the reference's
    explicit mask (which neither fused kernel takes) within bf16 rounding."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from moe.model.attention import AttentionInputs, attention_core, build_attention_inputs
    from moe.model.positions import RotaryEmbedding

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(2, 12, 2048, 64, device="cuda", generator=g).bfloat16() for _ in range(3)
    )
    plain = AttentionInputs(None, None, backend="sdpa")
    chosen = attention_core(q, k, v, plain, False)
    fused = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with sdpa_kernel([backend]):  # raises if that kernel cannot run it
                fused[backend.name] = torch.equal(attention_core(q, k, v, plain, False), chosen)
        except RuntimeError as e:
            fused[backend.name] = str(e)[:80]
    assert True in fused.values(), fused
    docs = (torch.arange(2048, device="cuda")[None] // 700).expand(2, -1)
    pos = torch.arange(2048, device="cuda")[None]
    rope = RotaryEmbedding(64)
    flex = build_attention_inputs("auto", rope, pos, docs, 2)
    ref = build_attention_inputs("reference", rope, pos, docs, 2)
    assert flex.backend == "flex" and ref.mask is not None
    with pytest.raises(RuntimeError), sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        attention_core(q, k, v, dataclasses.replace(ref, rotary=None), False)
    torch.testing.assert_close(
        attention_core(q, k, v, flex, False).float(),
        attention_core(q, k, v, ref, False).float(),
        rtol=2e-2,
        atol=2e-2,
    )


def test_the_gather_permutation_sums_each_tokens_copies_rounded_once_in_bf16():
    """``model.moe.permute=gather`` on CUDA: the combine and the dispatch's gradient equal the
    exact sums of the bf16 rows rounded once to bf16 (index_add adds in bf16, atomically)."""
    from moe.model.dispatcher import LocalDispatcher

    g = torch.Generator().manual_seed(0)
    T, K, E, D = 4096, 8, 64, 256
    idx = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K].cuda()
    gather, index_add = LocalDispatcher(E, "gather"), LocalDispatcher(E, "index_add")
    plan = gather.plan(idx, None)
    y = torch.randn(T * K, D, generator=g).cuda().bfloat16()
    exact = index_add.combine(y.double(), plan).bfloat16()
    assert torch.equal(gather.combine(y, plan), exact)

    x = torch.randn(T, D, generator=g).cuda().bfloat16().requires_grad_(True)
    x_ND = gather.dispatch(x, torch.ones(T, K, device="cuda"), plan)[0]
    x_ND.backward(y)
    assert torch.equal(x.grad, exact)
