"""The calculator against the instantiated model (exact parameter counts, measured FLOPs and
saved activations) and the presets against their published sizes."""

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from launch.plan import build_report
from moe.config.run import load_config
from moe.model.moe_layer import MoEConfig
from moe.model.router import RouterConfig
from moe.model.size import count_parameters, flops_per_token
from moe.model.transformer import ModelConfig, MoETransformer
from moe.tools.planning import USABLE_FRACTION, activation_bytes, memory_per_gpu


def component_of(name: str) -> str:
    """Which calculator component a parameter of the single-device model belongs to."""
    if name.startswith("embed."):
        return "embedding"
    if name.startswith("positions."):
        return "positions"
    if name.startswith("lm_head."):
        return "lm_head"
    if ".attn." in name:
        return "attention"
    if "norm" in name:
        return "norms"
    if ".ffn.router." in name:
        return "router"
    if ".ffn.experts." in name:
        return "routed_experts"
    if ".ffn.shared_mlp." in name or ".ffn.shared_gate." in name:
        return "shared_experts"
    assert ".ffn.w_" in name, name
    return "dense_ffn"


def measured_counts(model: torch.nn.Module) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, p in model.named_parameters():  # shared (tied) parameters appear once
        out[component_of(name)] = out.get(component_of(name), 0) + p.numel()
    return out


def small(**kw) -> ModelConfig:
    base = dict(
        vocab_size=97,
        d_model=32,
        n_layers=3,
        n_heads=4,
        max_seq_len=40,
        moe=MoEConfig(num_experts=4, expert_hidden=24),
    )
    base.update(kw)
    return ModelConfig(**base)


VARIANTS = {
    "default": small(),
    "gqa_tied_learned": small(n_kv_heads=2, tie_embeddings=True, position="learned"),
    "mqa_t5_layernorm_post": small(
        n_kv_heads=1, position="t5", norm="layernorm", norm_placement="post"
    ),
    "alibi_gelu_shared_first_dense": small(
        position="alibi",
        moe=MoEConfig(
            num_experts=6,
            expert_hidden=16,
            activation="gelu",
            num_shared_experts=2,
            first_dense_layers=1,
            router=RouterConfig(top_k=3),
        ),
    ),
    "every_other_layer_sinusoidal": small(
        position="sinusoidal",
        n_layers=4,
        moe=MoEConfig(num_experts=4, expert_hidden=24, every_n_layers=2, dense_hidden=40),
    ),
    "dense": small(ffn="dense"),
    "head_dim_qkv_bias_head_norm": small(n_kv_heads=2, head_dim=12, qkv_bias=True, qk_norm="head"),
    "projection_norm_gated_shared": small(
        head_dim=6,
        qk_norm="projection",
        moe=MoEConfig(
            num_experts=4, expert_hidden=8, num_shared_experts=2, shared_expert_gate=True
        ),
    ),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_parameter_counts_match_the_model_exactly(name):
    cfg = VARIANTS[name]
    assert not cfg.problems()
    counts = count_parameters(cfg)
    model = MoETransformer(cfg)
    measured = measured_counts(model)
    assert {k: v for k, v in counts.total.items() if v} == measured
    assert counts.total_params == sum(p.numel() for p in model.parameters())
    # Active: top_k of the routed experts of each MoE layer.
    k, e = cfg.moe.router.top_k, cfg.moe.num_experts
    assert counts.active["routed_experts"] * e == counts.total["routed_experts"] * k


def test_dense_baseline_has_the_moe_active_parameters_minus_the_router():
    for moe in (
        MoEConfig(num_experts=8, expert_hidden=24),
        MoEConfig(
            num_experts=8, expert_hidden=16, num_shared_experts=1, router=RouterConfig(top_k=3)
        ),
    ):
        sparse = small(moe=moe)
        dense = dataclasses.replace(sparse, ffn="dense")
        assert all(type(b.ffn).__name__ == "DenseFFN" for b in MoETransformer(dense).blocks)
        a = count_parameters(sparse)
        assert count_parameters(dense).total_params == a.active_params - a.total["router"]
        assert (
            sum(p.numel() for p in MoETransformer(dense).parameters())
            == a.active_params - a.total["router"]
        )


@pytest.mark.parametrize(
    "extra",
    [{}, {"head_dim": 12, "qkv_bias": True, "qk_norm": "head"}],
    ids=["plain", "head_dim_bias_norm"],
)
def test_forward_matmul_flops_match_a_flop_counter(extra):
    # FlopCounterMode counts aten.mm (projections, FFNs, head); not CPU SDPA or grouped GEMMs,
    # so the dense model is the exact check of the 2 * N_matmul term.
    cfg = small(ffn="dense", n_kv_heads=2, **extra)
    model = MoETransformer(cfg)
    ids = torch.randint(0, 97, (2, 40))
    with FlopCounterMode(display=False) as counter:
        model(ids)
    f = flops_per_token(cfg, seq_len=40)
    assert counter.get_total_flops() / ids.numel() == 2 * f["matmul_params"]
    assert f["attention_forward"] == 4 * 3 * 40 * cfg.n_heads * cfg.head_size
    assert (
        f["training"] == 3 * f["forward"] == 3 * (2 * f["matmul_params"] + f["attention_forward"])
    )


@pytest.mark.parametrize("name", ["default", "alibi_gelu_shared_first_dense", "dense"])
def test_activation_estimate_is_close_to_what_autograd_saves(name):
    cfg = dataclasses.replace(VARIANTS[name], vocab_size=512, d_model=64, max_seq_len=128)
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, 512, (4, 128))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, ids)
    estimate = activation_bytes(cfg, 4, 128, "fp32").saved_bytes
    assert 0.8 < sum(saved.values()) / estimate < 1.25


