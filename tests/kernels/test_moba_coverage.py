"""Coverage against brute force; full budget is 1, and coverage never drops as k grows."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sparsebalance.kernels import moba_coverage
from sparsebalance.kernels.moba import coverage as coverage_mod
from sparsebalance.kernels.moba.naive import moba_coverage_naive

B = 16
TOPKS = [1, 2, 3, 4, 6, 9]


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_matches_bruteforce(kv_heads, make_packed, monkeypatch):
    p = make_packed(kv_heads=kv_heads, seed=5)
    monkeypatch.setattr(coverage_mod, "ROW_CHUNK", 7)  # several row chunks per sequence
    got = moba_coverage(p.q.float(), p.k.float(), p.cu, B, TOPKS)
    ref = moba_coverage_naive(p.q.float(), p.k.float(), p.cu, B, TOPKS)
    assert got.shape == (len(p.lens), len(TOPKS)) and got.dtype == torch.float64
    assert torch.allclose(got, ref, atol=1e-9)


def test_full_budget_is_one_and_non_decreasing(make_packed):
    p = make_packed(lens=(200, 70, 5), seed=2)
    cov = moba_coverage(p.q, p.k, p.cu, B, list(range(1, 15)))
    assert torch.all(cov[:, -1] == 1.0)                     # 13 blocks max: k = 14 keeps all
    assert torch.all(cov[:, 1:] >= cov[:, :-1] - 1e-12)
    assert torch.all(cov[2] == 1.0)                         # 5 tokens: no past block, nothing dropped
    assert float(cov[0, 0]) == 0.0 and 0.0 < float(cov[0, 1]) < 1.0


def test_one_past_block_gets_its_full_share():
    """Two blocks: every query with a past block has exactly one, so k >= 2 keeps everything."""
    q = torch.randn(32, 2, 4, generator=torch.Generator().manual_seed(0))
    k = torch.randn(32, 1, 4, generator=torch.Generator().manual_seed(1))
    cov = moba_coverage(q, k, torch.tensor([0, 32], dtype=torch.int32), B, [1, 2])
    assert cov.tolist() == [[0.0, 1.0]]
