"""A seeded pseudo-random permutation of ``[0, n)`` evaluated index by index.

The reader shuffles samples without materializing an ``n``-element permutation array: start-up
stays proportional to the number of shards, and the state stays a cursor. A balanced Feistel
network is a bijection on ``[0, 2**b)`` whatever its round function (each round XORs one half
with a keyed hash of the other, which the same round undoes); cycle walking (apply it again while
the image is ``>= n``) restricts it to a bijection on ``[0, n)``. ``b`` is the bit length of
``n - 1``, so the domain is less than ``2 * n`` and an index needs fewer than 2 walks on average.
"""

from __future__ import annotations

import hashlib

import numpy as np

ROUNDS = 4  # four rounds make a strong pseudo-random permutation (Luby-Rackoff)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def round_keys(*parts: object) -> np.ndarray:
    """``ROUNDS`` 64-bit keys derived from ``parts`` (e.g. fingerprint, seed, source, epoch)."""
    digest = hashlib.sha512(":".join(map(str, parts)).encode()).digest()
    return np.frombuffer(digest[: 8 * ROUNDS], dtype="<u8").copy()


def _mix(x: np.ndarray) -> np.ndarray:
    """A 64-bit avalanche mixer (the splitmix64 finalizer)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


class FeistelPermutation:
    """``perm(i)`` for arrays of indices ``i`` in ``[0, n)``; a bijection for any keys."""

    def __init__(self, n: int, keys: np.ndarray):
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        low = bits // 2  # an unbalanced split keeps the domain at 2**bits, not 4**ceil(bits/2)
        self._shift = np.uint64(low)
        self._masks = (np.uint64((1 << (bits - low)) - 1), np.uint64((1 << low) - 1))
        self._keys = [np.uint64(k) for k in keys]

    def _network(self, x: np.ndarray) -> np.ndarray:
        high, low = x >> self._shift, x & self._masks[1]
        for r, key in enumerate(self._keys):
            if r % 2 == 0:
                high ^= _mix(low ^ key) & self._masks[0]
            else:
                low ^= _mix(high ^ key) & self._masks[1]
        return (high << self._shift) | low

    def __call__(self, index: np.ndarray) -> np.ndarray:
        idx = np.asarray(index, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.n):
            raise IndexError(f"permutation index out of [0, {self.n})")
        with np.errstate(over="ignore"):
            out = self._network(idx.astype(np.uint64).reshape(-1))
            outside = np.flatnonzero(out >= self.n)
            while outside.size:  # cycle walking: terminates because each cycle re-enters [0, n)
                out[outside] = self._network(out[outside])
                outside = outside[out[outside] >= self.n]
        return out.astype(np.int64).reshape(idx.shape)
