"""Each positional encoding's defining property, checked against its formula or its paper."""

import math

import pytest
import torch

from moe.model.positions import (
    AlibiBias,
    LearnedPositions,
    RotaryEmbedding,
    T5RelativeBias,
    alibi_slopes,
    apply_rotary,
    positions_from_doc_ids,
    sinusoidal_table,
    t5_bucket,
)


def test_sinusoidal_table_matches_the_formula():
    d = 10
    table = sinusoidal_table(torch.arange(50), d)
    assert table.shape == (50, d)
    for pos in (0, 1, 7, 49):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_learned_positions_train_only_the_rows_used():
    pos = LearnedPositions(max_seq_len=16, d_model=8)
    pos.embedding(torch.arange(5)[None]).sum().backward()
    row_has_grad = pos.table.weight.grad.abs().sum(-1) > 0
    assert row_has_grad[:5].all() and not row_has_grad[5:].any()


@pytest.mark.parametrize("theta", [10000.0, 1e6])
def test_rope_scores_depend_only_on_relative_offset(theta):
    torch.manual_seed(0)
    hd = 16
    rope = RotaryEmbedding(hd, theta)
    expected_freq = torch.tensor([theta ** (-2 * i / hd) for i in range(hd // 2)])
    torch.testing.assert_close(rope.inv_freq, expected_freq)
    q, k = torch.randn(1, 1, 1, hd), torch.randn(1, 1, 1, hd)

    def score(m, n):
        qm = apply_rotary(q, rope.rotary(torch.tensor([[m]])))
        kn = apply_rotary(k, rope.rotary(torch.tensor([[n]])))
        return (qm * kn).sum().item()

    for m, n in ((5, 2), (9, 9), (30, 1)):
        for shift in (1, 17, 250):
            assert score(m + shift, n + shift) == pytest.approx(score(m, n), rel=1e-4, abs=1e-4)
    # And the rotation is not the identity: the score changes with the offset.
    assert abs(score(5, 2) - score(5, 4)) > 1e-3
    # Norms are preserved (a rotation).
    qm = apply_rotary(q, rope.rotary(torch.tensor([[123]])))
    assert qm.norm().item() == pytest.approx(q.norm().item(), rel=1e-5)


def test_alibi_standard_slopes():
    # Press et al.: 8 heads -> 1/2, 1/4, ..., 1/256.
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    # 16 heads: 2^(-0.5 * (i + 1)).
    torch.testing.assert_close(
        alibi_slopes(16), torch.tensor([2.0 ** (-0.5 * (i + 1)) for i in range(16)])
    )
    # 12 heads (not a power of two): the 8-head slopes, then the odd-indexed 16-head slopes.
    expected = [2.0 ** -(i + 1) for i in range(8)] + [2.0 ** (-0.5 * (2 * j + 1)) for j in range(4)]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(expected))


def test_alibi_bias_is_linear_in_distance():
    alibi = AlibiBias(n_heads=4)
    pos = torch.arange(10)[None]
    bias = alibi.score_bias(pos, pos)[0]  # (H, S, L)
    for h, m in enumerate(alibi_slopes(4).tolist()):
        for i in range(10):
            for j in range(i + 1):
                assert bias[h, i, j].item() == pytest.approx(-m * (i - j))


def test_t5_buckets_exact_when_near_logarithmic_when_far():
    nb, maxd = 32, 128
    exact = nb // 2
    d = torch.arange(0, 1000)
    b = t5_bucket(d, nb, maxd)
    assert torch.equal(b[:exact], torch.arange(exact))
    # Bucket exact + j starts at distance exact * (maxd / exact) ** (j / (nb - exact)).
    for j in range(1, nb - exact):
        start = exact * (maxd / exact) ** (j / (nb - exact))
        inside = math.ceil(start + 1e-9)
        assert b[inside].item() == exact + j
        assert b[math.ceil(start) - 1].item() == exact + j - 1
    assert (b[maxd:] == nb - 1).all()
    assert (b[1:] >= b[:-1]).all()
    # Causal: keys after the query (negative distance) fall in bucket 0 (they are masked anyway).
    assert t5_bucket(torch.tensor([-3]), nb, maxd).item() == 0


def test_t5_bias_reads_one_learned_scalar_per_head_and_bucket():
    t5 = T5RelativeBias(n_heads=2, num_buckets=8, max_distance=20)
    pos = torch.arange(30)[None]
    bias = t5.score_bias(pos, pos)[0]
    buckets = t5_bucket(pos[0][:, None] - pos[0][None, :], 8, 20)
    for h in range(2):
        torch.testing.assert_close(bias[h], t5.bias.weight[buckets, h])


def test_positions_restart_at_document_starts():
    doc = torch.tensor([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 7, 7]])
    assert positions_from_doc_ids(doc).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]
