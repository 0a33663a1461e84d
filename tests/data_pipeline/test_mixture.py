"""The mixture schedule: exact proportions per block, per-source indices contiguous."""

import numpy as np
import pytest

from data_pipeline.mixture import BLOCK, MixtureSchedule


@pytest.mark.parametrize(
    "weights", [[1.0], [0.5, 0.5], [0.7, 0.2, 0.1], [3, 1], [1, 1, 1], [0.01, 0.99]]
)
def test_every_window_tracks_the_weights_and_indices_are_contiguous(weights):
    m = MixtureSchedule(weights)
    p = np.asarray(weights) / sum(weights)
    for start in (0, 777, 3 * BLOCK + 5):
        source, k = m.locate(np.arange(start, start + 10_000))
        share = np.bincount(source, minlength=len(weights)) / 10_000
        assert np.abs(share - p).max() <= 2e-4
        before = m.counts(start)
        for s in range(len(weights)):
            # Source s's samples are exactly its next indices: nothing repeated, nothing skipped.
            assert np.array_equal(k[source == s], before[s] + np.arange((source == s).sum()))
        assert np.array_equal(
            m.counts(start + 10_000), before + np.bincount(source, minlength=len(weights))
        )


def test_prefix_counts_stay_within_one_sample():
    m = MixtureSchedule([0.6, 0.3, 0.1])
    source, _ = m.locate(np.arange(BLOCK))
    running = np.cumsum(np.eye(3, dtype=np.int64)[source], axis=0)
    ideal = np.arange(1, BLOCK + 1)[:, None] * np.array([0.6, 0.3, 0.1])
    assert np.abs(running - ideal).max() <= 1.0


def test_rebased_schedule_continues_each_source():
    old = MixtureSchedule([0.5, 0.5])
    counts = old.counts(1234)
    new = MixtureSchedule([0.9, 0.1], base_samples=1234, base_counts=counts.tolist())
    source, k = new.locate(np.arange(1234, 1234 + 1000))
    for s in (0, 1):
        assert np.array_equal(k[source == s], counts[s] + np.arange((source == s).sum()))
    assert abs((source == 0).mean() - 0.9) < 0.002


def test_rejects_bad_weights():
    for w in ([], [0, 0], [-1, 2], [1e-6, 1]):
        with pytest.raises(ValueError):
            MixtureSchedule(w)
