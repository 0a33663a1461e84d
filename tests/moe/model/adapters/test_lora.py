"""LoRA as model code (moe/model/adapters/lora.py): the routed experts' grouped LoRA against a
per-expert loop, merging, freezing, and the config checks that refuse a target or rank by name."""

import pytest
import torch
import torch.nn.functional as F

import moe.model.experts as experts_mod
from moe.config.run import load_config
from moe.core.config_schema import from_dict
from moe.core.errors import ConfigError
from moe.model.adapters.lora import LoRAConfig, LoRAGroupedExperts, apply_lora, merge_lora
from moe.model.experts import uses_grouped_kernel
from moe.model.transformer import ModelConfig, MoETransformer
from moe.training.finetune import parameter_counts, prepare_finetune


def tiny_model(**moe) -> MoETransformer:
    torch.manual_seed(0)
    return MoETransformer(
        from_dict(
            ModelConfig,
            {
                "vocab_size": 64,
                "d_model": 32,
                "n_layers": 3,
                "n_heads": 4,
                "max_seq_len": 16,
                "moe": {
                    "num_experts": 4,
                    "expert_hidden": 16,
                    "first_dense_layers": 1,
                    "num_shared_experts": 1,
                    **moe,
                },
            },
        )
    )


def _randomize_factors(model):
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def _reference_experts(mod, x_ND, counts, scale_N):
    """One expert at a time, in plain matmuls: the function the grouped pass must compute."""
    s, rows, start = mod.lora_scale, [], 0
    for e, n in enumerate(counts):
        x = x_ND[start : start + n]
        h = x @ mod.w_in[e] + s * (x @ mod.w_in_lora_A[e]) @ mod.w_in_lora_B[e]
        gate, up = h.split(mod.hidden, dim=-1)
        h = F.silu(gate) * up
        y = h @ mod.w_out[e] + s * (h @ mod.w_out_lora_A[e]) @ mod.w_out_lora_B[e]
        rows.append(y * scale_N[start : start + n, None])
        start += n
    return torch.cat(rows)


@pytest.mark.parametrize("expert_rank", ["full", "per_top_k"])
def test_grouped_expert_lora_equals_a_per_expert_loop(monkeypatch, expert_rank):
    model = tiny_model(router={"top_k": 2})
    apply_lora(model, LoRAConfig(targets=["experts"], rank=8, alpha=4.0, expert_rank=expert_rank))
    _randomize_factors(model)
    mod = model.blocks[1].ffn.experts
    assert isinstance(mod, LoRAGroupedExperts)
    rank = 8 if expert_rank == "full" else 4  # r / top_k
    assert mod.w_in_lora_A.shape == (4, 32, rank) and mod.w_out_lora_B.shape == (4, rank, 32)
    assert mod.lora_scale == 4.0 / rank
    counts = [5, 0, 7, 4]  # expert 1 gets no token
    gen = torch.Generator().manual_seed(2)
    x_ND = torch.randn(sum(counts), 32, generator=gen, requires_grad=True)
    scale_N = torch.rand(sum(counts), generator=gen)
    # The grouped kernel runs every product (no loop over experts anywhere).
    assert all(uses_grouped_kernel(x_ND, w) for w in mod.parameters(recurse=False))
    monkeypatch.setattr(experts_mod, "_loop_mm", lambda *a: pytest.fail("looped over experts"))
    got = mod(x_ND, torch.tensor(counts), scale_N)
    grads = torch.autograd.grad(got.square().sum(), [x_ND, *mod.parameters(recurse=False)])
    want = _reference_experts(mod, x_ND, counts, scale_N)
    want_grads = torch.autograd.grad(want.square().sum(), [x_ND, *mod.parameters(recurse=False)])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert grads[-1][1].abs().sum() == 0  # the expert without tokens gets no gradient


@pytest.mark.parametrize("dtype,rank", [(torch.bfloat16, 4), (torch.float32, 2)])
def test_a_rank_the_kernel_cannot_take_is_padded_not_looped(monkeypatch, dtype, rank):
    """bf16 rank 4 (8-byte rows; the shipped LoRA config's per-expert rank) and fp32 rank 2 run
    the grouped kernel on zero-padded factors: the same function and gradients as the per-expert
    reference, the factors keep their shapes, and no host sync is needed."""
    model = tiny_model(router={"top_k": 2})
    apply_lora(model, LoRAConfig(targets=["experts"], rank=rank, alpha=4.0))
    _randomize_factors(model)
    mod = model.blocks[1].ffn.experts.to(dtype)
    assert mod.w_in_lora_A.shape == (4, 32, rank)
    assert not all(
        uses_grouped_kernel(torch.empty(1, 32, dtype=dtype), w)
        for w in mod.parameters(recurse=False)
    )  # unpadded, the loop would run
    assert not mod.needs_host_counts(torch.empty(1, 32, dtype=dtype))
    monkeypatch.setattr(experts_mod, "_loop_mm", lambda *a: pytest.fail("looped over experts"))
    counts = [5, 0, 7, 4]
    gen = torch.Generator().manual_seed(2)
    x_ND = torch.randn(sum(counts), 32, generator=gen).to(dtype).requires_grad_(True)
    scale_N = torch.rand(sum(counts), generator=gen).to(dtype)
    got = mod(x_ND, torch.tensor(counts), scale_N)
    params = [x_ND, *mod.parameters(recurse=False)]
    grads = torch.autograd.grad(got.float().square().sum(), params)
    want = _reference_experts(mod, x_ND, counts, scale_N)
    want_grads = torch.autograd.grad(want.float().square().sum(), params)
    tol = {"rtol": 0, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got, want, **tol)
    for g, w, p in zip(grads, want_grads, params):
        assert g.shape == p.shape
        torch.testing.assert_close(g.float(), w.float(), **(tol | {"rtol": 5e-2}))


