"""The batched coverage curves (policies/parametric.py: parametric_curves; policies/coverage.py:
curves, microbatch_curves, microbatch_matrix) are bitwise the per-sequence / per-micro-batch ones,
and the closed form equals the definition (aggregate of the per-block shares)."""

from __future__ import annotations

import numpy as np
import pytest

from sparsebalance.data import coverage as cov
from sparsebalance.data.sequence import Sequence, blocks
from sparsebalance.policies.config import PolicyConfig
from sparsebalance.policies.coverage import (
    make_coverage_model,
    parametric_curve,
    parametric_curves,
    parametric_shares,
)
from sparsebalance.simulator.config import qwen25_3b
from sparsebalance.simulator.plan import MicroBatch


def _cases(rng, block, count):
    """Lengths with one block, exact multiples, partial last blocks (a single token past a
    boundary), and random ones; rates including those numpy's power special-cases."""
    edge = [1, block - 1, block, block + 1, 2 * block, 2 * block + 1, 37 * block - 5]
    lengths = np.concatenate([edge, rng.integers(1, 80 * block, count)])
    rates = np.concatenate([[1.0, 0.5, 2.0, 1e-3, 8.0, 1.0, 0.25], rng.uniform(0.05, 6, count)])
    return lengths, rates


@pytest.mark.parametrize("block", [16, 256, 2048])
@pytest.mark.parametrize("shape", ["power", "geometric"])
def test_closed_form_equals_aggregated_shares(shape, block):
    """The O(n) closed form vs the definition: aggregate() of the [n - 1, n] share matrix."""
    lengths, rates = _cases(np.random.default_rng(block), block, 120)
    for L, a in zip(lengths.tolist(), rates.tolist()):
        n = blocks(int(L), block)
        want = cov.aggregate(parametric_shares(n, a, shape), L, block) if n > 1 else np.ones(1)
        got = parametric_curve(L, block, a, shape)
        assert got.shape == (n,) and got[-1] == 1.0 and got[0] == (1.0 if n == 1 else 0.0)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("block", [16, 256])
@pytest.mark.parametrize("shape", ["power", "geometric"])
def test_parametric_curves_bitwise(shape, block):
    rng = np.random.default_rng(0)
    lengths, rates = _cases(rng, block, 300)
    got = parametric_curves(lengths, block, rates, shape)
    for L, a, c in zip(lengths.tolist(), rates.tolist(), got):
        assert np.array_equal(c, parametric_curve(L, block, a, shape))
    for size in (1, 2, 5, 9):  # around the one-by-one path for a few sequences
        few = rng.choice(len(lengths), size, replace=False)
        for x, c in zip(few.tolist(), parametric_curves(lengths[few], block, rates[few], shape)):
            assert np.array_equal(c, parametric_curve(int(lengths[x]), block, float(rates[x]), shape))


def test_microbatch_rows_equal_microbatch():
    """Many micro-batches at once (slots in any order) = each alone, bitwise; nothing routed: 1."""
    rng = np.random.default_rng(5)
    sizes = [1, 3, 2, 4, 1]
    lengths = [int(x) for x in rng.integers(1, 3000, sum(sizes))]
    lengths[0] = 200  # a one-block sequence alone: nothing routes
    curves = [np.sort(rng.random(12)) for _ in lengths]
    group = np.repeat(np.arange(len(sizes)), sizes)
    slot = np.concatenate([np.arange(s) for s in sizes])
    w = [cov.routed_queries(L, 256) for L in lengths]
    mix = rng.permutation(len(lengths))
    got = cov.microbatch_rows(np.array(curves)[mix], np.array(w, dtype=float)[mix], group[mix], slot[mix],
                              len(sizes))
    for g in range(len(sizes)):
        idx = np.flatnonzero(group == g)
        want = cov.microbatch([curves[i] for i in idx], [lengths[i] for i in idx], 256)
        assert np.array_equal(got[g], want)
    assert np.array_equal(got[0], np.ones(12))


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


@pytest.mark.parametrize("agg", ["tokens", "min"])
def test_microbatch_matrix_rows_are_microbatch_curves(agg):
    """dst-cp's matrix: row i = micro-batch i alone at the same width, and columns do not depend
    on the width (a narrower matrix is a prefix); the tokens rule against the weighted mean."""
    rng = np.random.default_rng(2)
    model = qwen25_3b()
    pol = PolicyConfig(coverage_agg=agg)
    seqs = [Sequence(id=i, length=int(rng.integers(100, 70_000)), sensitivity=float(rng.lognormal(0, .5)))
            for i in range(60)]
    mbs = [MicroBatch(tuple(seqs[a:a + k])) for a, k in zip(range(0, 60, 6), rng.integers(1, 7, 10))]
    a, b = make_coverage_model(model, pol, seed=1), make_coverage_model(model, pol, seed=1)
    wide = a.microbatch_matrix(mbs, 80)
    assert np.array_equal(a.microbatch_matrix(mbs, 20), wide[:, :20])
    for mb, row in zip(mbs, wide):
        assert np.array_equal(row, b.microbatch_curve(mb, 80))
        cs = np.array([np.concatenate([b.curve(s), np.ones(80)])[:80] for s in mb.sequences])
        w = np.array([max(0, s.length - model.block_size) for s in mb.sequences], dtype=float)
        want = cs.min(axis=0) if agg == "min" else w @ cs / w.sum()
        np.testing.assert_allclose(row, want, rtol=0, atol=1e-14)
