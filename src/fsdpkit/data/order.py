"""The order of training sequences: a seeded permutation computed one index at a time.

[Note: order without an index]
An epoch visits every training sequence once in an order drawn from ``(seed, epoch)``.
Holding that order as a table costs 8 bytes per sequence on every rank (a billion
sequences: 8 GB per rank, and seconds to shuffle at each epoch). ``Permutation``
instead computes ``perm(i)`` for just the positions a rank needs: a Feistel network
(``ROUNDS`` rounds of a splitmix64-style mixer keyed from the seed and epoch) is a
bijection of ``[0, 4**h)``, the smallest such domain with ``4**h >= n``; a value that
lands at or past ``n`` is fed through the network again (cycle walking) until it falls
inside ``[0, n)``, which keeps the map a bijection of ``[0, n)``. The domain is under
``4 n``, so a position takes fewer than four passes on average. Memory is a handful of
round keys; every rank computes the same order without communicating.
"""

from __future__ import annotations

import numpy as np

ROUNDS = 6
"""Feistel rounds: four already give a pseudo-random permutation; six leave margin."""

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """splitmix64's finalizer of ``x + key``: every output bit depends on every input bit."""
    z = (x ^ key) * _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


class Permutation:
    """``perm(positions)``: a bijection of ``[0, n)`` fixed by ``(seed, epoch)``."""

    def __init__(self, n: int, *, seed: int, epoch: int, shuffle: bool = True) -> None:
        self.n = int(n)
        self.shuffle = shuffle
        half = 1
        while 4**half < self.n:
            half += 1
        self._half = np.uint64(half)
        self._low = np.uint64((1 << half) - 1)
        rng = np.random.default_rng([seed % 2**63, epoch, 0x5EED])
        self._keys = [np.uint64(k) for k in rng.integers(0, 2**63, size=ROUNDS, dtype=np.int64)]

    def _network(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._low
        for key in self._keys:
            left, right = right, left ^ (_mix(right, key) & self._low)
        return (left << self._half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The sequence ids at ``positions`` (int64, each in ``[0, n)``) of this epoch."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if not self.shuffle:
            return pos.copy()
        if pos.size and (pos.min() < 0 or pos.max() >= self.n):
            raise IndexError(f"positions outside [0, {self.n})")
        x = self._network(pos.astype(np.uint64))
        outside = x >= np.uint64(self.n)
        while outside.any():  # cycle walking: at most a few passes ([Note: order without...])
            x[outside] = self._network(x[outside])
            outside = x >= np.uint64(self.n)
        return x.astype(np.int64)
