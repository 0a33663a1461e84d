import math

import pytest
import torch

from moe.model.moe_layer import MoEConfig
from moe.model.router import RouterConfig
from moe.model.transformer import ModelConfig, MoETransformer


def small_model(**moe_kwargs) -> MoETransformer:
    torch.manual_seed(0)
    moe = MoEConfig(num_experts=4, expert_hidden=32, **moe_kwargs)
    return MoETransformer(
        ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, moe=moe)
    )


def test_output_shapes_and_initial_loss_near_uniform():
    model = small_model()
    ids = torch.randint(0, 97, (3, 16))
    out = model(ids, ids)
    assert out.logits.shape == (3, 16, 97)
    assert out.loss.ndim == 0 and out.aux_loss.ndim == 0
    assert abs(out.lm_loss.item() - math.log(97)) < 0.5


def test_causality():
    model = small_model().eval()
    ids = torch.randint(0, 97, (1, 16))
    base = model(ids).logits
    for t in (0, 5, 15):
        changed = ids.clone()
        changed[0, t] = (changed[0, t] + 1) % 97
        logits = model(changed).logits
        torch.testing.assert_close(logits[:, :t], base[:, :t], rtol=0, atol=1e-6)
        assert not torch.allclose(logits[:, t], base[:, t])


def test_dense_layers_follow_placement():
    model = small_model(first_dense_layers=1)
    kinds = [type(b.ffn).__name__ for b in model.blocks]
    assert kinds == ["DenseFFN", "MoELayer"]


def test_overfits_a_tiny_batch():
    model = small_model()
    ids = torch.randint(0, 97, (4, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(60):
        out = model(ids[:, :-1], ids[:, 1:])
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        first = first if first is not None else out.lm_loss.item()
    assert out.lm_loss.item() < first - 2.0


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("renormalize", [False, True])
def test_router_picks_exactly_k_distinct_experts(k, renormalize):
    from moe.model.router import TopKRouter

    torch.manual_seed(1)
    router = TopKRouter(16, 6, RouterConfig(top_k=k, renormalize=renormalize))
    r = router(torch.randn(50, 16))
    assert r.indices_TK.shape == (50, k)
    assert all(len(set(row.tolist())) == k for row in r.indices_TK)
    # The chosen experts are the k highest-scoring ones.
    top = r.scores_TE.topk(k, dim=-1).indices.sort(-1).values
    assert torch.equal(r.indices_TK.sort(-1).values, top)
    sums = r.weights_TK.sum(-1)
    if renormalize:
        torch.testing.assert_close(sums, torch.ones(50))
    else:  # softmax-then-top-k: the selected share of a distribution over all experts
        expected = r.scores_TE.gather(-1, r.indices_TK).sum(-1)
        torch.testing.assert_close(sums, expected)
        assert (sums <= 1 + 1e-6).all() and (k < 6 or torch.allclose(sums, torch.ones(50)))
