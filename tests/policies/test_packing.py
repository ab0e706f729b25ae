import itertools

import numpy as np
import pytest
from policy_doubles import check_plan, make_ctx, random_batch

from sparsebalance.policies import packing
from sparsebalance.policies.sab import SparsityAware


def brute_makespan(costs, bins, count=None):
    best = np.inf
    for assign in itertools.product(range(bins), repeat=len(costs)):
        if count is not None and any(assign.count(b) != count for b in range(bins)):
            continue
        loads = np.zeros(bins)
        for c, b in zip(costs, assign):
            loads[b] += c
        best = min(best, loads.max())
    return best


@pytest.mark.parametrize("seed", range(12))
def test_lpt_within_graham_bound(seed):
    rng = np.random.default_rng(seed)
    n, m = int(rng.integers(4, 9)), int(rng.integers(2, 4))
    costs = rng.lognormal(0, 1, n)
    got = packing.loads(packing.lpt(costs, m), costs).max()
    opt = brute_makespan(costs, m)
    assert opt - 1e-12 <= got <= (4 / 3 - 1 / (3 * m)) * opt + 1e-12


@pytest.mark.parametrize("seed", range(12))
def test_sab_rank_makespan_within_4_3_of_optimum(seed):
    """SAB across 2 DP ranks of 4 single-sequence micro-batches each (equal counts, as pipelines
    need): the ranks' summed predicted latency vs the brute-force best equal-count split."""
    batch = random_batch(8, seed)
    ctx = make_ctx(dp=2, global_batch=8)
    sab = SparsityAware(ctx.policy)
    plan = sab.plan(batch, ctx)
    check_plan(plan, batch, 2)
    costs = sab.costs(batch, ctx)
    cost_of = {s.id: c for s, c in zip(batch, costs)}
    got = max(sum(cost_of[s.id] for mb in r for s in mb.sequences) for r in plan.ranks)
    opt = brute_makespan(costs, 2, count=4)
    assert opt - 1e-15 <= got <= 4 / 3 * opt


@pytest.mark.parametrize("seed", range(20))
def test_swaps_never_worsen_and_keep_counts(seed):
    rng = np.random.default_rng(seed)
    costs = rng.lognormal(0, 1.5, 24)
    base = packing.lpt(costs, 4, count=6)
    better = packing.improve(base, costs, rounds=50)
    assert packing.loads(better, costs).max() <= packing.loads(base, costs).max() + 1e-12
    assert sorted(len(b) for b in better) == [6] * 4
    assert sorted(i for b in better for i in b) == list(range(24))


def test_swaps_fix_a_known_lpt_failure():
    # equal counts of 3: LPT puts 4 | 2, 2 | 2, 1 | 1 -> {4, 2, 1} = 7 vs {2, 2, 1} = 5; best is 6
    costs = np.array([4.0, 2.0, 2.0, 2.0, 1.0, 1.0])
    base = packing.lpt(costs, 2, count=3)
    assert packing.loads(base, costs).max() == pytest.approx(7)
    better = packing.improve(base, costs)
    assert packing.loads(better, costs).max() == pytest.approx(brute_makespan(costs, 2, count=3))


def test_min_count_and_token_cap():
    costs = np.array([10.0, 1, 1, 1, 1, 1])
    tokens = np.array([100.0, 10, 10, 10, 10, 10])
    out = packing.lpt(costs, 3, min_count=1, tokens=tokens, token_cap=40)
    assert all(len(b) >= 1 for b in out)
    assert all(tokens[b].sum() <= 40 or len(b) == 1 for b in out)


@pytest.mark.parametrize("seed", range(6))
def test_small_and_large_improve_agree_on_quality(seed):
    """Exhaustive small-instance search vs the sorted-search path: both never worsen LPT, and the
    exhaustive one reaches a local optimum no single swap can improve (checked by brute force)."""
    rng = np.random.default_rng(seed)
    costs = rng.lognormal(0, 1, 30)
    base = packing.lpt(costs, 3, count=10)
    small = packing.improve(base, costs, rounds=1000)
    ld = packing.loads(small, costs)
    a = int(np.argmax(ld))
    for b in range(3):
        if b == a:
            continue
        for i in small[a]:
            for j in small[b]:
                d = costs[i] - costs[j]
                assert not (d > 0 and max(ld[a] - d, ld[b] + d) < ld[a] - 1e-9)
    big = np.concatenate([costs, np.zeros(packing.SMALL)])  # forces the large path
    large = packing.improve([list(x) for x in base[:2]] + [base[2] + list(range(30, 30 + packing.SMALL))],
                            big, rounds=1000)
    assert packing.loads(large, big).max() <= packing.loads(base, costs).max() + 1e-12


