"""Test doubles for the policies: a closed-form latency model and a context builder.

Imported by the tests as ``policy_doubles`` (this directory is on sys.path under pytest's default
import mode); conftest.py only re-exports the context builder as a fixture."""

from __future__ import annotations

import numpy as np

from sparsebalance.data.sequence import Sequence
from sparsebalance.policies.base import PolicyContext
from sparsebalance.policies.config import PolicyConfig
from sparsebalance.policies.coverage import make_coverage_model
from sparsebalance.simulator.budget import Budget
from sparsebalance.simulator.config import ClusterConfig, ModelConfig
from sparsebalance.simulator.cost.query import ScalarMicrobatchLatency


class ClosedFormLatency(ScalarMicrobatchLatency):
    """F + B seconds of a micro-batch: per layer, attention a * L * min(k, n_blocks) * B (attended
    key tokens) plus dense c * L; a per-layer budget sums its layers. Non-decreasing in k. The
    micro-batch part of ``LatencyQuery`` (its vectorised method inherited)."""

    def __init__(self, layers: int = 4, block: int = 256, a: float = 1e-10, c: float = 1e-7):
        self.layers, self.block, self.a, self.c = layers, block, a, c
        self.calls = 0

    def layer(self, lengths, k: int) -> float:
        t = 0.0
        for L in lengths:
            n = -(-L // self.block)
            t += self.a * L * min(k, n) * self.block + self.c * L
        return t

    def microbatch_latency(self, lengths, budget) -> float:
        self.calls += 1
        return sum(self.layer(lengths, k) for k in Budget.of(budget).expand(self.layers))


def make_ctx(*, dp=2, pp=1, global_batch=8, micro_batch_size=1, layers=4, block=256,
             latency=None, seed=0, **policy) -> PolicyContext:
    model = ModelConfig(name="t", hidden=64, layers=layers, heads=4, kv_heads=2, head_dim=16,
                        ffn=128, vocab=256, block_size=block)
    cluster = ClusterConfig(pp=pp, dp=dp, global_batch=global_batch,
                            micro_batch_size=micro_batch_size)
    pol = PolicyConfig(**policy)
    return PolicyContext(model=model, cluster=cluster, policy=pol,
                         latency=latency or ClosedFormLatency(layers=layers, block=block),
                         coverage=make_coverage_model(model, pol, seed=seed),
                         rng=np.random.default_rng(seed))


def random_batch(n: int, seed: int, lo: int = 256, hi: int = 65536, sens: bool = True):
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(np.log(lo), np.log(hi), n)).astype(int)
    return [Sequence(id=i, length=int(l), sensitivity=float(np.exp(rng.normal(0, 0.5))) if sens else None)
            for i, l in enumerate(lengths)]


def check_plan(plan, batch, dp):
    """Every sequence exactly once, dp ranks, equal non-zero micro-batch counts, no empty ones."""
    assert plan.dp == dp
    counts = {len(r) for r in plan.ranks}
    assert len(counts) == 1 and counts.pop() >= 1
    assert all(len(mb.sequences) >= 1 for _, _, mb in plan.microbatches())
    assert sorted(s.id for s in plan.sequences()) == sorted(s.id for s in batch)