def test_merged_model_equals_the_adapted_one():
    model = tiny_model(router={"top_k": 2}, shared_expert_gate=True)
    apply_lora(
        model,
        LoRAConfig(
            targets=[
                "attention.q",
                "attention.k",
                "attention.v",
                "attention.o",
                "ffn",
                "shared_experts",
                "experts",
                "router",
            ],
            rank=4,
            dropout=0.1,
        ),
    )
    _randomize_factors(model)
    model.eval()  # no dropout: the merged weights compute the adapted function exactly
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    plain = tiny_model(router={"top_k": 2}, shared_expert_gate=True)
    with torch.no_grad():
        adapted = model(ids).logits
        base = plain(ids).logits
    assert (adapted - base).abs().max() > 1e-2  # the factors change the function
    # attention 4 x 3 layers, the dense layer 2, per MoE layer shared 2, experts 1, router 1
    assert merge_lora(model) == 4 * 3 + 2 + 2 * (2 + 1 + 1)
    assert model.state_dict().keys() == plain.state_dict().keys()
    with torch.no_grad():
        merged = model(ids).logits
    torch.testing.assert_close(merged, adapted, rtol=0, atol=1e-5)


def test_frozen_parameters_get_no_gradient():
    model = tiny_model()
    cfg = load_config(
        "configs/default.yaml",
        ["finetune.method=lora", "model.init_from=x", "finetune.lora.train_router=true"],
    ).finetune
    prepare_finetune(model, cfg)
    ids = torch.randint(0, 64, (2, 17))
    model(ids[:, :-1], ids[:, 1:]).loss.backward()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or n.endswith("router.weight") for n in trainable)
    assert {n for n in trainable if n.endswith("router.weight")} == {
        "blocks.1.ffn.router.weight",
        "blocks.2.ffn.router.weight",
    }
    for name, p in model.named_parameters():
        if name in trainable:
            assert p.grad is not None, name
        else:
            assert p.grad is None, name
    # B starts at zero, so the adapted model starts as the base; its gradient is not zero.
    assert model.blocks[0].attn.q_proj.lora_B.grad.abs().sum() > 0
    counts = parameter_counts(model)
    assert counts["trainable_params"] == sum(
        p.numel() for n, p in model.named_parameters() if n in trainable
    )
    assert 0 < counts["trainable_share"] < 0.5


def config_errors(*overrides) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config("configs/default.yaml", ["model.init_from=ckpt", *overrides])
    return e.value.problems


def test_bad_targets_and_ranks_are_refused_by_name():
    assert config_errors("finetune.method=lora", "finetune.lora.targets=[ffn]") == [
        "finetune.lora.targets: 'ffn' matches no layer of this model (it has no dense FFN layer)"
    ]
    (msg,) = config_errors(
        "finetune.method=lora", "finetune.lora.targets=[router]", "finetune.lora.rank=64"
    )
    assert msg.startswith("finetune.lora.rank: 64 exceeds the smaller dimension of router")
    (msg,) = config_errors(
        "finetune.method=lora",
        "finetune.lora.targets=[experts]",
        "finetune.lora.expert_rank=per_top_k",
        "finetune.lora.rank=1",
    )
    assert msg.startswith("finetune.lora.rank: 1 with expert_rank per_top_k")
    # A rank below 1 is named once, not blamed on a per_top_k expert rank it does not use.
    for expert_rank in ("full", "per_top_k"):
        assert config_errors(
            "finetune.method=lora",
            "finetune.lora.rank=0",
            f"finetune.lora.expert_rank={expert_rank}",
        ) == ["finetune.lora.rank: must be >= 1, got 0"]
    assert config_errors("finetune.method=lora", "finetune.lora.targets=[attention.x]")[
        0
    ].startswith("finetune.lora.targets[0]: 'attention.x' is not allowed")
    for method in ("full", "lora"):
        with pytest.raises(ConfigError) as e:
            load_config("configs/default.yaml", [f"finetune.method={method}"])
        assert e.value.problems == [
            f"model.init_from: finetune.method {method} starts from "
            "trained weights; set model.init_from to a checkpoint (or "
            "hf:DIR)"
        ]
    load_config("configs/default.yaml", ["finetune.method=full", "model.init_from=ckpt"])
    # The LoRA config asks for the base it adapts.
    with pytest.raises(ConfigError, match="model.init_from: finetune.method lora"):
        load_config("configs/finetune-lora.yaml")
    cfg = load_config("configs/finetune-lora.yaml", ["model.init_from=runs/default"])
    assert cfg.finetune.method == "lora" and cfg.finetune.lora.expert_rank_of(3) == 4


def test_cli_exits_2_naming_the_key(tmp_path, capsys):
    from launch.launch import main

    config = tmp_path / "c.yaml"
    config.write_text(f"name: x\noutput_dir: {tmp_path / 'runs'}\n")
    with pytest.raises(SystemExit) as e:
        main(
            [
                str(config),
                "--dry-run",
                "model.init_from=ckpt",
                "finetune.method=lora",
                "finetune.lora.rank=100000",
            ]
        )
    assert e.value.code == 2
    assert "finetune.lora.rank: 100000 exceeds the smaller dimension" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