def test_largest_within_matches_a_scan():
    from sparsebalance.policies.predict import Predictor

    rng = np.random.default_rng(0)
    for _ in range(200):
        steps = rng.exponential(1.0, 64) * (rng.random(64) < 0.7)     # flat stretches included
        table = np.concatenate([[rng.random()], rng.random() + np.cumsum(steps)])[:64]

        class L:
            def __init__(self, table):
                self.table = table

            def microbatch_latency(self, lengths, k):
                return float(self.table[k - 1])
        lo, hi = sorted(rng.integers(1, 65, 2))
        limit = float(rng.uniform(table.min() - 1, table.max() + 1))
        start = int(rng.integers(lo, hi + 1))
        got = Predictor(L(table)).largest_within((1,), limit, int(lo), int(hi), start=start)
        ok = [k for k in range(lo, hi + 1) if table[k - 1] <= limit]
        assert got == (max(ok) if ok else None)


def reference_lpt(costs, bins, *, min_count=0, tokens=None, cap=None):
    """LPT by linear scan over bins sorted by (load, index): the textbook rule the heap packer
    implements (least-loaded bin that may take the item; the fewest tokens when none fits)."""
    n = len(costs)
    tokens = np.zeros(n) if tokens is None else tokens
    cap = np.inf if cap is None else cap
    order = sorted(range(n), key=lambda i: (-costs[i], i))
    load, tok, cnt = [0.0] * bins, [0.0] * bins, [0] * bins
    out = [[] for _ in range(bins)]
    for placed, i in enumerate(order):
        owed = sum(max(0, min_count - c) for c in cnt)
        allowed = [b for b in range(bins) if not (owed > n - placed - 1 and cnt[b] >= min_count)]
        allowed.sort(key=lambda b: (load[b], b))
        fits = [b for b in allowed if tok[b] + tokens[i] <= cap]
        b = fits[0] if fits else min(allowed, key=lambda b: tok[b])  # min keeps the first of ties
        out[b].append(i)
        load[b] += costs[i]
        tok[b] += tokens[i]
        cnt[b] += 1
    return out


