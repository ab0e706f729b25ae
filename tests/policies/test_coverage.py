import numpy as np
import pytest

from sparsebalance.data.sequence import Sequence
from sparsebalance.policies.config import PolicyConfig
from sparsebalance.policies.coverage import fit_rate, make_coverage_model, parametric_curve
from sparsebalance.simulator.config import tiny
from sparsebalance.simulator.plan import MicroBatch


def brute_force(length, block, rate, shape):
    """Token by token: each query with past blocks ranks their weights and keeps the top k - 1
    (the own block is attended anyway and is not gate mass); mean over those queries."""
    n = -(-length // block)
    out, count = np.zeros(n), 0
    for t in range(length):
        past = t // block
        if past == 0:
            continue
        r = np.arange(1, past + 1, dtype=float)
        w = r ** -rate if shape == "power" else np.exp(-rate * (r - 1))
        w = np.sort(w)[::-1]
        for k in range(1, n + 1):
            out[k - 1] += w[:k - 1].sum() / w.sum()
        count += 1
    return out / count if count else np.ones(n)


@pytest.mark.parametrize("length,block,rate,shape", [
    (1000, 64, 1.3, "power"), (777, 32, 0.6, "power"), (513, 64, 0.4, "geometric"), (64, 64, 2.0, "power"),
])
def test_curve_matches_brute_force(length, block, rate, shape):
    got = parametric_curve(length, block, rate, shape)
    np.testing.assert_allclose(got, brute_force(length, block, rate, shape), rtol=0, atol=1e-12)


@pytest.mark.parametrize("length", [1, 255, 256, 257, 4096, 65536])
@pytest.mark.parametrize("rate", [0.3, 1.5, 4.0])
def test_curve_properties(length, rate):
    c = parametric_curve(length, 256, rate)
    assert len(c) == -(-length // 256)
    assert c[-1] == 1.0
    assert np.all(np.diff(c) >= 0)
    assert c[0] == (1.0 if len(c) == 1 else 0.0)  # k = 1 routes nothing (own block only)


def test_sensitivity_draw_is_deterministic_and_order_free():
    cfg = PolicyConfig()
    a, b = make_coverage_model(tiny(), cfg, seed=3), make_coverage_model(tiny(), cfg, seed=3)
    s1, s2 = Sequence(id=5, length=900), Sequence(id=6, length=900)
    c1 = a.curve(s1)
    b.curve(s2)
    np.testing.assert_array_equal(c1, b.curve(s1))
    assert a.sensitivity(s1) != a.sensitivity(s2)
    assert make_coverage_model(tiny(), cfg, seed=4).sensitivity(s1) != a.sensitivity(s1)


def test_higher_sensitivity_means_faster_decay():
    m = make_coverage_model(tiny(), PolicyConfig(), seed=0)
    lo, hi = Sequence(id=0, length=3200, sensitivity=0.5), Sequence(id=1, length=3200, sensitivity=2.0)
    assert m.coverage(hi, 4) > m.coverage(lo, 4)


def test_measured_curves_take_precedence():
    m = make_coverage_model(tiny(), PolicyConfig(), seed=0)
    carried = Sequence(id=1, length=96, coverage=(0.5, 0.8, 1.0))
    assert m.coverage(carried, 2) == 0.8 and m.coverage(carried, 99) == 1.0
    plain = Sequence(id=2, length=96, sensitivity=1.0)
    m.observe(2, [0.25, 0.5, 1.0])
    assert m.coverage(plain, 1) == 0.25


def test_microbatch_coverage_aggregates():
    seqs = (Sequence(id=1, length=32, coverage=(1.0,)), Sequence(id=2, length=96, coverage=(0.5, 0.8, 1.0)))
    mb = MicroBatch(seqs)
    tok = make_coverage_model(tiny(), PolicyConfig(coverage_agg="tokens"), seed=0)
    mn = make_coverage_model(tiny(), PolicyConfig(coverage_agg="min"), seed=0)
    # tiny: block 32. Weights = routed queries (length - block): 0 for the one-block sequence.
    assert tok.microbatch_coverage(mb, 1) == pytest.approx(0.5)
    assert mn.microbatch_coverage(mb, 2) == pytest.approx(0.8)
    assert tok.microbatch_coverage(mb, (1, 2)) == pytest.approx((0.5 + 0.8) / 2)
    three = MicroBatch(seqs + (Sequence(id=3, length=64, coverage=(0.0, 1.0)),))
    assert tok.microbatch_coverage(three, 1) == pytest.approx((64 * 0.5 + 32 * 0.0) / 96)


@pytest.mark.parametrize("rate,shape", [(0.4, "power"), (1.5, "power"), (0.7, "geometric")])
def test_fit_rate_recovers_the_rate_of_model_curves(rate, shape):
    curves = [(n, parametric_curve(n, 32, rate, shape)) for n in (100, 333, 1024, 40)]
    got, err = fit_rate(curves, 32, shape)
    assert got == pytest.approx(rate, rel=1e-3)
    assert err < 1e-4
