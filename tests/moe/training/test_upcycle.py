"""Dense-to-MoE upcycling: step-0 equivalence, noise, fresh router, clear errors."""

import dataclasses

import pytest
import torch

from moe.core.errors import CheckpointError
from moe.model.moe_layer import MoEConfig
from moe.model.router import RouterConfig
from moe.model.transformer import ModelConfig, MoETransformer
from moe.training.upcycle import incompatibilities, upcycle_state_dict

HIDDEN = 48


def dense_config(**kw) -> ModelConfig:
    # ffn=dense with dense_hidden=HIDDEN: every layer a dense FFN of width HIDDEN.
    return ModelConfig(
        vocab_size=83,
        d_model=32,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=32,
        ffn="dense",
        moe=MoEConfig(dense_hidden=HIDDEN),
        **kw,
    )


def moe_config(dense: ModelConfig, router: RouterConfig, **moe_kw) -> ModelConfig:
    return dataclasses.replace(
        dense,
        ffn="moe",
        moe=MoEConfig(
            num_experts=4, expert_hidden=HIDDEN, dense_hidden=HIDDEN, router=router, **moe_kw
        ),
    )


def trained_dense(cfg: ModelConfig) -> MoETransformer:
    """A dense model whose weights are not at their initialization (a few SGD steps)."""
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.randint(0, 83, (4, 17))
    for _ in range(3):
        opt.zero_grad()
        model(ids[:, :-1], ids[:, 1:]).loss.backward()
        opt.step()
    return model.eval()


@pytest.mark.parametrize(
    "router",
    [
        RouterConfig(top_k=2, renormalize=True),
        RouterConfig(top_k=2, order="topk_then_softmax"),
        RouterConfig(top_k=1, score_func="sigmoid", renormalize=True),
    ],
    ids=["softmax_topk_renorm", "topk_softmax", "sigmoid_top1_renorm"],
)
def test_upcycled_model_equals_dense_model_at_step_0(router):
    dense_cfg = dense_config(position="alibi", tie_embeddings=True)
    dense = trained_dense(dense_cfg)
    torch.manual_seed(5)
    moe = MoETransformer(moe_config(dense_cfg, router, first_dense_layers=1))
    fresh_router = moe.blocks[1].ffn.router.weight.detach().clone()
    moe.load_state_dict(upcycle_state_dict(dense.state_dict(), moe))
    moe.eval()
    assert [type(b.ffn).__name__ for b in moe.blocks] == ["DenseFFN", "MoELayer", "MoELayer"]
    # Every expert is the dense FFN; the router is the fresh one.
    layer = moe.blocks[1].ffn
    for e in range(4):
        torch.testing.assert_close(layer.experts.w_in[e], dense.blocks[1].ffn.w_in.weight.t())
        torch.testing.assert_close(layer.experts.w_out[e], dense.blocks[1].ffn.w_out.weight.t())
    torch.testing.assert_close(layer.router.weight, fresh_router)
    ids = torch.randint(0, 83, (3, 20))
    with torch.no_grad():
        torch.testing.assert_close(moe(ids).logits, dense(ids).logits, atol=1e-5, rtol=1e-5)


def test_weights_that_do_not_sum_to_one_break_the_equivalence():
    # Softmax-then-top-k without renormalization scales each token's FFN output by the share of
    # probability its experts hold (< 1): the precondition of the test above matters.
    dense_cfg = dense_config()
    dense = trained_dense(dense_cfg)
    moe = MoETransformer(moe_config(dense_cfg, RouterConfig(top_k=2)))
    moe.load_state_dict(upcycle_state_dict(dense.state_dict(), moe))
    ids = torch.randint(0, 83, (2, 12))
    with torch.no_grad():
        assert not torch.allclose(moe.eval()(ids).logits, dense(ids).logits, atol=1e-4)