@pytest.mark.parametrize("seed", range(40))
def test_heap_lpt_matches_the_linear_scan(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 120))
    bins = int(rng.integers(1, min(n, 30) + 1))
    costs = np.round(rng.exponential(1.0, n), int(rng.integers(0, 3)))  # rounding makes ties
    tokens = rng.integers(1, 1000, n).astype(float)
    cap = float(rng.choice([300, 1500, 1e9]))
    min_count = int(rng.integers(0, n // bins + 1))
    got = packing.lpt(costs, bins, min_count=min_count, tokens=tokens, token_cap=cap)
    assert got == reference_lpt(costs, bins, min_count=min_count, tokens=tokens, cap=cap)


@pytest.mark.parametrize("seed", range(40))
def test_strict_cap_gives_up_exactly_when_the_cap_breaks(seed):
    """Oracle: the non-strict packing, checked for a multi-item bin over the cap."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(4, 200))
    bins = int(rng.integers(1, n // 2 + 1))
    tokens = rng.integers(1, 4000, n).astype(float)
    costs = tokens ** 1.5 * rng.uniform(0.8, 1.2, n)
    cap = float(tokens.sum() / bins * rng.uniform(0.9, 1.4))
    loose = packing.lpt(costs, bins, min_count=1, tokens=tokens, token_cap=cap)
    strict = packing.lpt(costs, bins, min_count=1, tokens=tokens, token_cap=cap, strict_cap=True)
    broken = any(len(b) > 1 and tokens[b].sum() > cap for b in loose)
    assert (strict is None) == broken
    if not broken:
        assert strict == loose


class TableLatency:
    """Per micro-batch a monotone latency table over k (micro-batch = (row,)); scalar and
    vectorised calls, counted apart."""

    def __init__(self, tables):
        self.tables, self.scalar, self.vector = tables, 0, 0

    def microbatch_latency(self, lengths, k):
        self.scalar += 1
        return float(self.tables[lengths[0], k - 1])

    def microbatch_latencies(self, microbatches, ks):
        self.vector += 1
        rows = np.array([mb[0] for mb in microbatches])
        return self.tables[rows, np.asarray(ks) - 1]


@pytest.mark.parametrize("m", [5, 300])  # below and above VECTOR_MIN
def test_largest_within_many_matches_a_scan(m):
    from sparsebalance.policies.predict import Predictor

    rng = np.random.default_rng(m)
    steps = rng.exponential(1.0, (m, 64)) * (rng.random((m, 64)) < 0.7)   # flat stretches too
    tables = rng.random((m, 1)) + np.cumsum(steps, axis=1)
    lo = rng.integers(1, 33, m)
    hi = np.maximum(lo, rng.integers(1, 65, m))
    limits = rng.uniform(tables.min() - 1, tables.max() + 1, m)
    limits[:m // 3] = tables[np.arange(m // 3), 31]           # exactly at a prediction (k = 32)
    lat = TableLatency(tables)
    got = Predictor(lat).largest_within_many([(i,) for i in range(m)], limits, lo, hi, start=32)
    for i in range(m):
        ok = [k for k in range(lo[i], hi[i] + 1) if tables[i, k - 1] <= limits[i] * (1 + 1e-12)]
        assert got[i] == (max(ok) if ok else -1)
    assert (lat.vector > 0) == (m >= 64)


def test_at_many_interpolates_like_at():
    from sparsebalance.policies.predict import Predictor

    rng = np.random.default_rng(0)
    tables = np.cumsum(rng.exponential(1.0, (100, 64)), axis=1)
    ks = rng.uniform(1, 63, 100)
    ks[::4] = np.floor(ks[::4])                               # integer budgets: no interpolation
    got = Predictor(TableLatency(tables)).at_many(np.arange(100), ks)
    lo = np.floor(ks).astype(int)
    want = tables[np.arange(100), lo - 1] + (ks - lo) * (tables[np.arange(100), lo] -
                                                           tables[np.arange(100), lo - 1])
    np.testing.assert_allclose(got, want, rtol=1e-15)


def _python_lpt(monkeypatch):
    """Force lpt's Python loop (the compiled one is taken from MIN_ITEMS items once loaded)."""
    from sparsebalance.policies import packing_jit

    monkeypatch.setattr(packing_jit, "MIN_ITEMS", 10**9)


@pytest.mark.parametrize("seed", range(12))
def test_compiled_lpt_places_every_item_as_the_python_loop(seed, monkeypatch):
    """Oracle: lpt's Python heap loop, on the same inputs: count, min-count, token cap (loose and
    strict), with ties; identical lists (the compiled loop's heap pops bins in (load, bin) order)."""
    from sparsebalance import jit

    if not jit.warm():
        pytest.skip("numba is not installed: lpt runs its Python loop only")
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(1100, 2600))
    bins = int(rng.integers(2, 300))
    tokens = rng.integers(1, 4000, n).astype(float)
    costs = np.round(tokens ** 1.3 * rng.uniform(0.8, 1.2, n), int(rng.integers(-2, 2)))  # ties
    cap = float(tokens.sum() / bins * rng.uniform(0.9, 1.6))
    mc = int(rng.integers(0, n // bins + 1))
    count_n = n - n % bins
    cases = [{"costs": costs, "bins": bins, "min_count": mc, "tokens": tokens, "token_cap": cap},
             {"costs": costs, "bins": bins, "min_count": 1, "tokens": tokens, "token_cap": cap, "strict_cap": True},
             {"costs": costs[:count_n], "bins": bins, "count": count_n // bins},
             {"costs": costs, "bins": bins}]
    compiled = [packing.lpt(**c) for c in cases]
    _python_lpt(monkeypatch)
    assert compiled == [packing.lpt(**c) for c in cases]
