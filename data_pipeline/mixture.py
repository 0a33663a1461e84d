"""Which source each global sample comes from, as a pure function of the sample index.

Global samples are cut into blocks of ``BLOCK`` positions. Every block holds exactly ``q_s``
samples of source ``s`` (``q_s / BLOCK`` is the weight, rounded by largest remainder), spread
evenly: the ``j``-th sample of source ``s`` in a block sits near ``(j + 1/2) * BLOCK / q_s``. The
proportions are therefore exact on every block and off by at most one sample per source on any
prefix, and both the source of sample ``g`` and how many samples each source gave before ``g``
cost O(1) (two table lookups), with no state beyond the cursor.

A run may change the weights when it resumes: the schedule then restarts at the cursor
(``base_samples``) from the per-source counters reached so far (``base_counts``), so no source
repeats or skips a sample.
"""

from __future__ import annotations

import numpy as np

BLOCK = 10_000


class MixtureSchedule:
    def __init__(
        self, weights: list[float], base_samples: int = 0, base_counts: list[int] | None = None
    ):
        w = np.asarray(weights, dtype=np.float64)
        if w.ndim != 1 or not len(w) or (w < 0).any() or w.sum() <= 0:
            raise ValueError(f"mixture weights must be >= 0 with a positive sum, got {weights}")
        exact = w / w.sum() * BLOCK
        quota = np.floor(exact).astype(np.int64)
        by_remainder = np.argsort(-(exact - quota), kind="stable")
        quota[by_remainder[: BLOCK - quota.sum()]] += 1
        if ((w > 0) & (quota == 0)).any():
            raise ValueError(
                f"mixture weights {weights}: a weight below 1/{BLOCK} of the total "
                "would never be sampled"
            )
        self.weights = [float(x) for x in w]
        self.quota = quota
        # Ideal in-block positions of every source's samples, sorted: the slot table.
        src = np.repeat(np.arange(len(w)), quota)
        rank = np.concatenate([np.arange(q) for q in quota])
        order = np.argsort((rank + 0.5) / quota[src], kind="stable")  # ties: lower source first
        self.slot_source = src[order]
        self.slot_rank = rank[order]
        # before[p, s]: samples of source s in block positions [0, p).
        onehot = np.zeros((BLOCK + 1, len(w)), dtype=np.int64)
        onehot[np.arange(1, BLOCK + 1), self.slot_source] = 1
        self.before = np.cumsum(onehot, axis=0)
        self.base_samples = base_samples
        self.base_counts = np.asarray(
            base_counts if base_counts is not None else [0] * len(w), dtype=np.int64
        )

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, index within that source's own sample sequence) of global positions."""
        rel = np.asarray(positions, dtype=np.int64) - self.base_samples
        block, slot = np.divmod(rel, BLOCK)
        source = self.slot_source[slot]
        return source, self.base_counts[source] + block * self.quota[source] + self.slot_rank[slot]

    def counts(self, position: int) -> np.ndarray:
        """Samples each source contributed to global positions ``[0, position)``."""
        block, slot = divmod(position - self.base_samples, BLOCK)
        return self.base_counts + block * self.quota + self.before[slot]
