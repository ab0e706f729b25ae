"""The batched coverage curves (policies/coverage.py: curves, microbatch_curves,
parametric_curves) are bitwise the per-sequence / per-micro-batch ones dst-cp used before."""

from __future__ import annotations

import numpy as np
import pytest

from sparsebalance.data.sequence import Sequence
from sparsebalance.policies.config import PolicyConfig
from sparsebalance.policies.coverage import make_coverage_model, parametric_curve, parametric_curves
from sparsebalance.simulator.config import qwen25_3b
from sparsebalance.simulator.plan import MicroBatch


@pytest.mark.parametrize("shape", ["power", "geometric"])
def test_parametric_curves_bitwise(shape):
    rng = np.random.default_rng(0)
    lengths = np.concatenate([[1, 255, 256, 257, 512, 65536], rng.integers(1, 70_000, 300)])
    rates = rng.uniform(0.1, 5, len(lengths))
    got = parametric_curves(lengths, 256, rates, shape)
    for L, a, c in zip(lengths.tolist(), rates.tolist(), got):
        assert np.array_equal(c, parametric_curve(L, 256, a, shape))


@pytest.mark.parametrize("agg", ["tokens", "min"])
def test_microbatch_curves_bitwise(agg):
    rng = np.random.default_rng(1)
    model = qwen25_3b()
    pol = PolicyConfig(coverage_agg=agg)
    seqs = [Sequence(id=i, length=int(rng.integers(100, 70_000)),
                     sensitivity=None if i % 5 == 0 else float(rng.lognormal(0, .5)),
                     coverage=[0.5, 0.8, 1.0] if i % 11 == 0 else None) for i in range(200)]
    seqs += seqs[:7]  # repeats hit the cache
    mbs, at = [], 0
    while at < len(seqs):
        k = int(rng.integers(1, 6))
        mbs.append(MicroBatch(tuple(seqs[at:at + k])))
        at += k
    k_his = rng.integers(1, 70, len(mbs)).tolist()
    a, b = make_coverage_model(model, pol, seed=3), make_coverage_model(model, pol, seed=3)
    a.observe(4, np.linspace(0.2, 1, 9))
    b.observe(4, np.linspace(0.2, 1, 9))
    got = a.microbatch_curves(mbs, k_his)
    for mb, k, c in zip(mbs, k_his, got):
        assert np.array_equal(c, b.microbatch_curve(mb, k))
    assert [x.tobytes() for x in a.curves(seqs)] == [b.curve(s).tobytes() for s in seqs]
