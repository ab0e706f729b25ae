"""The reference against independent oracles: dense SDPA, a per-token loop, brute-force selection."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from sparsebalance.kernels.moba.naive import moba_attention_naive, naive_selection

B = 16


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
def test_full_budget_equals_dense_causal_sdpa(kv_heads, make_packed, dense_causal):
    p = make_packed(kv_heads=kv_heads)
    out = moba_attention_naive(p.q, p.k, p.v, p.cu, B, 100)
    assert torch.allclose(out, dense_causal(p.q, p.k, p.v, p.cu), rtol=0, atol=1e-12)


def test_small_budget_differs_from_dense(packed, dense_causal):
    out = moba_attention_naive(packed.q, packed.k, packed.v, packed.cu, B, 2)
    assert (out - dense_causal(packed.q, packed.k, packed.v, packed.cu)).abs().max() > 1e-2


def test_matches_per_token_loop(make_packed):
    """Each output row equals softmax over an explicitly listed key set (own block + chosen blocks)."""
    p = make_packed(lens=(70,), heads=2, kv_heads=1, dim=4, seed=3)
    topk = 3
    out = moba_attention_naive(p.q, p.k, p.v, p.cu, B, topk)
    L = 70
    means = [p.k[j * B:min((j + 1) * B, L), 0].mean(0) for j in range(math.ceil(L / B))]
    for t in range(L):
        c = t // B
        for h in range(2):
            scores = [(float(p.q[t, h] @ means[j]), -j) for j in range(c)]
            chosen = [-nj for _, nj in sorted(scores, reverse=True)[:topk - 1]]
            keys = list(range(c * B, t + 1)) + [s for j in chosen for s in range(j * B, (j + 1) * B)]
            w = torch.softmax(p.q[t, h] @ p.k[keys, 0].T / math.sqrt(4), dim=0)
            assert torch.allclose(out[t, h], w @ p.v[keys, 0], atol=1e-12)


def test_selection_tie_break_prefers_lower_block():
    """Identical key blocks give equal gate scores: the lower block index must win."""
    k = torch.ones(80, 1, 4, dtype=torch.float64)
    q = torch.randn(80, 1, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    sel = naive_selection(q, k, B, 3)  # two past blocks chosen among equal scores
    for t in range(80):
        c = t // B
        expect = list(range(min(c, 2)))
        assert sel[t, 0].nonzero().flatten().tolist() == expect


def test_gradients_flow_to_q_k_v(packed):
    q, k, v = packed.cast(torch.float64, grad=True)
    moba_attention_naive(q, k, v, packed.cu, B, 2).pow(2).sum().backward()
    for x in (q, k, v):
        assert x.grad is not None and x.grad.abs().sum() > 0
