"""The on-the-fly Feistel permutation: a bijection on [0, n) for every n and key."""

import numpy as np
import pytest

from data_pipeline.permutation import FeistelPermutation, round_keys


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 100, 255, 256, 257, 4097, 65537, 100003])
def test_is_a_bijection_on_every_domain(n):
    out = FeistelPermutation(n, round_keys("fp", 1, n))(np.arange(n))
    assert np.array_equal(np.sort(out), np.arange(n))


def test_is_deterministic_keyed_and_index_by_index():
    n = 10_000
    p = FeistelPermutation(n, round_keys("fp", 1, "src", 0))
    full = p(np.arange(n))
    assert np.array_equal(full, FeistelPermutation(n, round_keys("fp", 1, "src", 0))(np.arange(n)))
    # Evaluating any subset, in any order, gives the same images: no hidden state.
    idx = np.random.default_rng(0).permutation(n)[:500]
    assert np.array_equal(p(idx), full[idx])
    other = FeistelPermutation(n, round_keys("fp", 1, "src", 1))(np.arange(n))
    assert (other != full).mean() > 0.99


def test_looks_shuffled():
    n = 100_000
    y = FeistelPermutation(n, round_keys("x")).__call__(np.arange(n)).astype(np.float64)
    assert abs(np.corrcoef(np.arange(n), y)[0, 1]) < 0.02
    assert abs(np.corrcoef(y[:-1], y[1:])[0, 1]) < 0.02
    # Mean distance between neighbours' images is n/3 for a uniform random permutation.
    assert abs(np.abs(np.diff(y)).mean() / n - 1 / 3) < 0.01


def test_rejects_indices_outside_the_domain():
    with pytest.raises(IndexError):
        FeistelPermutation(10, round_keys(0))(np.array([10]))
