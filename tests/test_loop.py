"""The shared iteration loop's helpers: epochs of global batches and the imbalance metric."""

from __future__ import annotations

import numpy as np
import pytest

from sparsebalance.data.sequence import Sequence
from sparsebalance.loop import global_batches, imbalance


def _seqs(n):
    return [Sequence(id=i, length=10 + i) for i in range(n)]


def test_epochs_cover_every_sequence_once_per_epoch():
    seqs = _seqs(12)
    it = global_batches(seqs, 4, shuffle=True, rng=np.random.default_rng(0))
    epoch = [s.id for _ in range(3) for s in next(it)]
    assert sorted(epoch) == list(range(12))
    nxt = [s.id for _ in range(3) for s in next(it)]
    assert sorted(nxt) == list(range(12)) and nxt != epoch  # reshuffled


def test_unshuffled_order_and_ragged_tail_dropped():
    it = global_batches(_seqs(10), 4, shuffle=False, rng=np.random.default_rng(0))
    assert [s.id for s in next(it)] == [0, 1, 2, 3]
    assert [s.id for s in next(it)] == [4, 5, 6, 7]
    assert [s.id for s in next(it)] == [0, 1, 2, 3]


def test_too_few_sequences():
    with pytest.raises(ValueError, match="cannot fill one global batch"):
        next(global_batches(_seqs(3), 4, shuffle=False, rng=np.random.default_rng(0)))


def test_imbalance_is_max_over_mean():
    assert imbalance([[1.0, 3.0], [2.0, 2.0]]) == pytest.approx(3.0 / 2.0)
    assert imbalance([[5.0]]) == 1.0
