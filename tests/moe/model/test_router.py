"""Router: balancing losses against hand computation, loss-free bias, noise, validation."""

import math

import pytest
import torch

from moe.model.router import RouterConfig, TopKRouter, load_balancing_loss


def test_switch_aux_loss_by_hand():
    # 4 tokens, 4 experts, top-1. Tokens 0,1 -> expert 0; token 2 -> expert 1; token 3 -> expert 3.
    probs = torch.tensor(
        [[0.7, 0.1, 0.1, 0.1], [0.6, 0.2, 0.1, 0.1], [0.1, 0.5, 0.2, 0.2], [0.2, 0.1, 0.1, 0.6]]
    )
    idx = probs.argmax(-1, keepdim=True)
    # f = [2/4, 1/4, 0, 1/4]; P = column means = [0.4, 0.225, 0.125, 0.25]
    expected = 4 * (0.5 * 0.4 + 0.25 * 0.225 + 0 * 0.125 + 0.25 * 0.25)
    assert math.isclose(load_balancing_loss(probs, idx, 4).item(), expected, rel_tol=1e-6)
    # Perfectly balanced routing and uniform probabilities give exactly 1.
    uniform = torch.full((4, 4), 0.25)
    assert math.isclose(
        load_balancing_loss(uniform, torch.arange(4)[:, None], 4).item(), 1.0, rel_tol=1e-6
    )


def test_sequence_level_aux_loss_by_hand():
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.4, 0.6]])
    idx = torch.tensor([[0], [0], [1], [0]])
    # Sequence 1 (tokens 0,1): f=[1,0], P=[0.85,0.15] -> 2*0.85. Sequence 2: f=[.5,.5], P=[.35,.65] -> 2*(.175+.325)
    expected = (2 * 0.85 + 2 * (0.5 * 0.35 + 0.5 * 0.65)) / 2
    got = load_balancing_loss(probs, idx, 2, seq_len=2).item()
    assert math.isclose(got, expected, rel_tol=1e-6)
    whole = 2 * (0.75 * 0.6 + 0.25 * 0.4)
    assert math.isclose(load_balancing_loss(probs, idx, 2).item(), whole, rel_tol=1e-6)


def test_z_loss_by_hand():
    router = TopKRouter(2, 3, RouterConfig(top_k=1))
    with torch.no_grad():
        router.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
    x = torch.tensor([[1.0, 2.0], [0.0, -1.0]])
    # logits: [1, 2, 3] and [0, -1, -1]
    lse1 = math.log(math.e**1 + math.e**2 + math.e**3)
    lse2 = math.log(1 + 2 * math.e**-1)
    assert math.isclose(router(x).z_loss.item(), (lse1**2 + lse2**2) / 2, rel_tol=1e-6)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_loss_free_bias_moves_toward_balance(score_func):
    torch.manual_seed(0)
    E = 8
    router = TopKRouter(
        16,
        E,
        RouterConfig(
            top_k=2,
            score_func=score_func,
            renormalize=True,
            bias_update_rate=0.001,
            aux_loss_coef=0.0,
        ),
    )
    with torch.no_grad():
        router.weight.normal_(std=0.1)
        router.weight[0] += 0.1  # a skewed router: expert 0 wins for every input
    x = torch.randn(512, 16) + 1.0

    def imbalance():
        load = torch.bincount(router(x).indices_TK.reshape(-1), minlength=E).float()
        return (load.max() / load.mean()).item(), load

    start, load = imbalance()
    weights_before = router(x).weights_TK
    for _ in range(400):
        _, load = imbalance()
        router.update_bias(load)
    end, _ = imbalance()
    assert start > 3.5 and end < 1.2, (start, end)
    assert router.score_bias[0] < 0 and router.score_bias.abs().sum() > 0
    # The bias only selects: the weights of a selected expert are its unbiased score.
    r = router(x)
    sel = r.scores_TE.gather(-1, r.indices_TK)
    torch.testing.assert_close(r.weights_TK, sel / sel.sum(-1, keepdim=True))
    assert weights_before.shape == r.weights_TK.shape


def test_noise_only_in_training():
    torch.manual_seed(0)
    router = TopKRouter(16, 8, RouterConfig(top_k=2, jitter_eps=0.3, logit_noise_std=1.0))
    x = torch.randn(256, 16)
    router.eval()
    a, b = router(x), router(x)
    assert torch.equal(a.indices_TK, b.indices_TK) and torch.equal(a.weights_TK, b.weights_TK)
    router.train()
    c = router(x)
    assert not torch.equal(c.indices_TK.sort(-1).values, a.indices_TK.sort(-1).values)


def test_router_runs_in_fp32_for_bf16_inputs():
    router = TopKRouter(16, 8, RouterConfig(top_k=2)).to(torch.bfloat16)
    r = router(torch.randn(4, 16, dtype=torch.bfloat16))
    assert r.scores_TE.dtype == torch.float32 and r.weights_TK.dtype == torch.float32


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(top_k=9), "top_k: 9 must be between 1 and 8"),
        (dict(top_k=0), "top_k: 0 must be between 1 and 8"),
        (dict(score_func="sigmoid", order="topk_then_softmax"), "needs score_func 'softmax'"),
        (dict(jitter_eps=1.5), "jitter_eps: must be < 1"),
        (dict(aux_loss_coef=-1.0), "aux_loss_coef: must be >= 0"),
    ],
)
def test_validation_messages(kwargs, message):
    assert any(message in p for p in RouterConfig(**kwargs).problems(num_experts=8))


def test_top_k_larger_than_experts_is_refused():
    assert any(
        "at most the number of experts (4)" in p
        for p in RouterConfig(top_k=6).problems(num_experts=4)
    )
