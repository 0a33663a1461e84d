"""Model options in the YAML config: validation messages, the documented initialization, tied
embeddings, and the dense / MoE choice per layer."""

import math

import pytest
import torch
import yaml

from moe.config.run import load_config
from moe.core.errors import ConfigError
from moe.model.moe_layer import MoEConfig
from moe.model.transformer import ModelConfig, MoETransformer


def test_new_options_load_from_yaml(tmp_path):
    cfg = load_config(
        "configs/default.yaml",
        [
            "model.position=t5",
            "model.norm=layernorm",
            "model.norm_placement=post",
            "model.n_kv_heads=1",
            "model.ffn=dense",
            "model.tie_embeddings=true",
        ],
    )
    m = cfg.model
    assert (m.position, m.norm, m.norm_placement, m.kv_heads, m.ffn, m.tie_embeddings) == (
        "t5",
        "layernorm",
        "post",
        1,
        "dense",
        True,
    )


def config_problems(tmp_path, model: dict) -> str:
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump({"model": model}))
    with pytest.raises(ConfigError) as e:
        load_config(p)
    return str(e.value)


@pytest.mark.parametrize(
    "model, expected",
    [
        (
            {"position": "xpos", "norm": "batchnorm", "norm_placement": "middle", "ffn": "sparse"},
            [
                "model.position: 'xpos' is not allowed",
                "model.norm: 'batchnorm'",
                "model.norm_placement: 'middle'",
                "model.ffn: 'sparse'",
            ],
        ),
        # Value checks (they run once the types are right).
        (
            {
                "n_heads": 4,
                "n_kv_heads": 3,
                "t5_num_buckets": 1,
                "upcycle_noise_std": -1,
                "rope_theta": 0.5,
            },
            [
                "model.n_kv_heads: 3 must divide n_heads (4)",
                "model.t5_num_buckets",
                "model.upcycle_noise_std",
                "model.rope_theta",
            ],
        ),
        ({"qk_norm": "layer"}, ["model.qk_norm: 'layer' is not allowed"]),
        (
            {"head_dim": 0, "moe": {"shared_expert_gate": True}},
            [
                "model.head_dim: must be >= 1",
                "model.moe.shared_expert_gate: true needs num_shared_experts >= 1",
            ],
        ),
        (
            {"d_model": 30, "n_heads": 4, "head_dim": 7},
            ["model.head_dim: the head dim (7) must be even for rotary embeddings"],
        ),
    ],
    ids=["choices", "values", "qk-norm-choice", "head-dim-shared-gate", "odd-head-dim"],
)
def test_invalid_model_options_are_all_named(tmp_path, model, expected):
    msg = config_problems(tmp_path, model)
    for text in expected:
        assert text in msg, msg


def test_odd_head_dim_is_only_a_problem_for_rope():
    odd = dict(vocab_size=50, d_model=12, n_heads=4)  # head dim 3
    assert any("rotary" in p for p in ModelConfig(**odd).problems())
    for position in ("sinusoidal", "learned", "alibi", "t5"):
        assert not ModelConfig(position=position, **odd).problems()


def test_head_dim_frees_the_head_width_from_d_model():
    cfg = ModelConfig(vocab_size=50, d_model=30, n_heads=4, n_kv_heads=2, head_dim=8)
    assert not cfg.problems()  # 30 is not divisible by 4: fine with an explicit head_dim
    attn = MoETransformer(cfg).blocks[0].attn
    assert attn.q_proj.weight.shape == (32, 30) and attn.k_proj.weight.shape == (16, 30)
    assert attn.o_proj.weight.shape == (30, 32)
    assert "d_model: 30 must be divisible by n_heads (4)" in " ".join(
        ModelConfig(vocab_size=50, d_model=30, n_heads=4).problems()
    )


def test_options_of_open_weights_models_start_neutral():
    """q/k/v biases start at 0, query/key norm gains at 1, the shared-expert gate like the
    other input projections."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=50,
        d_model=64,
        n_heads=4,
        qkv_bias=True,
        qk_norm="head",
        moe=MoEConfig(num_shared_experts=1, shared_expert_gate=True),
    )
    block = MoETransformer(cfg).blocks[0]
    for proj in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj):
        assert (proj.bias == 0).all()
    assert block.attn.o_proj.bias is None
    assert (block.attn.q_norm.weight == 1).all() and block.attn.k_norm.weight.shape == (16,)
    assert block.ffn.shared_gate.weight.shape == (1, 64)
    assert block.ffn.shared_gate.weight.std().item() == pytest.approx(0.02, rel=0.3)


def test_documented_initialization():
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=2000,
        d_model=128,
        n_layers=8,
        n_heads=4,
        position="learned",
        max_seq_len=512,
        moe=MoEConfig(num_experts=4, expert_hidden=256, num_shared_experts=1),
    )
    model = MoETransformer(cfg)
    out_std = 0.02 / math.sqrt(2 * 8)
    block = model.blocks[0]
    expected = {
        model.embed.weight: 0.02,
        model.lm_head.weight: 0.02,
        model.positions.table.weight: 0.02,
        block.attn.q_proj.weight: 0.02,
        block.attn.v_proj.weight: 0.02,
        block.ffn.experts.w_in: 0.02,
        block.ffn.shared_mlp.w_in.weight: 0.02,
        block.attn.o_proj.weight: out_std,
        block.ffn.experts.w_out: out_std,
        block.ffn.shared_mlp.w_out.weight: out_std,
    }
    for p, std in expected.items():
        assert p.std().item() == pytest.approx(std, rel=0.05)
        assert abs(p.mean().item()) < std * 0.05
    assert (block.attn_norm.weight == 1).all()


def test_tied_embeddings_share_one_matrix_and_receive_both_gradients():
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=50,
        d_model=16,
        n_layers=1,
        n_heads=2,
        tie_embeddings=True,
        moe=MoEConfig(num_experts=2, expert_hidden=8),
    )
    model = MoETransformer(cfg)
    assert model.lm_head.weight is model.embed.weight
    ids = torch.tensor([[3, 4, 5]])
    model(ids, ids).loss.backward()
    # Row 7 is never an input but gets a gradient through the head's softmax.
    assert model.embed.weight.grad[7].abs().sum() > 0
    untied = MoETransformer(ModelConfig(**{**cfg.__dict__, "tie_embeddings": False}))
    assert (
        sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in model.parameters())
        == 50 * 16
    )


def test_ffn_choice_per_layer():
    moe = MoEConfig(num_experts=4, expert_hidden=8, every_n_layers=2, first_dense_layers=1)
    cfg = ModelConfig(vocab_size=50, d_model=16, n_layers=5, n_heads=2, moe=moe)
    kinds = [type(b.ffn).__name__ for b in MoETransformer(cfg).blocks]
    assert kinds == ["DenseFFN", "MoELayer", "DenseFFN", "MoELayer", "DenseFFN"]
    dense = ModelConfig(**{**cfg.__dict__, "ffn": "dense"})
    blocks = MoETransformer(dense).blocks
    assert all(type(b.ffn).__name__ == "DenseFFN" and b.ffn.hidden == 16 for b in blocks)
