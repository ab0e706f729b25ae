"""``fixed-dense``: k0, or full attention where the latency table predicts it no slower (oracle: the
latency model asked one micro-batch at a time)."""

import numpy as np
import pytest

from sparsebalance.data.sequence import Sequence
from sparsebalance.policies.base import PolicyContext
from sparsebalance.policies.config import PolicyConfig
from sparsebalance.policies.coverage import make_coverage_model
from sparsebalance.policies.registry import make_batching, make_tuning
from sparsebalance.simulator.config import ClusterConfig, tiny
from sparsebalance.simulator.cost.latency import load_latency_model

pytestmark = pytest.mark.filterwarnings("ignore:profile .*latency falls")


def _setup(k0: int, k_max: int):
    m = tiny()
    cl = ClusterConfig(name="cpu-pp2", device="cpu", pp=2, dp=1, global_batch=16)
    lat = load_latency_model("cpu-tiny-long", m, cl, allow_nonmonotone=True)
    pol = PolicyConfig(batching="lbb", tuning="fixed-dense", k0=k0, k_max=k_max)
    ctx = PolicyContext(model=m, cluster=cl, policy=pol, latency=lat, coverage=make_coverage_model(m, pol))
    return m, lat, pol, ctx


def test_dense_exactly_where_the_table_says_it_is_no_slower():
    m, lat, pol, ctx = _setup(k0=32, k_max=64)
    rng = np.random.default_rng(3)
    lengths = rng.integers(700, 8192, 16).tolist() + [2048, 1024, 1500]
    batch = [Sequence(id=i, length=int(n), sensitivity=1.0) for i, n in enumerate(lengths)]
    plan = make_batching(pol).plan(batch, ctx)
    tuning = make_tuning(pol)
    budgets = tuning.budgets(plan, ctx)
    raised = 0
    for r, j, mb in plan.microbatches():
        k = budgets[r][j].mean()
        full = -(-max(mb.lengths) // m.block_size)
        dense_ok = 32 < full <= 64 and lat.microbatch_latency(mb.lengths, full) <= lat.microbatch_latency(mb.lengths, 32)
        want = full if dense_ok else 32
        assert k == want, (mb.lengths, k, want)
        assert k >= 32  # never sparser than fixed
        raised += k > 32
    assert raised > 0  # the 2,048-token sequence: the CPU path's sparse k0 costs more than dense there
    assert tuning.stats["raised"] == raised
    flat = [b.mean() for rank in budgets for b in rank]
    assert tuning.stats["mean_budget"] == np.mean(flat)


def test_k_max_below_the_block_count_keeps_k0():
    _, _, pol, ctx = _setup(k0=32, k_max=48)
    batch = [Sequence(id=0, length=2048, sensitivity=1.0), Sequence(id=1, length=4096, sensitivity=1.0)]
    plan = make_batching(pol).plan(batch, ctx)
    assert {b.mean() for rank in make_tuning(pol).budgets(plan, ctx) for b in rank} == {32}
