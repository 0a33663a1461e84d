"""Bottleneck adapters (finetune.method adapter): the base function at step 0, the placement,
the frozen base, the config checks, and a real trainer run with expert parallelism 2."""

import copy

import pytest
import torch
import torch.nn.functional as F

from moe.config.run import RunConfig, load_config
from moe.core.config_schema import from_dict
from moe.core.errors import ConfigError
from moe.model.adapters.bottleneck import BottleneckConfig
from moe.model.transformer import ModelConfig, MoETransformer
from moe.training.finetune import parameter_counts, prepare_finetune
from tests.helpers.distributed import run_distributed
from tests.helpers.finetune import base_and_finetune, latest_weights, losses_before_and_after


def tiny_model(**model) -> MoETransformer:
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
                },
                **model,
            },
        )
    )


def adapted(placement: str, **model) -> MoETransformer:
    m = tiny_model(**model)
    cfg = load_config(
        "configs/default.yaml",
        [
            "finetune.method=adapter",
            "model.init_from=x",
            "finetune.adapter.hidden=8",
            f"finetune.adapter.placement={placement}",
        ],
    ).finetune
    prepare_finetune(m, cfg)
    return m


IDS = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("placement,norm", [("both", "pre"), ("attention", "post"), ("ffn", "pre")])
def test_adapted_model_starts_as_the_base_exactly(placement, norm):
    base, model = tiny_model(norm_placement=norm), adapted(placement, norm_placement=norm)
    with torch.no_grad():
        assert torch.equal(model(IDS[:, :-1]).logits, base(IDS[:, :-1]).logits)
    names = {n.rsplit(".adapter.", 1)[0] for n, _ in model.named_parameters() if ".adapter." in n}
    subs = {"both": ["attn", "ffn"], "attention": ["attn"], "ffn": ["ffn"]}[placement]
    assert names == {f"blocks.{i}.{s}" for i in range(3) for s in subs}
    # Every base key is where it was; the adapters' keys come on top.
    assert set(base.state_dict()) < set(model.state_dict())


def test_only_adapters_train_and_they_change_the_function():
    model = adapted("both")
    model(IDS[:, :-1], IDS[:, 1:]).loss.backward()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in model.named_parameters() if ".adapter." in n}
    for name, p in model.named_parameters():
        assert (p.grad is not None) == (name in trainable), name
    # The zero up-projection gets a gradient; the down-projection none yet (its output is
    # multiplied by the zero up-projection).
    assert model.blocks[1].ffn.adapter.up.weight.grad.abs().sum() > 0
    assert model.blocks[1].ffn.adapter.down.weight.grad.abs().sum() == 0
    counts = parameter_counts(model)
    # 6 adapters of (32 x 8 + 8) + (8 x 32 + 32)
    assert counts["trainable_params"] == 6 * (32 * 8 + 8 + 8 * 32 + 32)
    assert counts["trainable_share"] < 0.2


def test_adapters_sit_after_the_sublayer_output():
    """y' = y + up(gelu(down(y))) with y the sublayer's own output (attention after o_proj; the
    MoE layer's combined output), inside the residual branch."""
    model, base = adapted("both"), tiny_model()
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".adapter." in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    x = torch.randn(2, 16, 32, generator=gen)
    block, base_block = model.blocks[1], base.blocks[1]
    with torch.no_grad():

        def reference(adapter, y):
            return y + F.linear(
                F.gelu(F.linear(y, adapter.down.weight, adapter.down.bias)),
                adapter.up.weight,
                adapter.up.bias,
            )

        y, aux = block.ffn(x)
        y_base, aux_base = base_block.ffn(x)
        torch.testing.assert_close(y, reference(block.ffn.adapter, y_base), rtol=0, atol=1e-6)
        assert torch.equal(aux, aux_base)
        _, inputs = model._attention_inputs(IDS[:, :-1], None, None)
        torch.testing.assert_close(
            block.attn(x, inputs),
            reference(block.attn.adapter, base_block.attn(x, inputs)),
            rtol=0,
            atol=1e-6,
        )
        assert not torch.allclose(model(IDS[:, :-1]).logits, base(IDS[:, :-1]).logits)


def test_bad_settings_are_refused_by_key():
    with pytest.raises(ConfigError) as e:
        load_config(
            "configs/default.yaml",
            [
                "model.init_from=ckpt",
                "finetune.method=adapter",
                "model.d_model=64",
                "model.n_heads=4",
                "finetune.adapter.hidden=65",
            ],
        )
    assert e.value.problems == [
        "finetune.adapter.hidden: 65 exceeds the model width (64); a bottleneck adapter "
        "narrows, use at most 64"
    ]
    with pytest.raises(ConfigError) as e:
        load_config(
            "configs/default.yaml",
            ["model.init_from=ckpt", "finetune.method=adapter", "finetune.adapter.hidden=0"],
        )
    assert e.value.problems == ["finetune.adapter.hidden: must be >= 1, got 0"]
    assert BottleneckConfig().placement == "both"


def _runs(rank, world, base, ft):
    from moe.training.trainer import DistEnv, train

    env = DistEnv(rank, world, rank, world)
    train(from_dict(RunConfig, copy.deepcopy(base)), env)
    train(from_dict(RunConfig, copy.deepcopy(ft)), env)


@pytest.mark.multiprocess
def test_adapter_run_trains_and_leaves_the_base_unchanged(tiny_data, tmp_path):
    runs = tmp_path / "runs"
    # A base 2 steps past its start: it has yet to learn the data's plain token statistics,
    # which the adapters learn in 8 steps. From a base trained 6 steps at lr 3e-3 they gained
    # under 0.01 on samples seen once, a difference the data draw decides.
    base, ft = base_and_finetune(
        tiny_data,
        runs,
        {"method": "adapter", "adapter": {"hidden": 16, "init_std": 0.2}},
        pretrain={"max_steps": 2, "lr": 1e-3},
        max_steps=8,
        lr=1e-2,
        weight_decay=0.1,
    )
    run_distributed(_runs, 2, base, ft)

    before, after = latest_weights(runs / "base"), latest_weights(runs / "ft")
    for name, w in before.items():
        assert torch.equal(after[name], w), name
    added = set(after) - set(before)
    assert added and all(".adapter." in n for n in added)
    assert all(after[n].abs().sum() > 0 for n in added if ".up." in n)  # they trained
    # It learns: the loss on the run's 64 samples, and held out, falls below the base's
    # (untrained adapters compute the base function exactly).
    loss, held_out = losses_before_and_after(tiny_data, runs, 8)
    # Measured over data seeds 7, 8, 9: 0.08 lower on the samples, 0.09 to 0.11 held out.
    assert loss["ft"] < loss["base"] - 0.03, loss
    assert held_out["ft"] < held_out["base"] - 0.03, held_out