def test_memory_under_zero_stages_and_expert_parallelism():
    cfg = small()
    c = count_parameters(cfg)
    experts, others = c.total["routed_experts"], c.total_params - c.total["routed_experts"]
    m0, m1, m2 = (memory_per_gpu(cfg, 8, 4, z, "bf16", 2, 40) for z in (0, 1, 2))
    # Each rank holds the non-expert parameters and 1/ep of the experts.
    assert m0.params_per_gpu == others + experts / 4
    assert m0.weights_bytes == m1.weights_bytes == m2.weights_bytes == 2 * (others + experts / 4)
    assert m0.grads_bytes == m1.grads_bytes == 2 * (others + experts / 4)
    assert m0.optimizer_bytes == 12 * (others + experts / 4)
    # ZeRO-1/2 partition over the 8 data-parallel ranks, experts over the 8/4 = 2 expert-data ranks.
    assert m1.optimizer_bytes == m2.optimizer_bytes == 12 * (others / 8 + experts / 4 / 2)
    assert m2.grads_bytes == 2 * (others / 8 + experts / 4 / 2)
    fp32 = memory_per_gpu(cfg, 1, 1, 2, "fp32", 2, 40)
    assert fp32.model_states_bytes == 16 * c.total_params
    # train.immediate_grad_update keeps no bf16 gradient (DeepSpeed's BF16 optimizer: ZeRO 1).
    m1i = memory_per_gpu(cfg, 8, 4, 1, "bf16", 2, 40, immediate_grad_update=True)
    assert m1i.grads_bytes == 0
    assert m1.total_bytes - m1i.total_bytes == m1.grads_bytes
    m2i = memory_per_gpu(cfg, 8, 4, 2, "bf16", 2, 40, immediate_grad_update=True)
    assert m2i == m2  # not an option at stage 2: nothing changes


PRESETS = [
    "configs/default.yaml",
    "configs/moe-125m.yaml",
    "configs/moe-1b.yaml",
    "configs/mixtral-8x7b.yaml",
    "configs/deepseek-moe-16b.yaml",
]


@pytest.mark.parametrize("path", PRESETS)
def test_presets_validate_and_instantiate_on_the_meta_device(path):
    cfg = load_config(path)
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = cfg.data.tokenizer.vocab_size
    with torch.device("meta"):
        model = MoETransformer(cfg.model)
    assert sum(p.numel() for p in model.parameters()) == count_parameters(cfg.model).total_params
    assert measured_counts(model) == {
        k: v for k, v in count_parameters(cfg.model).total.items() if v
    }
    report = build_report(
        cfg, cfg.parallel.world_size, cfg.parallel.expert_parallel_size, [0, 1, 2]
    )
    assert [m["zero_stage"] for m in report["memory"]] == [0, 1, 2]


@pytest.mark.parametrize(
    "path, total, active, tol",
    [
        ("configs/mixtral-8x7b.yaml", 46.7e9, 12.9e9, 0.01),  # Mixtral of Experts, 2024
        ("configs/deepseek-moe-16b.yaml", 16.4e9, 2.8e9, 0.02),  # DeepSeekMoE, 2024 (2.8B rounded)
        ("configs/moe-125m.yaml", None, 125e6, 0.02),
    ],
)
def test_preset_sizes_match_published_counts(path, total, active, tol):
    c = count_parameters(load_config(path).model)
    if total is not None:
        assert abs(c.total_params / total - 1) < tol, c.total_params
    assert abs(c.active_params / active - 1) < tol, c.active_params


def test_the_1b_preset_has_olmoe_routing_fits_one_gpu_and_a_dense_twin_of_equal_active_size():
    cfg = load_config("configs/moe-1b.yaml")
    m = cfg.model
    assert (m.moe.num_experts, m.moe.router.top_k, m.moe.num_shared_experts) == (64, 8, 0)
    assert m.moe.expert_hidden % 64 == 0 and m.moe.dense_width % 64 == 0
    moe = count_parameters(m)
    assert 0.95e9 < moe.total_params < 1.1e9 and moe.active_params < 0.25 * moe.total_params
    dense = count_parameters(load_config("configs/moe-1b.yaml", ["model.ffn=dense"]).model)
    assert dense.active_params == moe.active_params - moe.active["router"]
    assert dense.active["dense_ffn"] == moe.active["routed_experts"]
    # Trains on one 80 GB GPU with ZeRO 1, as the preset says (moe-plan's total).
    t = cfg.train
    assert (
        cfg.parallel.world_size,
        cfg.parallel.expert_parallel_size,
        cfg.parallel.zero_stage,
    ) == (1, 1, 1)
    plan = memory_per_gpu(m, 1, 1, 1, t.precision, t.micro_batch_size, cfg.data.seq_len)
    assert plan.total_bytes < USABLE_FRACTION * 80 * 2**30


def test_mixtral_preset_shape():
    m = load_config("configs/mixtral-8x7b.yaml").model
    assert (m.n_layers, m.d_model, m.n_heads, m.kv_heads, m.vocab_size) == (32, 4096, 32, 8, 32000)
    assert (m.moe.num_experts, m.moe.router.top_k, m.moe.expert_hidden) == (8, 2, 14336)
    assert m.moe.router.order == "topk_then_softmax" and m.rope_theta == 1e6
    assert not m.tie_embeddings and m.position == "rope"


def test_deepseek_preset_has_fine_grained_shared_experts_and_a_dense_first_layer():
    m = load_config("configs/deepseek-moe-16b.yaml").model
    assert m.moe.num_shared_experts == 2 and m.moe.num_experts == 64 and m.moe.router.top_k == 6
    assert [m.is_moe_layer(i) for i in range(3)] == [False, True, True]