def test_noise_makes_experts_differ_deterministically():
    dense_cfg = dense_config()
    dense = trained_dense(dense_cfg)
    moe = MoETransformer(moe_config(dense_cfg, RouterConfig(top_k=2, renormalize=True)))
    a = upcycle_state_dict(dense.state_dict(), moe, noise_std=0.05, seed=3)
    b = upcycle_state_dict(dense.state_dict(), moe, noise_std=0.05, seed=3)
    w = a["blocks.0.ffn.experts.w_in"]
    torch.testing.assert_close(w, b["blocks.0.ffn.experts.w_in"])
    base = dense.blocks[0].ffn.w_in.weight.t()
    rel = [((w[e] - base).std() / base.std()).item() for e in range(4)]
    assert all(0.03 < r < 0.07 for r in rel), rel
    assert not torch.allclose(w[0], w[1])


def test_mismatches_are_reported_by_key():
    dense_cfg = dense_config()
    dense = trained_dense(dense_cfg)
    wrong_width = dataclasses.replace(
        dense_cfg, ffn="moe", moe=MoEConfig(num_experts=4, expert_hidden=HIDDEN // 2)
    )
    with pytest.raises(CheckpointError, match="set model.moe.expert_hidden"):
        upcycle_state_dict(dense.state_dict(), MoETransformer(wrong_width))
    other = dataclasses.replace(dense_cfg, position="alibi", d_model=64)
    problems = incompatibilities(dense_cfg, other)
    assert any(p.startswith("model.position:") for p in problems)
    assert any(p.startswith("model.d_model:") for p in problems)


def test_every_function_changing_field_outside_the_ffn_must_agree():
    """The normalisation epsilon and the head width change what the copied weights compute (a
    wider head keeps every shape when the head count changes with it) and are refused by name;
    the feed-forward section, which upcycling replaces, may differ. Sizes left null compare by
    the value they derive (null kv heads: as many as the heads)."""
    dense_cfg = dense_config()
    upcycled = moe_config(dense_cfg, RouterConfig(top_k=2))
    assert incompatibilities(dense_cfg, upcycled) == []
    for key, value in (("norm_eps", 1e-5), ("head_dim", 16)):
        problems = incompatibilities(dense_cfg, dataclasses.replace(upcycled, **{key: value}))
        assert [p.split(":")[0] for p in problems] == [f"model.{key}"], key
    same = dataclasses.replace(dense_cfg, n_kv_heads=None, head_dim=None)
    assert incompatibilities(same, dataclasses.replace(same, n_kv_heads=4, head_dim=8)) == []


def test_a_new_function_changing_field_must_agree():
    """The comparison is derived from the field metadata: a field declared ``arch`` later is
    compared without a change to upcycling."""
    from moe.core.config_schema import arch

    @dataclasses.dataclass
    class WithKnob(ModelConfig):
        knob: int = arch(0)

    dense_cfg = WithKnob(
        **{f.name: getattr(dense_config(), f.name) for f in dataclasses.fields(ModelConfig)}
    )
    assert incompatibilities(dense_cfg, dataclasses.replace(dense_cfg, knob=1)) == [
        "model.knob: this run has 1, the source checkpoint 0"
    ]


def test_a_source_with_weights_of_added_modules_is_refused_by_key(monkeypatch, tmp_path):
    """A prompt-tuning checkpoint as model.init_from: its learned prompt has no place in a
    plain model. The error named neither the key nor the source, and was a checkpoint error
    where it is the configuration's."""
    from types import SimpleNamespace

    from moe.core.errors import ConfigError
    from moe.training import upcycle

    cfg = dense_config()
    state = {**trained_dense(cfg).state_dict(), "prompt.embeddings": torch.zeros(4, 32)}
    source = SimpleNamespace(state_dict=lambda: state)
    monkeypatch.setattr(
        upcycle,
        "load_model",
        lambda path: (source, SimpleNamespace(model=cfg), tmp_path / "step_0000008"),
    )
    with pytest.raises(ConfigError) as e:
        upcycle.initialize_from_checkpoint(MoETransformer(cfg), tmp_path)
    message = str(e.value)
    assert f"model.init_from: {tmp_path / 'step_0000008'}: " in message
    assert "['prompt.embeddings']" in message and "added modules" in message
